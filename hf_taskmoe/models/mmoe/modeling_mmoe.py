"""MMoEModel: Multi-gate Mixture-of-Experts for tabular multi-task data (MMoE paper, sections 3-4).

    Shared-Bottom (eq. 1):  y_k = h^k(f(x))
    OMoE (eq. 5):           y_k = h^k(sum_i g(x)_i f_i(x))
    MMoE (eq. 6-7):         y_k = h^k(sum_i g^k(x)_i f_i(x)),   g^k(x) = softmax(W_gk x)

The experts (and the towers) of all tasks are stacked into `(n, in, out)` weights and run with one
GEMM (or batched matmul) per layer: eight 16-unit experts are far too small for eight separate matmuls to pay off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.utils import ModelOutput

from ...contract import ParameterRoles
from ...input_checks import check_kwargs
from ...modeling_utils import MultiTaskPreTrainedModel
from ...problem_types import problem_type_of
from .configuration_mmoe import MMoEConfig

ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "tanh": torch.tanh, "sigmoid": torch.sigmoid}


@dataclass
class MMoEOutput(ModelOutput):
    """Output of `MMoEModel`.

    Args:
        loss (`torch.FloatTensor` of shape `()`, when `labels` are given):
            Sum over tasks of `loss_weight` x the task's mean loss over the rows that have its label.
        logits (`torch.FloatTensor` of shape `(batch, sum of task output sizes)`):
            Every task's logits side by side (`config.task_output_sizes` columns each, in task order).
        task_losses (`dict[str, torch.FloatTensor]`, when `labels` are given): each task's mean loss (tasks with
            no label in the batch are left out).
        task_logits (`dict[str, torch.FloatTensor]`): each task's `(batch, output size)` logits.
        gate_weights (`torch.FloatTensor` of shape `(batch, num_tasks, num_experts)`, when `output_gates=True` and
            the architecture has gates): each task's softmax gate (OMoE: the one gate repeated per task).
        routing_counts (`torch.FloatTensor` of shape `(1, num_tasks, num_experts)`, when `output_router_logits=True`
            and the architecture has gates): each task's gate weights summed over the batch's rows, as
            `RoutingStatistics` and the routing analytics read them.
    """

    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    task_losses: dict[str, torch.FloatTensor] | None = None
    task_logits: dict[str, torch.FloatTensor] | None = None
    gate_weights: torch.FloatTensor | None = None
    routing_counts: torch.FloatTensor | None = None


class StackedMLP(nn.Module):
    """`copies` independent MLPs of the same shape, run together: input `(batch, in)` (shared by all copies)
    or `(batch, copies, in)`, output `(batch, copies, sizes[-1])`. Parameters `weight_<l>` `(copies, in, out)`."""

    def __init__(self, copies: int, in_size: int, sizes: list[int], bias: bool, act: str, dropout: float):
        super().__init__()
        dims = [in_size, *sizes]
        self.num_layers = len(sizes)
        for layer, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
            self.register_parameter(f"weight_{layer}", nn.Parameter(torch.empty(copies, a, b)))
            self.register_parameter(f"bias_{layer}", nn.Parameter(torch.empty(copies, b)) if bias else None)
        self.act = ACTIVATIONS[act]
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in range(self.num_layers):
            weight, bias = getattr(self, f"weight_{layer}"), getattr(self, f"bias_{layer}")
            copies, size_in, size_out = weight.shape
            if x.dim() == 3 and x.stride(1) == 0:
                x = x[:, 0]  # an input expanded over the copies (Shared-Bottom / OMoE into the towers) is one input
            if x.dim() == 2:
                # every copy reads the same input: one GEMM against the copies side by side
                x = (x @ weight.transpose(0, 1).reshape(size_in, copies * size_out)).view(-1, copies, size_out)
            else:
                x = torch.bmm(x.transpose(0, 1), weight).transpose(0, 1)  # (batch, copies, out): copy c reads x[:, c]
            if bias is not None:
                x = x + bias
            x = self.dropout(self.act(x))
        return x


class MMoEPreTrainedModel(MultiTaskPreTrainedModel):
    config_class = MMoEConfig
    base_model_prefix = ""
    main_input_name = "numeric_features"
    accepts_loss_kwargs = False
    _keys_to_ignore_at_inference = ["task_losses", "task_logits", "gate_weights", "routing_counts"]
    # gates (one per task; OMoE's single gate too), towers and heads are the tasks' own; every tower and head runs
    # on every row and a task without labels in the batch adds a zero loss, so nothing sits out a step
    parameter_roles = ParameterRoles(
        roles={
            "embedding": r"^embeddings\.",
            "expert": r"^experts\.",
            "bottom": r"^bottom\.",
            "gate": r"^gates\.",
            "tower": r"^towers\.",
        },
        task_specific=("gate", "tower"),
        possibly_idle=(),
    )

    @torch.no_grad()
    def _init_weights(self, module):  # its own scheme (Glorot), not transformers' N(0, std) for every Linear
        self._init_task_order(module)
        std = self.config.initializer_range
        if isinstance(module, StackedMLP):
            for layer in range(module.num_layers):
                weight = getattr(module, f"weight_{layer}")
                bound = math.sqrt(6.0 / (weight.shape[1] + weight.shape[2]))  # Glorot uniform per copy
                init.uniform_(weight, -bound, bound)
                bias = getattr(module, f"bias_{layer}")
                if bias is not None:
                    init.zeros_(bias)
        elif isinstance(module, nn.Linear):
            init.xavier_uniform_(module.weight)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, MMoEModel):
            cards = self.config.categorical_cardinalities
            init.copy_(module.category_offsets, torch.tensor([0, *cards[:-1]], dtype=torch.long).cumsum(0))


def _check_columns(name: str, features: torch.Tensor | None, names: list[str], what: str = "") -> None:
    """`features` given, `(batch, len(names))`: one column per configured feature."""
    if features is None:
        raise ValueError(f"`{name}` is required: (batch, {len(names)}){what} for {names}.")
    if features.dim() != 2 or features.shape[1] != len(names):
        raise ValueError(f"`{name}` must have shape (batch, {len(names)}), got {tuple(features.shape)}.")


class MMoEModel(MMoEPreTrainedModel):
    """Multi-gate Mixture-of-Experts (Ma et al., KDD 2018) and its baselines OMoE and Shared-Bottom
    (`config.architecture`), for rows of numeric and categorical features with a label for every task.

    Example:

    ```python
    >>> from hf_taskmoe import MMoEConfig, MMoEModel, TaskSpec
    >>> config = MMoEConfig(
    ...     tasks=[TaskSpec(name="income", num_labels=2), TaskSpec(name="never_married", num_labels=2)],
    ...     numeric_features=["age", "wage"], categorical_features=["sex"], categorical_cardinalities=[2],
    ... )
    >>> model = MMoEModel(config)
    >>> out = model(numeric_features=torch.randn(4, 2), categorical_features=torch.zeros(4, 1, dtype=torch.long))
    >>> out.task_logits["income"].shape
    torch.Size([4, 2])
    ```
    """

    records_task_order = True

    def __init__(self, config: MMoEConfig):
        super().__init__(config)
        # all categorical features in one table (one lookup, one backward); feature j's codes start at offsets[j]
        cards = config.categorical_cardinalities
        self.embeddings = nn.Embedding(sum(cards), config.embedding_dim) if cards else None
        self.register_buffer(
            "category_offsets", torch.tensor([0, *cards[:-1]], dtype=torch.long).cumsum(0), persistent=False
        )
        args = (config.use_bias, config.hidden_act, config.dropout)
        if config.architecture == "shared_bottom":
            self.bottom = StackedMLP(1, config.input_size, config.bottom_hidden_sizes, *args)
            bottom_size = config.bottom_hidden_sizes[-1]
        else:
            self.experts = StackedMLP(config.num_experts, config.input_size, config.expert_hidden_sizes, *args)
            gates = config.num_tasks if config.architecture == "mmoe" else 1
            self.gates = nn.Linear(config.input_size, gates * config.num_experts, bias=config.gate_bias)
            bottom_size = config.expert_hidden_sizes[-1]
        tower_sizes = config.tower_hidden_sizes
        self.towers = StackedMLP(config.num_tasks, bottom_size, tower_sizes, *args) if tower_sizes else None
        head_in = tower_sizes[-1] if tower_sizes else bottom_size
        self.heads = nn.ModuleDict(
            {
                s.name: nn.Linear(head_in, width, bias=config.use_bias)
                for s, width in zip(config.task_specs, config.task_output_sizes)
            }
        )
        self.post_init()

    def max_input_length(self) -> None:
        return None  # rows of features, not token sequences

    @torch.no_grad()
    def _grow_for_task(self, new_id: int, source: int | None) -> None:
        """A gate (MMoE), a tower and a head for the new task: the gate's and tower's copies of task `source`'s, or
        initialised like at construction; the head fresh (its width follows the new task's problem type)."""
        config = self.config
        if config.architecture == "mmoe":
            old, experts = self.gates, config.num_experts
            gates = nn.Linear(old.in_features, old.out_features + experts, bias=old.bias is not None).to(
                old.weight.device, old.weight.dtype
            )
            self._init_weights(gates)
            gates.weight[: old.out_features] = old.weight
            if source is not None:
                gates.weight[-experts:] = old.weight[source * experts : (source + 1) * experts]
            if old.bias is not None:
                gates.bias[: old.out_features] = old.bias
                if source is not None:
                    gates.bias[-experts:] = old.bias[source * experts : (source + 1) * experts]
            self.gates = gates
        if self.towers is not None:
            # one more tower of the same shape (its input: the experts' or the bottom's output)
            fresh = StackedMLP(1, self.towers.weight_0.shape[1], config.tower_hidden_sizes, config.use_bias,
                               config.hidden_act, config.dropout)
            self._init_weights(fresh)
            for name, param in list(self.towers.named_parameters()):
                row = param[source : source + 1] if source is not None else getattr(fresh, name).to(param.device,
                                                                                                     param.dtype)
                setattr(self.towers, name,
                        nn.Parameter(torch.cat([param.data, row.clone()]), requires_grad=param.requires_grad))
        spec = config.task_specs[new_id]
        head_in = next(iter(self.heads.values())).in_features
        head = nn.Linear(head_in, config.task_output_sizes[new_id], bias=config.use_bias)
        self._init_weights(head)
        self.heads[spec.name] = head.to(self.device, self.dtype)

    # ------------------------------------------------------------------ inputs
    def _input_vector(self, numeric_features, categorical_features, check_values: bool = True) -> torch.Tensor:
        config = self.config
        parts, batch = [], None
        if config.numeric_features:
            _check_columns("numeric_features", numeric_features, config.numeric_features)
            bad = ~torch.isfinite(numeric_features) if check_values else None
            if check_values and bad.any():
                row, col = bad.nonzero()[0].tolist()
                raise ValueError(
                    f"`numeric_features` holds a non-finite value in row {row}, feature "
                    f"{config.numeric_features[col]!r}."
                )
            parts.append(numeric_features.to(self.dtype))
            batch = numeric_features.shape[0]
        if config.categorical_features:
            _check_columns("categorical_features", categorical_features, config.categorical_features, " codes")
            if batch is not None and categorical_features.shape[0] != batch:
                raise ValueError(
                    f"`categorical_features` has {categorical_features.shape[0]} rows, `numeric_features` {batch}."
                )
            if categorical_features.is_floating_point() and check_values:
                fractional = categorical_features != categorical_features.round()
                if fractional.any():  # `.long()` would truncate 1.7 to category 1
                    row, col = fractional.nonzero()[0].tolist()
                    raise ValueError(
                        f"`categorical_features` must hold integer codes; row {row}, feature "
                        f"{config.categorical_features[col]!r} "
                        f"holds {categorical_features[row, col].item()}."
                    )
            codes = categorical_features.long()
            limits = torch.tensor(config.categorical_cardinalities, device=codes.device)
            bad = (codes < 0) | (codes >= limits)
            if check_values and bad.any():
                row, col = bad.nonzero()[0].tolist()
                raise ValueError(
                    f"Categorical feature {config.categorical_features[col]!r} has code {codes[row, col].item()} in "
                    "row "
                    f"{row}; codes must lie in [0, {config.categorical_cardinalities[col]})."
                )
            embedded = self.embeddings(codes + self.category_offsets)  # (batch, features, embedding_dim)
            parts.append(embedded.flatten(1))
        return torch.cat(parts, dim=-1)  # (batch, input_size)

    def _check_labels(self, labels: torch.Tensor, batch: int, check_values: bool = True) -> torch.Tensor:
        """`labels` `(batch, num_tasks)`, NaN (or -100 for a classification task) where a row has no label."""
        config = self.config
        if labels.dim() == 1 and config.num_tasks == 1:
            labels = labels[:, None]
        if labels.dim() != 2 or tuple(labels.shape) != (batch, config.num_tasks):
            raise ValueError(
                f"`labels` must have shape (batch, num_tasks) = ({batch}, {config.num_tasks}) (one column per task "
                f"{config.task_names}), got {tuple(labels.shape)}."
            )
        labels = labels.float()
        if not check_values:
            return labels
        infinite = torch.isinf(labels)  # NaN marks a missing label; an infinite one is a bad label
        if infinite.any():
            row, k = infinite.nonzero()[0].tolist()
            raise ValueError(
                f"Task {config.task_names[k]!r}: label {labels[row, k].item()} in row {row} is not finite."
            )
        for k, spec in enumerate(config.task_specs):
            problem_type_of(spec).check_tabular_column(spec, labels[:, k])
        return labels

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        numeric_features: torch.FloatTensor | None = None,
        categorical_features: torch.LongTensor | None = None,
        labels: torch.Tensor | None = None,
        output_gates: bool = False,
        output_router_logits: bool = False,
        return_dict: bool | None = None,
        values_checked: bool = False,
        **kwargs,
    ) -> MMoEOutput | tuple:
        r"""
        numeric_features (`torch.FloatTensor` of shape `(batch, len(config.numeric_features))`): standardised
            numeric columns, in config order.
        categorical_features (`torch.LongTensor` of shape `(batch, len(config.categorical_features))`): codes.
        labels (`torch.FloatTensor` of shape `(batch, num_tasks)`): every task's label per row; NaN (or -100 for a
            classification task) marks a missing label, which is left out of that task's loss.
        output_gates (`bool`): also return the gate weights.
        output_router_logits (`bool`): also return `routing_counts` (and the gate weights), the flag every
            routed family takes (`MultiTaskTrainingArguments.log_routing`).
        values_checked (`bool`): the feature and label values were checked where the batch was made; they are not
            read back here (no host sync). Shapes are checked either way and the result is the same.
        """
        config = self.config
        check_kwargs(kwargs, self.forward)
        x = self._input_vector(numeric_features, categorical_features, not values_checked)
        batch = x.shape[0]
        if labels is not None:
            labels = self._check_labels(labels, batch, not values_checked)

        gate_weights = routing_counts = None
        if config.architecture == "shared_bottom":
            shared = self.bottom(x)  # (batch, 1, h)
            task_inputs = shared.expand(batch, config.num_tasks, shared.shape[-1])  # (batch, tasks, h)
        else:
            experts = self.experts(x)  # (batch, experts, h)
            # softmax in fp32: gate weights must sum to 1 under fp16/bf16 autocast too
            gates = (
                self.gates(x).float().view(batch, -1, config.num_experts).softmax(-1).to(experts.dtype)
            )  # (batch, gates, experts)
            mixed = torch.bmm(gates, experts)  # (batch, gates, h): f^k(x) = sum_i g^k(x)_i f_i(x)
            task_inputs = mixed.expand(batch, config.num_tasks, mixed.shape[-1])  # OMoE: the one mixture for every task
            if output_gates or output_router_logits:
                gate_weights = gates.expand(batch, config.num_tasks, config.num_experts)
            if output_router_logits:
                routing_counts = gate_weights.detach().float().sum(0, keepdim=True)  # (1 gate layer, tasks, experts)
        towers = self.towers(task_inputs) if self.towers is not None else task_inputs  # (batch, tasks, tower)

        task_logits, task_losses = {}, {}
        for k, spec in enumerate(config.task_specs):
            logits = self.heads[spec.name](towers[:, k])  # (batch, output size)
            task_logits[spec.name] = logits
            if labels is not None:
                task_losses[spec.name] = problem_type_of(spec).tabular_loss(spec, logits, labels[:, k])
        loss = None
        if labels is not None:
            weights = {s.name: s.loss_weight for s in config.task_specs}
            loss = sum(weights[n] * task_loss for n, task_loss in task_losses.items()) if task_losses else x.sum() * 0.0
        output = MMoEOutput(
            loss=loss,
            logits=torch.cat(list(task_logits.values()), dim=-1),
            task_losses=task_losses or None,
            task_logits=task_logits,
            gate_weights=gate_weights,
            routing_counts=routing_counts,
        )
        return_dict = return_dict if return_dict is not None else config.return_dict
        return output if return_dict else output.to_tuple()
