"""Task-level routing (Ye et al. 2022, "Eliciting and understanding cross-task skills with task-level
mixture-of-experts", section 4): a router reads the task's embedding and decides, for every routed layer,
how much each of its `m` experts contributes; the layer outputs `sum_j D_ij E^(i,j)(h)` (eq. 1).

- Routers (`ROUTER_TYPES`, section 5.1 (e)-(g)): `mlp` (two dense layers around a GELU), `lstm` (a
  Bi-LSTM over the layers, input = task embedding + the layer's position embedding) and `transformer`
  (one encoder layer over the same input). Each maps task embeddings `(tasks, d)` to logits
  `L (tasks, layers, experts)`.
- Selection functions (`SELECTION_FUNCTIONS`, (a)-(d)): `average` (`D = 1/m`, the logits are ignored),
  `softmax`, `gumbel_softmax` and `gumbel_softmax_st` (straight-through: one-hot forward values, soft
  gradients), the Gumbel ones with an annealed temperature; plus `hard` (not in the paper): a Gumbel-max
  route trained through the chosen expert only, with Switch Transformer's `p_k / sg(p_k)` estimator, so a
  training step runs one expert per layer and row. At evaluation the Gumbel noise is off; `gumbel_softmax_st`
  and `hard` then pick the arg-max expert: a hard route.
- `RoutedLayer` runs the experts of one layer, computing only what is used: each expert runs on the rows
  whose decision for it is not 0 (one expert on the whole batch when the batch is one task and the route is
  hard), in training and in generation alike; only straight-through training, whose gradient reaches the
  router through experts with decision 0, runs every expert on every row.

Routing is per task, not per token: every row of a task gets the same decisions, and Gumbel noise is drawn
once per task and step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache

from ..compat import CACHE_ARGS
from ..utils import is_capturing, lookup


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


def _one_hot(choice: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return nn.functional.one_hot(choice, like.shape[-1]).to(like.dtype)


def select_gumbel_softmax(logits, disabled=None, temperature=1.0, training=False, generator=None):
    logits = _masked(logits, disabled)
    if training:
        logits = logits + _gumbel(logits, generator)
    return torch.softmax(logits / temperature, dim=-1)


def select_gumbel_softmax_st(logits, disabled=None, temperature=1.0, training=False, generator=None):
    logits = _masked(logits, disabled)
    if not training:  # evaluation: the arg-max expert, no noise
        return _one_hot(logits.argmax(-1), logits)
    soft = torch.softmax((logits + _gumbel(logits, generator)) / temperature, dim=-1)
    hard = _one_hot(soft.argmax(-1), soft)
    # straight-through: forward values are `hard` (exactly 0/1), gradients those of `soft` -- for every
    # expert, so every expert's output is needed in training (`DENSE_GRADIENT_SELECTIONS`)
    return hard + (soft - soft.detach())


def select_hard(logits, disabled=None, temperature=1.0, training=False, generator=None):
    """Hard routing that trains through the chosen expert only (Switch Transformer's estimator).

    Training: the route is a Gumbel-max sample of `softmax(logits / temperature)`; its weight is
    `p_k / sg(p_k)`, exactly 1 in value (the chosen expert's output is used as it is) with the gradient
    `d log p_k`, so the router learns from the chosen expert alone and the others need not run.
    Evaluation: the arg-max expert, as `gumbel_softmax_st`."""
    logits = _masked(logits, disabled)
    if not training:
        return _one_hot(logits.argmax(-1), logits)
    scaled = logits / temperature
    hard = _one_hot((scaled + _gumbel(scaled, generator)).argmax(-1), scaled)
    chosen = (torch.softmax(scaled, dim=-1) * hard).sum(-1, keepdim=True)  # p_k of the chosen expert
    return hard * (chosen / chosen.detach())  # value: exactly 1 at k, 0 elsewhere (x / x == 1 in IEEE)


SELECTION_FUNCTIONS: dict[str, Callable] = {
    "average": select_average,
    "softmax": select_softmax,
    "gumbel_softmax": select_gumbel_softmax,
    "gumbel_softmax_st": select_gumbel_softmax_st,
    "hard": select_hard,
}
# selections whose training gradient reaches the router through experts with decision 0 (straight-through):
# every expert runs on every row in training. The others run only the experts a row's decisions use.
DENSE_GRADIENT_SELECTIONS = ("gumbel_softmax_st",)


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
        self.temperature = 1.0
        # (layers, experts) bool: experts disabled at evaluation (set through the model's `disable_experts`)
        self.register_buffer("disabled", torch.zeros(num_layers, num_experts, dtype=torch.bool), persistent=False)

    @property
    def needs_every_expert(self) -> bool:
        """Whether this step's decisions need every expert's output (straight-through in training)."""
        return self.training and torch.is_grad_enabled() and self.selection in DENSE_GRADIENT_SELECTIONS

    def task_logits(self, task_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Router logits `(tasks, layers, experts)` of the given task ids (default: every task)."""
        weight = self.task_embeddings.weight
        return self.net(weight if task_ids is None else weight[task_ids])

    def task_decisions(self, task_ids: torch.Tensor | None = None, training: bool | None = None) -> torch.Tensor:
        """Decisions `D (tasks, layers, experts)` of the given task ids (default: every task)."""
        return self._decide(self.task_logits(task_ids), self.training if training is None else training)

    def _decide(self, logits: torch.Tensor, training: bool) -> torch.Tensor:
        # in fp32 whatever the autocast dtype: near-ties between experts must not flip with rounding
        with torch.autocast(device_type=logits.device.type, enabled=False):
            return self.select(logits.float(), self.disabled, temperature=self.temperature, training=training)

    def forward(self, task_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # route each task once, every task of the table (a few rows): finding the tasks present would read them back
        with torch.autocast(device_type=task_ids.device.type, enabled=False):
            logits = self.task_logits().float()  # (tasks, layers, experts)
        decisions = self._decide(logits, self.training)
        return decisions.index_select(0, task_ids), logits.index_select(0, task_ids)  # (batch, layers, experts) each


# ----------------------------------------------------------------------------------------------- layers
class PlanEntry(NamedTuple):
    """One expert's share of a routed layer: `rows` (None = every row of the batch) and whether its output must
    be multiplied by its decisions (not when every decision is exactly 1 and carries no gradient)."""

    expert: int
    rows: torch.Tensor | None
    scale: bool


def plan_routes(routing_weights: torch.Tensor, every_expert: bool = False) -> list[list[PlanEntry]]:
    """Which experts of each routed layer run, on which rows: `plan[layer]` lists `PlanEntry`s.

    An expert runs on the rows whose decision for it is not 0 (all rows when `every_expert`, which the
    straight-through gradient needs). Computed once per forward for all layers: the decisions are copied to
    the host once (the one device-to-host sync of the forward), the row indices go back to the device. With
    `every_expert` nothing is read: every expert runs on every row, scaled by its decisions. So it is under capture
    (`torch.export`, ONNX, `torch.jit.trace`: `hf_taskmoe.utils.is_capturing`) and under `torch.compile`, where no
    shape may depend on the routes: the routes stay tensors, and an expert a row does not use adds 0 times its output
    (a hard route gives the chosen expert's output exactly).
    """
    if every_expert or is_capturing() or torch.compiler.is_compiling():  # compiled: one graph for every route
        return every_expert_plan(*routing_weights.shape[1:])
    host = routing_weights.detach().float().cpu()  # (batch, layers, experts); the forward's one host sync
    return _plan_from_host(host, routing_weights.device, routing_weights.requires_grad and torch.is_grad_enabled())


def every_expert_plan(layers: int, experts: int) -> list[list[PlanEntry]]:
    """Every expert of every routed layer on every row, scaled by its decisions (reads nothing)."""
    return [[PlanEntry(j, None, scale=True) for j in range(experts)] for _ in range(layers)]


def hard_route_plan(routing_weights: torch.Tensor, grouped: bool = True) -> list[list[PlanEntry]]:
    """`plan_routes` for generation: the plan of one-hot decisions (each row's one expert per layer, unscaled), or
    the every-expert plan when some row's route is soft (a soft route's cost is the method's). One host read of the
    decisions: a generation step reuses the plan its first step made (`ExpertRowsCache.routing_plan`). `grouped`: a
    layer whose rows use several experts runs them as one layer (`grouped_routes.GroupedRoute`), else one layer call
    per expert on its rows."""
    host = routing_weights.detach().float().cpu()  # (batch, layers, experts); one read per `generate` call
    if not (((host == 0) | (host == 1)).all() and (host.sum(-1) == 1).all()):
        return every_expert_plan(*host.shape[1:])
    plan = _plan_from_host(host, routing_weights.device, grad=False)
    if grouped:
        from .grouped_routes import grouped_route

        row_experts = host.argmax(-1).T.tolist()  # (layers, batch): each row's expert (the decisions are one-hot)
        plan = [grouped_route(entries, row_experts[layer], host.shape[-1]) for layer, entries in enumerate(plan)]
    return plan


def _plan_from_host(host: torch.Tensor, device, grad: bool) -> list[list[PlanEntry]]:
    """The plan of host decisions `(batch, layers, experts)`; row indices on `device`."""
    _, layers, experts = host.shape
    used = host != 0
    plan = []
    for layer in range(layers):
        entries = []
        for j in range(experts):
            column = used[:, layer, j]
            if bool(column.all()):
                rows = None
            elif bool(column.any()):
                rows = column.nonzero().squeeze(-1).to(device, non_blocking=True)
            else:
                continue
            unit = bool((host[:, layer, j][column] == 1).all())
            entries.append(PlanEntry(j, rows, scale=grad or not unit))
        plan.append(entries)
    return plan


#: layer arguments that are never per row, whatever their length (the positions of the step's tokens)
_NOT_PER_ROW = frozenset({"cache_position"})


def _rows(value, rows: torch.Tensor, batch: int):
    """`value` restricted to `rows` when it is a per-row tensor (masks, encoder states, positions) or a tuple of them
    (rotary `(cos, sin)`); else unchanged."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch:
        return value.index_select(0, rows)
    if isinstance(value, tuple) and any(isinstance(v, torch.Tensor) for v in value):
        return tuple(_rows(v, rows, batch) for v in value)
    return value


def call_on_rows(module, rows: torch.Tensor | None, hidden_states: torch.Tensor, args: tuple, kwargs: dict):
    """`module(hidden_states, *args, **kwargs)` on the batch's `rows` (None: every row): each per-row argument (masks,
    encoder states, positions, a per-row position bias) restricted to them (`_rows`), a broadcast one (batch dim 1)
    and the step's positions (`_NOT_PER_ROW`) left whole."""
    if rows is None:
        return module(hidden_states, *args, **kwargs)
    batch = hidden_states.shape[0]
    return module(hidden_states.index_select(0, rows), *[_rows(a, rows, batch) for a in args],
                  **{k: v if k in _NOT_PER_ROW else _rows(v, rows, batch) for k, v in kwargs.items()})


class RouteRecorder:
    """What `output_hidden_states` / `output_attentions` ask of one pass through a stack of `RoutedLayer`s.

    transformers records a model's hidden states and attentions with hooks on its layer and attention classes; a
    routed layer holds several copies of them (its experts), each run on some rows, so those hooks would record
    each expert on its own. The stack's hooks switch transformers' recording off for the stack and hand a recorder
    to its layers instead; each layer records its mixed output and the mixture of its experts' attention
    probabilities `sum_j D_ij A^(i,j)` (for a hard route: the chosen expert's), each `(batch, heads, q, k)`.

    `hidden_states` may also be a list of indices into the hidden states (transformers'
    `output_hidden_states=[0, 2, -1]`; negative ones count from the end): the output then has one entry per hidden
    state as before, None where the index was not asked for.
    """

    def __init__(self, hidden_states: bool | list[int] | tuple[int, ...], attentions: bool,
                 attention_kinds: dict[str, str]):
        self.keep: tuple[int, ...] | None = None
        if isinstance(hidden_states, (list, tuple)):
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in hidden_states):
                raise ValueError(f"`output_hidden_states` must be a bool or a list of indices, got {hidden_states!r}.")
            self.keep = tuple(hidden_states)
        self.hidden_states: list[torch.Tensor] | None = [] if hidden_states else None
        #: output field -> the path of the attention submodule of an expert it reads (`{"attentions": "self_attn"}`)
        self.kinds = attention_kinds if attentions else {}
        self.attentions: dict[str, list[torch.Tensor | None]] = {kind: [] for kind in self.kinds}

    def record_input(self, hidden_states: torch.Tensor) -> None:
        if self.hidden_states is not None and not self.hidden_states:
            self.hidden_states.append(hidden_states)  # the embedding output, as transformers records it

    def record_output(self, hidden_states: torch.Tensor | tuple) -> None:
        """Record a layer's output: its hidden states, the first entry where the layer returns a tuple (a layer
        left whole, low-rank experts: Falcon's returns `(hidden states, attention weights)`, as its model reads)."""
        if self.hidden_states is not None:
            self.hidden_states.append(hidden_states[0] if isinstance(hidden_states, tuple) else hidden_states)

    def watch(self, expert: nn.Module) -> tuple[dict[str, list], list]:
        """Hooks on `expert`'s attention modules that keep their probabilities; remove the handles afterwards."""
        seen: dict[str, list] = {kind: [] for kind in self.kinds}
        handles = []
        for kind, path in self.kinds.items():
            try:
                module = expert.get_submodule(path)
            except AttributeError:  # an encoder layer has no cross-attention
                continue
            handles.append(
                module.register_forward_hook(  # (output, [position bias,] probabilities): the last is the probabilities
                    lambda _m, _a, out, kept=seen[kind]: kept.append(
                        out[-1] if isinstance(out, tuple) and len(out) > 1 else None
                    )
                )
            )
        return seen, handles

    def outputs(self) -> dict[str, tuple | None]:
        fields = {kind: tuple(values) if values and all(v is not None for v in values) else None
                  for kind, values in self.attentions.items()}
        if self.hidden_states is not None:
            states = self.hidden_states
            if self.keep is not None:
                n = len(states)
                wrong = [i for i in self.keep if not -n <= i < n]
                if wrong:
                    raise ValueError(f"`output_hidden_states` indices {wrong} are out of range for {n} hidden states.")
                kept = {i % n for i in self.keep}
                states = [h if i in kept else None for i, h in enumerate(states)]
            fields["hidden_states"] = tuple(states)
        return fields


class RoutedLayer(nn.Module):
    """One layer forked into experts; takes the wrapped layers' call signature plus `routing_weights`
    (`(batch, routed layers, experts)`, read at this layer's `route_index`) and, from the model,
    `routing_plan` (`plan_routes(...)`, computed once per forward). A layer with one expert and no route is
    a plain layer (it ignores the routing).

    Only the experts a row's decisions use run, each on its rows (the whole batch when every row uses it),
    in training too -- except under straight-through training, whose gradient needs every expert. With a
    key/value cache (generation) each expert writes its own cache slot (`cache_slots`); an expert that serves only
    some rows keeps only those rows in its slot, which `RoutedCache` records so that beam search can reorder it.
    With a `routing_recorder` (a `RouteRecorder`) the layer records its output and its attention probabilities.

    `run_plan` is the one loop over a plan's experts. A layer that returns more than its hidden states (T5's block:
    its position biases) adds what it needs through `_split_output` / `_mix_extras` / `_join_output` and, for the
    grouped copy of a generation plan, `_grouped_unused` / `_grouped_args` / `_extra_rows`."""

    def __init__(self, experts: list[nn.Module], route_index: int | None):
        super().__init__()
        self.experts = nn.ModuleList(experts)
        self.route_index = route_index
        #: the key/value cache slot of each expert (its attention's `layer_idx`, set by the model that forks the layer
        #: from its backbone's `attention` path); empty: the layer keeps no cache (an encoder layer)
        self.cache_slots: list[int] = []

    def cache_slot(self, j: int) -> int | None:
        """The key/value cache slot expert `j` writes; None for a layer that keeps no cache."""
        return self.cache_slots[j] if self.cache_slots else None

    def forward(self, hidden_states, *args, routing_weights=None, routing_plan=None, task_ids=None,
                routing_recorder: RouteRecorder | None = None, **kwargs):
        if self.route_index is None:
            entries = [PlanEntry(0, None, False)]
        else:
            if routing_weights is None:
                raise ValueError("A routed layer needs `routing_weights`: call the model with `task_ids`.")
            if routing_plan is None:  # called on its own, not through the model
                routing_plan = plan_routes(routing_weights)
            entries = routing_plan[self.route_index]
        return self.run_plan(entries, hidden_states, args, kwargs, routing_weights, routing_recorder)

    def run_plan(self, entries, hidden_states, args: tuple, kwargs: dict, routing_weights=None,
                 recorder: RouteRecorder | None = None):
        """Run the plan's `entries` (this layer's `PlanEntry`s, or a `GroupedRoute`) on the layer's arguments: each
        expert on its rows, scaled by its decisions where the entry says so, the outputs summed (eq. 1); a grouped
        route's copy of the layer on every row where one is built (generation, no recorder, no gradient)."""
        if recorder is not None:
            recorder.record_input(hidden_states)
        batch = hidden_states.shape[0]
        cache = next((kwargs[n] for n in CACHE_ARGS if kwargs.get(n) is not None), None)
        if cache is None:  # GPT-2's loop passes its cache by position
            cache = next((a for a in args if isinstance(a, Cache)), None)
        slots = cache is not None and hasattr(cache, "set_slot_rows") and self.cache_slot(0) is not None
        grouped = getattr(entries, "module", None)
        if grouped is not None and recorder is None and not torch.is_grad_enabled():
            layer = grouped(self.experts, self._grouped_unused(args))  # every expert as one layer (generation)
            if layer is not None:
                order = entries.order  # None: the segments are runs of the batch's own order
                if slots:
                    cache.set_slot_rows(self.cache_slot(0), order)  # expert 0's slot keeps every row (sorted)
                args = self._grouped_args(entries, hidden_states, args, cache)
                h, extra = self._split_output(call_on_rows(layer, order, hidden_states, args, kwargs))
                if order is not None:
                    h, extra = h.index_select(0, entries.inverse), self._extra_rows(extra, entries.inverse, batch)
                return self._join_output(h, extra, args)
        mixed = extras = None
        attentions: dict[str, torch.Tensor | None] = {kind: None for kind in (recorder.kinds if recorder else ())}
        missing: set[str] = set()
        for j, rows, scale in entries:
            expert = self.experts[j]
            if slots:
                # the expert's slot keeps its rows only; its length is its own (T5's block 0 reads it), not a filled
                # slot's
                cache.set_slot_rows(self.cache_slot(j), rows)
            seen, handles = recorder.watch(expert) if recorder is not None else ({}, [])
            try:
                h, extra = self._split_output(call_on_rows(expert, rows, hidden_states, args, kwargs))
            finally:
                for handle in handles:
                    handle.remove()
            share = None
            if scale:  # each row's decision for this expert (rows,); an unscaled one is exactly 1: none to read
                weights = routing_weights[:, self.route_index]  # (batch, experts)
                share = (weights if rows is None else weights.index_select(0, rows))[:, j].to(hidden_states.dtype)
                h = h * share[:, None, None]  # (rows, seq, hidden)
            mixed = _scatter_rows(mixed, h, rows, hidden_states)
            extras = self._mix_extras(extras, extra, rows, share, batch, args)
            for kind, probs in seen.items():
                if probs and probs[-1] is not None:
                    # an expert whose output is not scaled gives its own probabilities (they keep their autograd
                    # history); a weighted mixture of several experts' is a new tensor the logits do not depend on
                    p = probs[-1] * share.to(probs[-1].dtype)[:, None, None, None] if scale else probs[-1]
                    attentions[kind] = _scatter_rows(attentions[kind], p, rows, None, batch)  # (batch, heads, q, k)
                else:
                    missing.add(kind)
        if recorder is not None:
            recorder.record_output(mixed)
            for kind, value in attentions.items():
                recorder.attentions[kind].append(None if kind in missing else value)
        return self._join_output(mixed, extras, args)

    # what a layer returning more than its hidden states adds (T5's block); the defaults: hidden states only
    def _split_output(self, output):
        """An expert's (or the grouped copy's) output as `(hidden states, the rest)`."""
        return output, None

    def _mix_extras(self, total, extra, rows: torch.Tensor | None, share: torch.Tensor | None, batch: int,
                    args: tuple):
        """`total` (None at first) with one expert's `extra` on its `rows`, scaled by `share` (None: unscaled)."""
        return None

    def _join_output(self, hidden_states: torch.Tensor, extras, args: tuple):
        """What the layer returns: its mixed hidden states and the mixed rest."""
        return hidden_states

    def _extra_rows(self, extra, inverse: torch.Tensor, batch: int):
        """The grouped copy's `extra`, computed on the rows sorted by expert, in the batch's order (`inverse`)."""
        return extra

    def _grouped_unused(self, args: tuple) -> tuple[str, ...]:
        """Paths, in an expert, of parameters the grouped copy does not run (may differ per expert)."""
        return ()

    def _grouped_args(self, entries, hidden_states: torch.Tensor, args: tuple, cache) -> tuple:
        """The grouped copy's positional arguments, after its cache slot took the rows."""
        return args


def _scatter_rows(total, y, rows, like, batch: int | None = None):
    """`total + y`, where `y` holds the rows `rows` of the batch (all rows when None), in `y`'s dtype (a block may
    return another dtype than it reads: T5's feed-forward output stays fp32 in an fp16 model)."""
    if rows is None:
        return y if total is None else total + y
    if total is None:
        total = y.new_zeros(like.shape if like is not None else (batch, *y.shape[1:]))
    return total.index_add(0, rows, y)


def _slot_index(rows: torch.Tensor | None, beam_idx: torch.Tensor) -> torch.Tensor:
    """Beam search's reordering `beam_idx` (batch rows) as positions inside a cache slot that keeps `rows` only. Beams
    move only inside one example (one task, one route), so each kept row's source is a kept row too."""
    if rows is None:
        return beam_idx
    position = torch.full(beam_idx.shape, -1, dtype=torch.long, device=beam_idx.device)
    position[rows] = torch.arange(len(rows), device=rows.device)
    return position[beam_idx[rows]]  # each kept row's source, as a position inside the slot


class SlotRows:
    """What a task-routed cache keeps beside its key/value slots: `slot_rows[slot]`, the rows of the batch an expert's
    slot holds when the expert serves only some rows (absent: every row), the same rows at every step (a row's task
    does not change during generation), so that beam search's reordering, which moves rows only inside one example
    (one task), is translated into each slot's own row positions; and the generation's plan: `routing_plan` (made by
    `hard_route_plan` at the first step from the decisions, the generation's one host read, and reused by every later
    step), `plan_batch` (its rows) and `plans_routes` (set by `generate` on its fresh cache: make the plan; without it
    -- a cache passed by hand -- every expert runs on every row). Put before the transformers cache class. Such a
    cache cannot drop or repeat rows (its slots hold different rows): it refuses."""

    slot_rows: dict[int, torch.Tensor]

    def _init_slot_rows(self) -> None:
        self.slot_rows = {}
        #: the slots an expert has run with (`set_slot_rows`): their own lengths are real, even while still empty in
        #: the step that fills them (a T5 block's later experts read their own past length mid-step)
        self.used_slots: set[int] = set()
        self.routing_plan: list[list[PlanEntry]] | None = None
        self.plan_batch: int | None = None
        self.plans_routes = False
        #: the decisions and router logits the plan was made from, for the later steps (the router runs once)
        self.kept_routes: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def set_slot_rows(self, slot: int, rows: torch.Tensor | None) -> None:
        """Record that the expert of `slot` runs, on `rows` (None: every row), before it runs."""
        self.used_slots.add(slot)
        if rows is None:
            self.slot_rows.pop(slot, None)
        else:
            self.slot_rows[slot] = rows

    def batch_select_indices(self, indices: torch.Tensor):
        if self.slot_rows:
            raise NotImplementedError("A task-routed cache with experts serving a subset of rows cannot drop rows.")
        super().batch_select_indices(indices)

    def batch_repeat_interleave(self, repeats: int):
        if self.slot_rows:
            raise NotImplementedError("A task-routed cache with experts serving a subset of rows cannot repeat rows.")
        super().batch_repeat_interleave(repeats)


class RoutedCache(SlotRows, EncoderDecoderCache):
    """The key/value cache of a task-routed encoder-decoder (`TaskRoutedForSeq2SeqLM`): an `ExpertRowsCache` for the
    decoder's self-attention and one for its cross-attention, one slot per decoder expert in each (the expert's
    attentions' `layer_idx`). The slot rows (`SlotRows`) are kept here and shared by both halves."""

    def __init__(self, self_attention_cache: ExpertRowsCache | None = None,
                 cross_attention_cache: ExpertRowsCache | None = None):
        super().__init__(self_attention_cache if self_attention_cache is not None else ExpertRowsCache(),
                         cross_attention_cache if cross_attention_cache is not None else ExpertRowsCache())
        self._init_slot_rows()
        for half in (self.self_attention_cache, self.cross_attention_cache):
            half.slot_rows = self.slot_rows  # one record of each slot's rows, for both attentions (and beam search)
            half.used_slots = self.used_slots


class ExpertRowsCache(SlotRows, DynamicCache):
    """The key/value cache of a task-routed decoder (`TaskRoutedForCausalLM`; both halves of a `RoutedCache`): the dense
    layout, then a slot per expert copy (`fork_layers`), each slot the dense layer kind of its layer (full or sliding
    window). Generation under hard routes runs, in each routed layer, only the experts some row uses, each on its own
    rows, and each expert's slot keeps only those rows (`SlotRows`).

    A slot an expert no row uses stays empty, so the lengths the dense model reads before its layers run (past
    length, mask sizes) come from a filled slot of the same kind: every filled slot saw every step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_slot_rows()

    def _filled(self, layer_idx: int) -> int:
        """`layer_idx`, or a filled slot of its kind when it is empty and no expert ran with it (an expert no row
        uses). A slot an expert runs with is its own length, also in the step that fills it: T5's later experts of
        block 0 read their own (empty) slot's past length after expert 0 filled its own."""
        layers = self.layers
        if layer_idx >= len(layers) or layer_idx in self.used_slots or layers[layer_idx].get_seq_length() > 0:
            return layer_idx
        sliding = getattr(layers[layer_idx], "is_sliding", False)
        return next((i for i, layer in enumerate(layers)
                     if getattr(layer, "is_sliding", False) == sliding and layer.get_seq_length() > 0), layer_idx)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return super().get_seq_length(self._filled(layer_idx))

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return super().get_mask_sizes(query_length, self._filled(layer_idx))

    def reorder_cache(self, beam_idx: torch.LongTensor):
        for slot, layer in enumerate(self.layers):
            layer.reorder_cache(_slot_index(self.slot_rows.get(slot), beam_idx))

