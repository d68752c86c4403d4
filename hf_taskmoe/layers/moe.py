"""Token-level mixture of experts with task-aware or shared gating (MT-TaG, MT-Switch, MT-Dense).

Equations of the MT-TaG paper (section 3.1), for a token x of task t:

    E_i(x)   = w_i^out GeLU(w_i^in x)                      (1)   one expert = one BERT FFN
    l_t(x)   = W_{g,t} x,   W_{g,t} in R^{N x d}           (3)   task-aware gate ("shared": one W_g)
    G_t(x)   = softmax(l_t(x))                             (4)   in fp32
    g*, E*   = top-1 of G_t(x)                             (5)
    h(x)     = g* E*(x)                                    (6)   `expert_weighting="gate"`

Dispatch follows `docs/moe-dispatch.md` (measured on this CPU): tokens are sorted by expert with one
`argsort`, gathered with `index_select`, each expert's `F.linear`s run once on its contiguous slice (or one grouped
GEMM per projection runs them all: the experts' weights are stored stacked, `ExpertBank`),
and the outputs are put back in token order without atomic adds (`put_back_rows`: a copy to their tokens' rows off the
CPU, a gather by the inverse permutation on a CPU). Never every expert on every token in training; one device-to-host
sync per layer for `sorted_loop` (the per-expert token counts), none for `grouped_mm`. A captured program
(`torch.export`, ONNX) has no shape that depends on the routes: it runs every expert on every token, masked by the
combine weights (`TaskMoE._masked_experts`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F
from transformers.activations import ACT2FN

from ..contract import StackedWeight
from ..utils import compute_dtype, inverse_permutation, is_capturing, lookup, one_hot

EXPERT_WEIGHTINGS = ("gate", "straight_through")
#: how the tokens reach their experts: one `F.linear` per expert on its sorted slice (one host sync per layer), or
#: one grouped GEMM per projection over all slices (`F.grouped_mm`, no host sync), or `auto`: the grouped GEMM on an
#: accelerator and under torch.compile in bf16 (a host sync per layer costs a GPU more than the loop saves: 2.7x
#: dense's bf16 training step on an H200 against 1.3x, `benchmarks/gpu.py`), the loop on a CPU (where it is the faster,
#: `benchmarks/moe_vs_dense.py`) and wherever the grouped GEMM cannot run (no `F.grouped_mm`, experts that are whole
#: FFN modules, widths not divisible by 8)
EXPERT_DISPATCHES = ("auto", "sorted_loop", "grouped_mm")
HAS_GROUPED_MM = hasattr(F, "grouped_mm")


def grouped_mm_fits(hidden_size: int, intermediate_size: int) -> bool:
    """Whether `F.grouped_mm` can run experts of these widths: it exists in this torch and its strides are 16-byte
    aligned (widths divisible by 8)."""
    return HAS_GROUPED_MM and hidden_size % 8 == 0 and intermediate_size % 8 == 0


def _put_back(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """`rows` permuted by `order` put back: row `i` to row `order[i]`, without atomic adds (a permutation writes each
    row once). Off the CPU a copy to the rows (`index_copy_`: no inverse permutation to compute, a scatter and an
    `arange` fewer); on a CPU a gather by the inverse permutation, where `index_copy_` takes several times as long as
    the scatter and the gather together."""
    if copy_puts_back(rows):
        return torch.empty_like(rows).index_copy_(0, order, rows)
    return rows.index_select(0, inverse_permutation(order))


def copy_puts_back(rows: torch.Tensor) -> bool:
    """Whether `_put_back` copies the rows to their places (off the CPU) or gathers them (on a CPU)."""
    return rows.device.type != "cpu"


class _PermuteRows(torch.autograd.Function):
    """`x.index_select(0, order)` for a permutation `order`, whose gradient is put back (`_put_back`).

    `index_select`'s own backward scatters with `index_add_` (atomic adds on a GPU, serialised in bf16) because it
    must allow repeated indices; a permutation has none, so a copy (or a gather by the inverse) does: no atomics."""

    @staticmethod
    def forward(ctx, x, order):
        ctx.save_for_backward(order)
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        return _put_back(grad, order), None


class _PutBack(torch.autograd.Function):
    """`_put_back` on a CPU differentiable with a gather by the permutation for its gradient (the gather by the
    inverse would scatter its gradient with `index_add_`)."""

    @staticmethod
    def forward(ctx, rows, order):
        ctx.save_for_backward(order)
        return _put_back(rows, order)

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        return grad.index_select(0, order), None


class _PutBackStraightThrough(torch.autograd.Function):
    """A top-1 layer's outputs put back in token order, `y = E*(x)` in value with the gradient of `g* E*(x)` (eq. 6)
    reaching the gate probability `g*`: `TaskMoE`'s straight-through weighting, whose weight is exactly 1.0 in value.

    The same numbers as multiplying by `(g* - sg(g*)) + 1` (the other weightings' path) without the multiplication:
    no (tokens, hidden) product in the forward, and in the backward the outputs' gradient is a gather by the
    permutation and the gate's is one product and sum, `dL/dg* = <dL/dy, E*(x)>`. The gate comes as top-k gave it,
    `(batch, seq, 1)`, and its gradient goes back so shaped: no view of it (an autograd node) to flatten it."""

    @staticmethod
    def forward(ctx, y_sorted, order, gate):
        out = _put_back(y_sorted, order)  # (tokens, hidden) in token order
        ctx.save_for_backward(order, out)
        ctx.gate_dtype, ctx.gate_shape = gate.dtype, gate.shape
        return out

    @staticmethod
    def backward(ctx, grad):
        order, out = ctx.saved_tensors
        grad_gate = None
        if ctx.needs_input_grad[2]:
            grad_gate = (grad * out).sum(-1).to(ctx.gate_dtype).view(ctx.gate_shape)
        return grad.index_select(0, order), None, grad_gate


def permute_rows(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Rows of `x` in the order `order` (a permutation), differentiable without a scatter of atomic adds: the
    gradient is put back (`_put_back`). Without a backward to record, the gather alone (no autograd Function call)."""
    return _PermuteRows.apply(x, order) if torch.is_grad_enabled() else x.index_select(0, order)


def put_back_rows(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """`rows` permuted by `order` put back (`_put_back`), differentiable with a gather for its gradient. Off the CPU
    the copy's own backward is that gather, so no autograd Function runs (host time on a launch-bound step); on a CPU
    the gather by the inverse takes `_PutBack` for it. Without a backward to record, `_put_back` alone."""
    if torch.is_grad_enabled() and not copy_puts_back(rows):
        return _PutBack.apply(rows, order)
    return _put_back(rows, order)


@torch.compiler.disable
def _expert_loop(experts: Sequence, x_sorted: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Each expert (a callable) on its contiguous slice of the expert-sorted tokens (`ends`: where each expert's slice
    ends).

    The one host sync of the layer (`ends.tolist()`). Experts with no tokens still run on their empty slice so
    that every parameter takes part in the graph. Kept out of torch.compile's graphs: traced, the slice sizes
    would be specialised (0 and 1 are special) and every new batch composition would recompile until dynamo's
    recompile limit; as a graph break the loop runs eagerly and the rest of the layer stays compiled."""
    ends = ends.tolist()
    chunks = x_sorted.split([end - start for start, end in zip([0, *ends[:-1]], ends)])
    return torch.cat([expert(chunk) for expert, chunk in zip(experts, chunks)])


class ExpertFFN(nn.Module):
    """One expert: BERT's intermediate and output projections, `w_out(act(w_in(x)))` (eq. 1).

    Plain `nn.Linear`s, so peft's LoRA can target `w_in` / `w_out` like any projection.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "gelu"):
        super().__init__()
        self.w_in = nn.Linear(hidden_size, intermediate_size)
        self.act = ACT2FN[hidden_act] if isinstance(hidden_act, str) else hidden_act
        self.w_out = nn.Linear(intermediate_size, hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.w_out(self.act(self.w_in(hidden_states)))

    @classmethod
    def copy_of(cls, w_in: nn.Linear, act: nn.Module, w_out: nn.Linear) -> ExpertFFN:
        """An expert whose projections are copies of a dense FFN's (`w_in`, `act`, `w_out`: the dense model's own
        modules, e.g. BERT's `intermediate.dense`, `intermediate.intermediate_act_fn`, `output.dense`)."""
        expert = cls.__new__(cls)
        nn.Module.__init__(expert)
        expert.w_in, expert.act, expert.w_out = copy.deepcopy(w_in), act, copy.deepcopy(w_out)
        return expert


#: an `ExpertBank`'s stacked weights, and their names in checkpoints of releases that kept one `ExpertFFN` per expert
#: (`experts.<i>.w_in.weight`): a model holding expert banks declares these as its `stacked_weights`
EXPERT_BANK_WEIGHTS = (
    StackedWeight(r"(.+\.experts)\.(w_in|w_out)", r"\1.{index}.\2.weight"),
    StackedWeight(r"(.+\.experts)\.(w_in|w_out)_bias", r"\1.{index}.\2.bias"),
)


class ExpertBank(nn.Module):
    """The `N` experts of one MoE layer, each `w_out_i act(w_in_i x)` (eq. 1), stored stacked: one tensor per kind of
    weight, `w_in` `(N, intermediate, hidden)` and `w_in_bias` `(N, intermediate)`, `w_out` `(N, hidden, intermediate)`
    and `w_out_bias` `(N, hidden)`; slice `i` holds what expert `i`'s `nn.Linear`s would (so a dense FFN's weights
    broadcast into every slice when upcycling, and checkpoints of earlier releases, one module per expert, stack on
    load: `TaskMoE.legacy_stacking`).

    Why stacked: the grouped GEMM takes one tensor per projection, so a training step neither stacks the experts'
    weights in the forward nor unbinds their gradients in the backward (`benchmarks/op_count.py`). peft's LoRA
    reaches the experts through `target_parameters=["experts.w_in", "experts.w_out"]` (a `ParamWrapper` on this
    module: the weights are read in `forward` only, where its parametrization is active).

    `forward(x_sorted, ends, slot_expert)` runs each expert on its contiguous slice of expert-sorted slots;
    `forward(x, combine=weights)` runs every expert on every token and mixes them by `combine` `(tokens, N)` (the
    dispatch of a captured program). Indexing (`bank[i]`) and iteration give each expert as a callable, for analyses.
    `grouped`: the layer's `expert_dispatch` (`"auto"`, `"sorted_loop"` or `"grouped_mm"`, or a bool for the last
    two), resolved on each call by `uses_grouped_mm`.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, hidden_act: str | nn.Module = "gelu",
                 grouped: bool | str = False):
        super().__init__()
        self.num_experts = num_experts
        self.grouped = grouped  # the dispatch: "auto", "sorted_loop"/False, "grouped_mm"/True
        self.w_in = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.w_in_bias = nn.Parameter(torch.zeros(num_experts, intermediate_size))
        self.act = ACT2FN[hidden_act] if isinstance(hidden_act, str) else hidden_act
        self.w_out = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.w_out_bias = nn.Parameter(torch.zeros(num_experts, hidden_size))
        for weight in (self.w_in, self.w_out):  # as `nn.Linear` draws each (the model's `_init_weights` redraws)
            for expert in weight.detach():
                nn.init.kaiming_uniform_(expert, a=5**0.5)

    @classmethod
    def copy_of(cls, w_in: nn.Linear, act: nn.Module, w_out: nn.Linear, num_experts: int,
                grouped: bool | str = False) -> ExpertBank:
        """`num_experts` experts, each a copy of a dense FFN (`w_in`, `act`, `w_out`: the dense model's own modules,
        e.g. BERT's `intermediate.dense`, `intermediate.intermediate_act_fn`, `output.dense`)."""
        bank = cls(num_experts, w_in.in_features, w_in.out_features, act, grouped)
        with torch.no_grad():
            for mine, dense in ((bank.w_in, w_in.weight), (bank.w_in_bias, w_in.bias), (bank.w_out, w_out.weight),
                                (bank.w_out_bias, w_out.bias)):
                mine.copy_(dense.expand_as(mine) if dense is not None else torch.zeros_like(mine))
        # (no `.to` when the dtype is already the dense model's: a module moved under FakeTensorMode cannot swap)
        return bank if bank.w_in.dtype == w_in.weight.dtype else bank.to(w_in.weight.dtype)

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        """N(0, std) weights and zero biases (BERT's `nn.Linear` init, per expert), through `transformers.
        initialization`, which leaves weights a checkpoint loaded alone."""
        from transformers import initialization as init

        init.normal_(self.w_in, mean=0.0, std=std)
        init.normal_(self.w_out, mean=0.0, std=std)
        init.zeros_(self.w_in_bias)
        init.zeros_(self.w_out_bias)

    def __len__(self) -> int:
        return self.num_experts

    def __getitem__(self, index: int):
        """Expert `index` as a callable `(..., hidden) -> (..., hidden)` (its slices of the stacked weights)."""
        if not -self.num_experts <= index < self.num_experts:
            raise IndexError(f"expert {index} of {self.num_experts}")
        return _Expert(self, index % self.num_experts)

    def __iter__(self):
        return (self[i] for i in range(self.num_experts))

    def uses_grouped_mm(self, x: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether a call on `x` computing in `dtype` runs the grouped GEMM: `"grouped_mm"` always; `"auto"` where
        `F.grouped_mm` fits the widths, off the CPU in eager code, and under torch.compile in bf16 (the loop's slice
        sizes would be a graph break; `aten._grouped_mm` traces in bf16 only, torch 2.13's meta kernel)."""
        if self.grouped in (True, "grouped_mm"):
            return True
        if self.grouped != "auto":
            return False
        inter, hidden = self.w_in.shape[1:]
        if not grouped_mm_fits(hidden, inter):
            return False
        if torch.compiler.is_compiling():
            return dtype == torch.bfloat16
        return x.device.type != "cpu"

    def forward(self, x: torch.Tensor, ends: torch.Tensor | None = None, slot_expert: torch.Tensor | None = None,
                combine: torch.Tensor | None = None, expert_range: torch.Tensor | None = None) -> torch.Tensor:
        """`x` `(slots, hidden)` sorted by expert, `ends` `(N,)` int32 where each expert's slice ends and
        `slot_expert` `(slots,)` each slot's expert (any integer dtype: `TaskMoE` passes its 8-bit sort keys), with
        `expert_range` `arange(N)` in its dtype when the caller keeps one: every expert on its slice, `(slots,
        hidden)`. Or, with `combine` `(tokens, N)`: every expert on every token of `x`, weighted by `combine` and
        summed, `(tokens, hidden)`."""
        if combine is not None:
            h = self.act(torch.einsum("th,eih->tei", x, self.w_in) + self.w_in_bias)  # (tokens, experts, inter)
            y = torch.einsum("tei,ehi->teh", h, self.w_out) + self.w_out_bias  # (tokens, experts, hidden)
            return torch.einsum("teh,te->th", y, combine.to(y.dtype))
        dtype = compute_dtype(x)
        if not self.uses_grouped_mm(x, dtype):
            weights = (self.w_in, self.w_in_bias, self.w_out, self.w_out_bias)
            if torch.is_autocast_enabled(x.device.type):
                # cast as stored, once, not each expert's slices in its `F.linear`s: four casts per layer where there
                # were four per expert, in the forward and in the backward (a cast is elementwise: the same numbers)
                weights = tuple(w.to(dtype) for w in weights)
            w_in, b_in, w_out, b_out = (w.unbind(0) for w in weights)
            experts = [
                lambda chunk, i=i: F.linear(self.act(F.linear(chunk, w_in[i], b_in[i])), w_out[i], b_out[i])
                for i in range(self.num_experts)
            ]
            return _expert_loop(experts, x, ends)
        # the grouped GEMM takes (experts, in, out): the stored weights transposed, a view
        h = F.grouped_mm(x.to(dtype), self.w_in.to(dtype).transpose(1, 2), offs=ends)  # (slots, inter)
        if torch.is_grad_enabled():
            # each slot's expert as a one-hot row: the biases reach the slots by a product whose backward is a product
            # too (`index_select` of the biases would scatter their gradients back with contended atomic adds)
            slot_one_hot = one_hot(slot_expert, self.num_experts, dtype, expert_range)  # (slots, experts)
            h = self.act(torch.addmm(h, slot_one_hot, self.w_in_bias.to(dtype)))
            y = F.grouped_mm(h, self.w_out.to(dtype).transpose(1, 2), offs=ends)  # (slots, hidden)
            return torch.addmm(y, slot_one_hot, self.w_out_bias.to(dtype))
        # no gradient: a gather of the biases is the cheaper (a (slots, experts) product with K = experts is not; the
        # H200's replayed bf16 inference of MT-TaG took 4.63 ms with the products against 4.35 with the gathers)
        slot_expert = slot_expert.long()  # (an index of `index_select`: int64, or int32, not 8-bit)
        h = self.act(h + self.w_in_bias.to(dtype).index_select(0, slot_expert))
        y = F.grouped_mm(h, self.w_out.to(dtype).transpose(1, 2), offs=ends)  # (slots, hidden)
        return y + self.w_out_bias.to(dtype).index_select(0, slot_expert)

    def extra_repr(self) -> str:
        inter, hidden = self.w_in.shape[1:]
        return f"num_experts={self.num_experts}, hidden={hidden}, intermediate={inter}, grouped={self.grouped}"


class _Expert:
    """One expert of an `ExpertBank` as a callable (`bank[i]`)."""

    def __init__(self, bank: ExpertBank, index: int):
        self.bank, self.index = bank, index

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        bank, i = self.bank, self.index
        return F.linear(bank.act(F.linear(x, bank.w_in[i], bank.w_in_bias[i])), bank.w_out[i], bank.w_out_bias[i])


class TaskGate(nn.Module):
    """Task-aware gate (MT-TaG): one `W_{g,t} in R^{N x d}` per task, no bias (eq. 3). A token-level gate, not to
    be confused with `layers.routing.TaskRouter`, which routes whole tasks through BART layers."""

    def __init__(self, hidden_size: int, num_experts: int, num_tasks: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_tasks, num_experts, hidden_size))

    def forward(self, hidden_states: torch.Tensor, task_ids: torch.Tensor, shared=None) -> torch.Tensor:
        """Router logits `(batch, seq, experts)` fp32. `shared(key, make)`: where the rows' tasks as one-hot rows are
        kept for the other layers of the forward (`TaskMoE.shared_tensor`), which then make none; None: made here."""
        tasks, experts, hidden = self.weight.shape
        if torch.is_grad_enabled() or is_capturing():  # (a traced program: one graph with or without gradients)
            # each row's task gate, selected by a product (whose backward is a product, not a scatter of atomic adds)
            make = lambda: one_hot(task_ids, tasks, torch.float32)  # noqa: E731
            rows = make() if shared is None else shared(("task_one_hot", tasks), make)  # (batch, tasks)
            gates = (rows @ self.weight.float().view(tasks, -1)).view(-1, experts, hidden)  # (batch, experts, hidden)
        else:  # no backward: a gather (the same values: a one-hot product adds exact zeros), two kernels, not five
            gates = self.weight.index_select(0, task_ids).float()  # (batch, experts, hidden)
        # one batched product (an einsum dispatches about four times the operations). Every task's gate on every
        # token in one product, each row's kept by a one-hot product, was measured and dropped: an H100's bf16 step
        # spent 0.32 ms in its fp32 GEMMs against 0.36 ms here, within the step's spread
        return torch.bmm(hidden_states.float(), gates.transpose(1, 2))  # (batch, seq, experts)

    @torch.no_grad()
    def add_task(self, init_from: int | None, std: float) -> None:
        """Grow the gate table by one task, copied from task `init_from` or drawn from N(0, std)."""
        new = torch.empty_like(self.weight[:1])
        if init_from is None:
            new.normal_(0.0, std)
        else:
            new.copy_(self.weight[init_from : init_from + 1])
        self.weight = nn.Parameter(torch.cat([self.weight.data, new], dim=0), requires_grad=self.weight.requires_grad)


class SharedGate(nn.Module):
    """One gate for every task (MT-Switch): `W_g in R^{N x d}`, no bias."""

    def __init__(self, hidden_size: int, num_experts: int, num_tasks: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, hidden_states: torch.Tensor, task_ids: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_states.float(), self.weight.float())  # (batch, seq, experts)

    def add_task(self, init_from: int | None, std: float) -> None:
        """The shared gate serves new tasks as it is."""


#: the gating kinds (`TaskMoEConfig.gating`): one gate per task (MT-TaG) or one for all (MT-Switch)
GATING_TYPES: dict[str, type[nn.Module]] = {"task": TaskGate, "shared": SharedGate}


def build_gate(gating: str, hidden_size: int, num_experts: int, num_tasks: int) -> nn.Module:
    return lookup(GATING_TYPES, gating, "gating")(hidden_size, num_experts, num_tasks)


class MoEOutput(NamedTuple):
    """Output of `TaskMoE.forward`.

    hidden_states: `(batch, seq, hidden)`.
    router_logits: `(batch, seq, experts)` fp32, None for a one-expert (dense) layer.
    expert_index: `(batch, seq, top_k)` chosen experts, None for a dense layer.
    routing_counts: `(tasks, experts)` tokens (padding excluded) each expert received per task, when asked.
    aux_loss / z_loss: scalar load-balancing / router z-loss when their coefficient is set, else None.
    """

    hidden_states: torch.Tensor
    router_logits: torch.Tensor | None = None
    expert_index: torch.Tensor | None = None
    routing_counts: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    z_loss: torch.Tensor | None = None


class TaskMoE(nn.Module):
    """N expert FFNs behind a task-aware (`gating="task"`) or shared (`"shared"`) top-k router.

    With `num_experts=1` there is no router and the layer is the dense FFN (MT-Dense).

    `expert_weighting` sets how the chosen experts' outputs are scaled:

    - `"gate"`: by their gate probabilities, `h = g* E*(x)` (MT-TaG eq. 6; Switch Transformer). At an
      upcycled start (identical experts, near-uniform gates) this scales every FFN output by about 1/N.
    - `"straight_through"`: `h = sum_k (sg(g_k / sum_j g_j) + g_k - sg(g_k)) E_k(x)`: the value is the
      top-k renormalised mixture (for top-1 exactly `E*(x)`), the gradient reaching each gate is the one
      of `"gate"`. An upcycled model with identical experts computes exactly what the dense model did.
    """

    def __init__(self, config, layer_idx: int | None = None, experts: ExpertBank | Sequence[nn.Module] | None = None):
        """`config`: a `TaskMoEConfig` (hidden and intermediate sizes, activation, `num_experts`, `gating`,
        `top_k`, `expert_weighting`, `expert_dispatch`, the auxiliary-loss coefficients, the tasks). A layer outside
        `config.moe_layer_indices` (`layer_idx`) is dense: one expert, no gate. `experts`: the experts themselves,
        e.g. copies of a dense model's FFN (`hf_taskmoe.models.task_moe`), instead of fresh ones: an `ExpertBank`
        (stacked two-projection experts, either dispatch), or modules mapping `(..., hidden)` to `(..., hidden)`
        (e.g. a gated FFN; the sorted loop). Fresh experts are an `ExpertBank`; a one-expert (dense) layer is one
        `ExpertFFN` in `experts.0`, the dense FFN as it was, at no cost for stacking."""
        super().__init__()
        moe_layer = layer_idx is None or layer_idx in config.moe_layer_indices
        self.num_experts = config.num_experts if moe_layer else 1
        self.num_tasks = config.num_tasks
        self.top_k = config.top_k if self.num_experts > 1 else 1
        self.gating = config.gating
        self.expert_weighting = config.expert_weighting
        self.compute_aux_loss = config.router_aux_loss_coef > 0
        self.compute_z_loss = config.router_z_loss_coef > 0
        self.dispatch = config.expert_dispatch
        if experts is not None and len(experts) != self.num_experts:
            raise ValueError(f"TaskMoE of layer {layer_idx} takes {self.num_experts} experts, got {len(experts)}.")
        if experts is None and self.num_experts > 1:
            experts = ExpertBank(config.num_experts, config.hidden_size, config.intermediate_size, config.hidden_act)
        elif experts is None:
            experts = [ExpertFFN(config.hidden_size, config.intermediate_size, config.hidden_act)]
        if isinstance(experts, ExpertBank):
            experts.grouped = self.dispatch
        elif self.dispatch == "grouped_mm" and self.num_experts > 1:
            raise ValueError(
                f"`expert_dispatch='grouped_mm'` needs two-projection experts (an `ExpertBank`); layer {layer_idx}'s "
                f"experts are {type(experts[0]).__name__} modules: use `expert_dispatch='sorted_loop'`."
            )
        # decided here: peft's LoRA on the stacked weights puts a wrapper in the bank's place
        self.stacked = isinstance(experts, ExpertBank)
        self.experts = experts if self.stacked else nn.ModuleList(experts)
        self.router = (
            build_gate(config.gating, config.hidden_size, self.num_experts, self.num_tasks)
            if self.num_experts > 1
            else None
        )

    def add_task(self, init_from: int | None, std: float) -> None:
        self.num_tasks += 1
        if self.router is not None:
            self.router.add_task(init_from, std)

    def shared_tensor(self, key, make) -> torch.Tensor:
        """A tensor every MoE layer of a forward derives alike from the batch or the config (`key` names it, `make()`
        makes it): the rows' tasks as one-hot rows, `arange(num_experts)`. A layer on its own makes it on each call;
        in a task model (`BackboneTaskMoE`) the first layer of a forward makes it and the others read it."""
        return make()

    def route(self, hidden_states: torch.Tensor, task_ids: torch.Tensor) -> torch.Tensor:
        """Router logits `(batch, seq, experts)` in fp32."""
        # Softmax and top-k decide which weights a token uses; in fp16/bf16 near-ties flip between experts
        # and the exponent overflows, so the router runs in fp32 with autocast off (as in Switch/Mixtral). Where
        # autocast is off already, no context to enter and leave (a dozen Python calls a layer)
        device = hidden_states.device.type
        if not torch.is_autocast_enabled(device):
            return self._gate(hidden_states, task_ids)
        with torch.autocast(device_type=device, enabled=False):
            return self._gate(hidden_states, task_ids)

    def _gate(self, hidden_states: torch.Tensor, task_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.router, TaskGate):
            return self.router(hidden_states, task_ids, shared=self.shared_tensor)
        return self.router(hidden_states, task_ids)

    def forward(
        self,
        hidden_states: torch.Tensor,
        task_ids: torch.Tensor,
        token_mask: torch.Tensor | None = None,
        output_routing: bool = False,
    ) -> MoEOutput:
        """
        Args:
            hidden_states: `(batch, seq, hidden)`.
            task_ids: `(batch,)` task of each row.
            token_mask: `(batch, seq)` bool, True for real tokens; padding is routed and computed like any
                token (its output is masked downstream) but left out of routing statistics and aux losses.
            output_routing: also return per-task routing counts.
        """
        batch, seq, hidden = hidden_states.shape
        if self.router is None:  # MT-Dense: the FFN itself, no routing.
            return MoEOutput(self.experts[0](hidden_states))

        logits = self.route(hidden_states, task_ids)  # (batch, seq, experts) fp32
        probs = logits.softmax(dim=-1)
        top_p, top_e = probs.topk(self.top_k, dim=-1)  # (batch, seq, k)
        x = hidden_states.reshape(-1, hidden)  # (tokens, hidden)
        if is_capturing():  # torch.export / ONNX / jit.trace: no shape may depend on the routes
            weights = self._combine_weights(top_p).to(hidden_states.dtype)  # (batch, seq, k)
            y = self._masked_experts(x, top_e.reshape(-1, self.top_k), weights.reshape(-1, self.top_k))
            y = y.view(batch, seq, hidden)
        elif self.top_k == 1 and self.expert_weighting == "straight_through":  # the value is the expert's output
            y = self._sorted_experts(x, top_e.reshape(-1), None, straight_through=top_p)
            y = y.view(batch, seq, hidden)
        elif self.top_k == 1:  # each token's one output, put back in token order, scaled there: no gather of weights
            y = self._sorted_experts(x, top_e.reshape(-1), None).view(batch, seq, hidden)
            y = y * self._combine_weights(top_p).to(hidden_states.dtype)
        else:
            weights = self._combine_weights(top_p).to(hidden_states.dtype)
            y = self._sorted_experts(x, top_e.reshape(-1), weights.reshape(-1)).view(batch, seq, hidden)

        needs_mask = token_mask is not None and (self.compute_aux_loss or self.compute_z_loss)
        mask = token_mask.reshape(-1) if needs_mask else None
        return MoEOutput(
            hidden_states=y,
            router_logits=logits,
            expert_index=top_e,
            routing_counts=self._routing_counts(top_e, task_ids, token_mask) if output_routing else None,
            aux_loss=self._load_balancing_loss(probs, top_e, mask) if self.compute_aux_loss else None,
            z_loss=self._z_loss(logits, mask) if self.compute_z_loss else None,
        )

    def _sorted_experts(
        self, x: torch.Tensor, flat_expert: torch.Tensor, flat_weight: torch.Tensor | None,
        straight_through: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Each expert on the tokens routed to it (`docs/moe-dispatch.md`): slots sorted by expert, one `F.linear`
        pair per expert's slice (`sorted_loop`) or one grouped GEMM per projection (`grouped_mm`), outputs put back
        in token order. `flat_expert` / `flat_weight` `(tokens*k,)`: slot s = token s//k, its (s%k)-th choice.
        Top-1: `flat_weight` None, the outputs come back unscaled, for the caller to scale in token order; or
        `straight_through` `(batch, seq, 1)` the chosen experts' gate probabilities, whose gradient is eq. 6's while the
        value is the expert's output (`expert_weighting="straight_through"`, `_PutBackStraightThrough`)."""
        # slots grouped by expert, and their experts. Sorted on 8-bit keys: a GPU's radix sort makes a pass per few
        # key bits, so int64 keys cost it about eight times the passes (33 us of an H100's 4,096-token step)
        keys = flat_expert.to(torch.uint8) if self.num_experts <= 256 else flat_expert
        sorted_key, order = torch.sort(keys, stable=True)  # the slots' experts, sorted, in the keys' dtype
        # where each expert's slice ends: a search of the sorted experts, whose size is fixed (no `bincount`, whose
        # output size is read back from the device on a GPU), in int32 as the grouped GEMM's offsets are. The keys
        # serve as they are (the search, the bias one-hot of the grouped GEMM); `arange(N)` in their dtype is made
        # once per forward (`shared_tensor`)
        n, device = self.num_experts, x.device
        experts = self.shared_tensor(("experts", n, keys.dtype, device),
                                     lambda: torch.arange(n, dtype=keys.dtype, device=device))
        ends = torch.searchsorted(sorted_key, experts, right=True, out_int32=True)  # (experts,)
        if self.stacked and self.top_k == 1:
            # under autocast the experts compute in its dtype: cast before the permutation (and its backward), which
            # then moves half the bytes (a cast is elementwise, so the numbers are the same). Top-1 only: with k > 1
            # a token's slots are summed, in `x`'s dtype (the put-back's sum, the gradient's `index_add_`)
            dtype = compute_dtype(x)
            if x.dtype != dtype:
                x = x.to(dtype)
        if self.top_k == 1:  # the slots are the tokens permuted: sorted by a gather, put back (`put_back_rows`), and
            token_of_slot = order  # in the backward the same two the other way round (no scatter of atomic adds)
            x_sorted = permute_rows(x, order)  # (tokens, hidden), contiguous per expert
        else:
            token_of_slot = order // self.top_k
            x_sorted = x.index_select(0, token_of_slot)  # (tokens*k, hidden), contiguous per expert
        if self.stacked:  # one grouped GEMM per projection, or a loop over the slices
            y_sorted = self.experts(x_sorted, ends, sorted_key, expert_range=experts)  # (tokens*k, hidden)
        else:
            y_sorted = _expert_loop(self.experts, x_sorted, ends)
        if self.top_k == 1:  # (tokens, hidden) back in token order
            if straight_through is not None and torch.is_grad_enabled():
                return _PutBackStraightThrough.apply(y_sorted, order, straight_through)
            # (without a backward the straight-through value is the expert's output; the other weightings scale the
            # outputs after, in token order)
            return put_back_rows(y_sorted, order)
        y_sorted = y_sorted * flat_weight.index_select(0, order).unsqueeze(-1)
        return torch.zeros_like(x).index_add_(0, token_of_slot, y_sorted)  # sum of a token's k experts

    def _masked_experts(self, x: torch.Tensor, top_e: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The dispatch of a captured program (`torch.export`, ONNX): every expert on every token, each output
        scaled by the token's weight for that expert (its combine weight when chosen, 0 otherwise), so no shape
        depends on the routes. The same sum as the sorted dispatch, at `num_experts` times the FFN compute: for
        serving, never for training. `top_e` / `weights` `(tokens, k)`."""
        combine = weights.new_zeros(x.shape[0], self.num_experts).scatter_add(1, top_e, weights)  # (tokens, experts)
        if self.stacked:
            return self.experts(x, combine=combine)
        outputs = torch.stack([expert(x) for expert in self.experts], dim=1)  # (tokens, experts, hidden)
        return torch.einsum("teh,te->th", outputs, combine.to(outputs.dtype))  # (tokens, hidden)

    def _combine_weights(self, top_p: torch.Tensor) -> torch.Tensor:
        if self.expert_weighting == "gate":
            return top_p
        # Value: renormalised top-k probabilities (1.0 for top-1); gradient: that of `top_p` itself.
        # `top_p - top_p.detach()` is exactly 0.0 in value, so the forward pass is exact.
        if self.top_k == 1:  # p / p is exactly 1.0: no need to compute it
            return (top_p - top_p.detach()) + 1.0
        renormalised = (top_p / top_p.sum(dim=-1, keepdim=True)).detach()
        return renormalised + (top_p - top_p.detach())

    def _routing_counts(self, top_e, task_ids, token_mask) -> torch.Tensor:
        batch, seq, k = top_e.shape
        token_task = task_ids.view(batch, 1, 1).expand(batch, seq, k)  # (batch, seq, k)
        cell = token_task * self.num_experts + top_e  # (batch, seq, k) index into (tasks, experts)
        real = torch.ones_like(cell) if token_mask is None else token_mask.long().unsqueeze(-1).expand_as(cell)
        # a scatter into a table of fixed size: no read of how many tokens were real (nor of the largest index)
        counts = torch.zeros(self.num_tasks * self.num_experts, dtype=torch.long, device=cell.device)
        counts = counts.scatter_add_(0, cell.reshape(-1), real.reshape(-1))
        return counts.view(self.num_tasks, self.num_experts)

    def _load_balancing_loss(self, probs, top_e, mask) -> torch.Tensor:
        """Switch Transformer's `N * sum_i f_i P_i` over the real tokens of the layer (all tasks together)."""
        probs = probs.reshape(-1, self.num_experts)  # (tokens, experts)
        dispatch = F.one_hot(top_e.reshape(probs.shape[0], -1), self.num_experts).sum(1).float()  # (tokens, experts)
        # means over the real tokens, weighted by the mask (no boolean indexing: its size would be read back)
        real = probs.new_ones(probs.shape[0], 1) if mask is None else mask.reshape(-1, 1).to(probs.dtype)
        tokens = real.sum().clamp(min=1)
        fraction = (dispatch * real).sum(0) / tokens / self.top_k  # f_i: share of routed slots per expert
        mean_prob = (probs * real).sum(0) / tokens  # P_i
        return self.num_experts * torch.sum(fraction * mean_prob)

    @staticmethod
    def _z_loss(logits, mask) -> torch.Tensor:
        """ST-MoE router z-loss: mean of logsumexp(logits)^2 over the real tokens."""
        z = torch.logsumexp(logits.reshape(-1, logits.shape[-1]), dim=-1)  # (tokens,)
        if mask is None:
            return (z**2).mean()
        real = mask.reshape(-1).to(z.dtype)
        return (z**2 * real).sum() / real.sum().clamp(min=1)
