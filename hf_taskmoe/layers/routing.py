"""Task-level routing (Ye et al. 2022, "Eliciting and understanding cross-task skills with task-level
mixture-of-experts", section 4): a router reads the task's embedding and decides, for every routed layer,
how much each of its `m` experts contributes; the layer outputs `sum_j D_ij E^(i,j)(h)` (eq. 1).

- Routers (`ROUTER_TYPES`, section 5.1 (e)-(g)): `mlp` (two dense layers around a GELU), `lstm` (a
  Bi-LSTM over the layers, input = task embedding + the layer's position embedding) and `transformer`
  (one encoder layer over the same input). Each maps task embeddings `(tasks, d)` to logits
  `L (tasks, layers, experts)`.
- Selection functions (`SELECTION_FUNCTIONS`, (a)-(d)): `average` (`D = 1/m`, the logits are ignored),
  `softmax`, `gumbel_softmax` and `gumbel_softmax_st` (straight-through: one-hot forward values, soft
  gradients), the Gumbel ones with an annealed temperature. At evaluation the Gumbel noise is off;
  `gumbel_softmax_st` then picks the arg-max expert: a hard route.
- `RoutedLayer` runs the experts of one layer, computing only what is used: with hard decisions and no
  gradient to the router, each expert runs on the rows that chose it (one expert on the whole batch when
  the batch is one task); with soft decisions every expert with a non-zero weight runs.

Routing is per task, not per token: every row of a task gets the same decisions, and Gumbel noise is drawn
once per task and step.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from ..utils import lookup


# ----------------------------------------------------------------------------------------------- selection
def _masked(logits: torch.Tensor, disabled: torch.Tensor | None) -> torch.Tensor:
    """Disabled experts (section 6.2) get logit -inf, so no selection function can pick them."""
    if disabled is None:
        return logits
    return logits.masked_fill(disabled, float("-inf"))


def select_average(logits, disabled=None, temperature=1.0, training=False, generator=None):
    # (a) Average routing: every (enabled) expert weighs the same; the router is not used.
    return torch.softmax(_masked(torch.zeros_like(logits), disabled), dim=-1)


def select_softmax(logits, disabled=None, temperature=1.0, training=False, generator=None):
    return torch.softmax(_masked(logits, disabled), dim=-1)


def _gumbel(logits: torch.Tensor, generator=None) -> torch.Tensor:
    uniform = torch.rand(logits.shape, device=logits.device, dtype=torch.float32, generator=generator)
    # -log(-log(u)), u in (0, 1): both logs kept finite
    return -torch.log((-torch.log(uniform.clamp_min(1e-20))).clamp_min(1e-20)).to(logits.dtype)


def select_gumbel_softmax(logits, disabled=None, temperature=1.0, training=False, generator=None):
    logits = _masked(logits, disabled)
    if training:
        logits = logits + _gumbel(logits, generator)
    return torch.softmax(logits / temperature, dim=-1)


def select_gumbel_softmax_st(logits, disabled=None, temperature=1.0, training=False, generator=None):
    logits = _masked(logits, disabled)
    if not training:  # evaluation: the arg-max expert, no noise
        return nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    soft = torch.softmax((logits + _gumbel(logits, generator)) / temperature, dim=-1)
    hard = nn.functional.one_hot(soft.argmax(-1), soft.shape[-1]).to(soft.dtype)
    # straight-through: forward values are `hard` (exactly 0/1), gradients those of `soft`
    return hard + (soft - soft.detach())


SELECTION_FUNCTIONS: dict[str, Callable] = {
    "average": select_average,
    "softmax": select_softmax,
    "gumbel_softmax": select_gumbel_softmax,
    "gumbel_softmax_st": select_gumbel_softmax_st,
}
# selections whose evaluation-time decisions are one-hot: one expert per layer runs
HARD_AT_EVAL = ("gumbel_softmax_st",)


def annealed_temperature(step: int, start: float, minimum: float, rate: float) -> float:
    """Gumbel-softmax temperature at optimizer step `step`: `max(minimum, start * exp(-rate * step))`
    (the schedule of Jang et al. 2017, which the paper follows; the paper gives no constants)."""
    return max(minimum, start * math.exp(-rate * step))


# ----------------------------------------------------------------------------------------------- routers
class MLPRouter(nn.Module):
    """(e) Two dense layers separated by a GELU: `(tasks, d) -> (tasks, layers, experts)`."""

    def __init__(self, input_dim: int, hidden_dim: int, num_layers: int, num_experts: int, **_):
        super().__init__()
        self.num_layers, self.num_experts = num_layers, num_experts
        self.dense_in = nn.Linear(input_dim, hidden_dim)
        self.act = nn.GELU()
        self.dense_out = nn.Linear(hidden_dim, num_layers * num_experts)

    def forward(self, task_embeddings: torch.Tensor) -> torch.Tensor:
        logits = self.dense_out(self.act(self.dense_in(task_embeddings)))  # (tasks, layers * experts)
        return logits.view(-1, self.num_layers, self.num_experts)


class _SequenceRouter(nn.Module):
    """Input at step `i` (one step per routed layer): task embedding + position embedding of layer `i`."""

    def __init__(self, input_dim: int, num_layers: int):
        super().__init__()
        self.layer_positions = nn.Embedding(num_layers, input_dim)

    def _steps(self, task_embeddings: torch.Tensor) -> torch.Tensor:
        # (tasks, 1, d) + (1, layers, d) -> (tasks, layers, d)
        return task_embeddings[:, None, :] + self.layer_positions.weight[None, :, :]


class LSTMRouter(_SequenceRouter):
    """(f) A Bi-LSTM over the routed layers, then one logit per expert at each step."""

    def __init__(self, input_dim: int, hidden_dim: int, num_layers: int, num_experts: int, **_):
        super().__init__(input_dim, num_layers)
        self.lstm = nn.LSTM(input_dim, hidden_dim, batch_first=True, bidirectional=True)
        self.dense_out = nn.Linear(2 * hidden_dim, num_experts)

    def forward(self, task_embeddings: torch.Tensor) -> torch.Tensor:
        states, _ = self.lstm(self._steps(task_embeddings))  # (tasks, layers, 2 * hidden)
        return self.dense_out(states)  # (tasks, layers, experts)


class TransformerRouter(_SequenceRouter):
    """(g) One transformer encoder layer (self-attention + two dense layers) over the routed layers."""

    def __init__(self, input_dim: int, hidden_dim: int, num_layers: int, num_experts: int, num_heads: int = 4, **_):
        super().__init__(input_dim, num_layers)
        self.encoder = nn.TransformerEncoderLayer(
            input_dim, num_heads, dim_feedforward=hidden_dim, dropout=0.0, activation="gelu", batch_first=True
        )
        self.dense_out = nn.Linear(input_dim, num_experts)

    def forward(self, task_embeddings: torch.Tensor) -> torch.Tensor:
        return self.dense_out(self.encoder(self._steps(task_embeddings)))  # (tasks, layers, experts)


ROUTER_TYPES: dict[str, type[nn.Module]] = {"mlp": MLPRouter, "lstm": LSTMRouter, "transformer": TransformerRouter}


class TaskEmbedding(nn.Embedding):
    """The look-up table `T` of task representations (its own class: `_init_weights` finds it by type)."""


class TaskRouter(nn.Module):
    """Task embedding table + router network + selection function.

    `forward(task_ids)` returns `(decisions, logits)`, both `(batch, layers, experts)`: the decisions of
    each row's task. The router runs once on the embeddings of the tasks present, not once per row.
    """

    def __init__(
        self, num_tasks: int, embedding_dim: int, hidden_dim: int, num_layers: int, num_experts: int,
        router_type: str = "mlp", selection: str = "gumbel_softmax_st", num_heads: int = 4,
    ):
        super().__init__()
        self.selection = selection
        self.select = lookup(SELECTION_FUNCTIONS, selection, "selection")
        self.task_embeddings = TaskEmbedding(num_tasks, embedding_dim)
        self.net = lookup(ROUTER_TYPES, router_type, "router_type")(
            embedding_dim, hidden_dim, num_layers, num_experts, num_heads=num_heads
        )
        self.num_layers, self.num_experts = num_layers, num_experts
        self.temperature = 1.0
        # (layers, experts) bool: experts disabled at evaluation (set through the model's `disable_experts`)
        self.register_buffer("disabled", torch.zeros(num_layers, num_experts, dtype=torch.bool), persistent=False)

    def task_logits(self, task_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Router logits `(tasks, layers, experts)` of the given task ids (default: every task)."""
        weight = self.task_embeddings.weight
        return self.net(weight if task_ids is None else weight[task_ids])

    def task_decisions(self, task_ids: torch.Tensor | None = None, training: bool | None = None) -> torch.Tensor:
        """Decisions `D (tasks, layers, experts)` of the given task ids (default: every task)."""
        return self._decide(self.task_logits(task_ids), self.training if training is None else training)

    def _decide(self, logits: torch.Tensor, training: bool) -> torch.Tensor:
        disabled = self.disabled if self.disabled.any() else None
        return self.select(logits, disabled, temperature=self.temperature, training=training)

    def forward(self, task_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        present, row_task = torch.unique(task_ids, return_inverse=True)  # route each task once
        logits = self.task_logits(present)  # (present tasks, layers, experts)
        decisions = self._decide(logits, self.training)
        return decisions[row_task], logits[row_task]  # (batch, layers, experts) each


# ----------------------------------------------------------------------------------------------- layers
def _rows(value, rows: torch.Tensor, batch: int):
    """`value` restricted to `rows` when it is a per-row tensor (masks, encoder states); else unchanged."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch:
        return value.index_select(0, rows)
    return value


class RoutedLayer(nn.Module):
    """One layer forked into experts; takes the wrapped layers' call signature plus `routing_weights`
    (`(batch, routed layers, experts)`, read at this layer's `route_index`). A layer with one expert and
    no route is a plain layer (it ignores the routing).

    With a key/value cache (generation) each expert keeps its own cache slot and runs on the whole batch,
    so that every slot stays aligned with the batch (beam search reorders them together).
    """

    def __init__(self, experts: list[nn.Module], route_index: int | None):
        super().__init__()
        self.experts = nn.ModuleList(experts)
        self.route_index = route_index

    def forward(self, hidden_states, *args, routing_weights=None, task_ids=None, **kwargs):
        if self.route_index is None:
            return self.experts[0](hidden_states, *args, **kwargs)
        if routing_weights is None:
            raise ValueError("A routed layer needs `routing_weights`: call the model with `task_ids`.")
        weights = routing_weights[:, self.route_index]  # (batch, experts)
        batch = hidden_states.shape[0]
        # the router needs every expert's output for its gradient (straight-through included)
        run_all = torch.is_grad_enabled() and weights.requires_grad
        used = weights != 0  # (batch, experts)
        rows_per_expert = used.sum(0).tolist()  # one host sync per layer
        cached = kwargs.get("past_key_values") is not None
        out = None
        for j, expert in enumerate(self.experts):
            rows_j = used[:, j]
            if not run_all and rows_per_expert[j] == 0:
                continue
            if run_all or cached or rows_per_expert[j] == batch:
                y = expert(hidden_states, *args, **kwargs)
                if run_all or not bool((weights[:, j] == 1).all()):  # a hard route's weight 1 needs no product
                    y = y * weights[:, j, None, None].to(hidden_states.dtype)
                out = y if out is None else out + y
            else:  # only the rows that use expert j
                rows = rows_j.nonzero().squeeze(-1)
                y = expert(
                    hidden_states.index_select(0, rows),
                    *[_rows(a, rows, batch) for a in args],
                    **{k: _rows(v, rows, batch) for k, v in kwargs.items()},
                ) * weights[rows, j, None, None].to(hidden_states.dtype)
                out = torch.zeros_like(hidden_states) if out is None else out
                out = out.index_add(0, rows, y)
        return out
