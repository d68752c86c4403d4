"""Token-level mixture of experts with task-aware or shared gating (MT-TaG, MT-Switch, MT-Dense).

Equations of the MT-TaG paper (section 3.1), for a token x of task t:

    E_i(x)   = w_i^out GeLU(w_i^in x)                      (1)   one expert = one BERT FFN
    l_t(x)   = W_{g,t} x,   W_{g,t} in R^{N x d}           (3)   task-aware gate ("shared": one W_g)
    G_t(x)   = softmax(l_t(x))                             (4)   in fp32
    g*, E*   = top-1 of G_t(x)                             (5)
    h(x)     = g* E*(x)                                    (6)   `expert_weighting="gate"`

The experts of a layer are an `ExpertBank` on transformers' experts interface (`use_experts_implementation`, stacked
`up_proj` / `down_proj` weights); `config.experts_implementation` picks the implementation from transformers' registry,
where MT-TaG registers its own, `"taskmoe_sorted"`, the dispatch `docs/moe-dispatch.md` measured on this CPU: tokens
sorted by expert with one sort on 8-bit keys, gathered with `index_select`, each expert's `F.linear`s run once on its
contiguous slice (or one grouped GEMM per projection runs them all), and the outputs put back in token order without
atomic adds (`put_back_rows`: a copy to their tokens' rows off the CPU, a gather by the inverse permutation on a CPU).
Never every expert on every token in training, except where chosen (transformers' `eager`, the default in fp16 on an
accelerator: `default_experts_implementation`); one device-to-host sync per layer for the loop (the per-expert token
counts), none for the grouped GEMMs. A captured program (`torch.export`, ONNX) has no shape that depends on the
routes: it runs every expert on every token, masked by the combine weights (`every_expert_forward`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from functools import partial
from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F
from transformers.activations import ACT2FN
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, use_experts_implementation

from ..compat import grouped_mm_fallback_op
from ..contract import StackedWeight
from ..utils import compute_dtype, inverse_permutation, is_capturing, lookup, one_hot
from .low_rank import TokenLowRankExperts, token_decisions_key

EXPERT_WEIGHTINGS = ("gate", "straight_through")
#: MT-TaG's own implementations in transformers' experts registry (`ALL_EXPERTS_FUNCTIONS`), chosen by name like
#: transformers' `eager`, `batched_mm` and `grouped_mm` (`config.experts_implementation`): the sorted dispatch
#: (`sorted_experts_forward`) with its per-expert loop in eager code on a CPU and grouped GEMMs elsewhere, or with
#: one of the two everywhere (the loop reads the slice sizes back and is a graph break under torch.compile; the
#: grouped GEMMs are the slower on a CPU), and the default, which picks an implementation per call by device and
#: dtype (`default_experts_implementation`)
SORTED = "taskmoe_sorted"
SORTED_LOOP = "taskmoe_sorted_loop"
SORTED_GROUPED = "taskmoe_sorted_grouped"
AUTO = "taskmoe_auto"
#: the names whose calls take `sorted_experts_forward`'s keywords (`TaskMoE`)
SORTED_IMPLEMENTATIONS = (SORTED, SORTED_LOOP, SORTED_GROUPED)
HAS_GROUPED_MM = hasattr(F, "grouped_mm")
GROUPED_MM_FALLBACK = grouped_mm_fallback_op()


def default_experts_implementation(device: torch.device | str, dtype: torch.dtype, num_experts: int) -> str:
    """The experts implementation MT-TaG runs where none was chosen (`experts_implementation="taskmoe_auto"`, the
    default), for experts on `device` computing in `dtype` (autocast's where it is on):

    - on a CPU, `"taskmoe_sorted"`: its per-expert loop on the sorted tokens, the faster there
      (`benchmarks/moe_vs_dense.py`);
    - on an accelerator in fp16 with at most 4 experts, `"eager"`: every expert on every token, mixed by the combine
      weights. torch's grouped GEMM has no fast fp16 kernel and reads its offsets back to the host (an H200 measured
      MT-TaG's fp16 training step at 2.5-2.7x dense's with it, and at 3.1x with the per-expert loop, which reads the
      slice sizes back): four dense fp16 GEMMs per projection, nothing read back, cost less (docs/mt-tag.md says what a
      GPU run must confirm);
    - elsewhere (bf16, fp32, fp16 with more experts), `"taskmoe_sorted"`: one grouped GEMM per projection, no host
      read (under torch.compile too, through transformers' traceable grouped product in other dtypes than bf16)."""
    device_type = device if isinstance(device, str) else device.type
    if device_type != "cpu" and dtype == torch.float16 and num_experts <= 4:
        return "eager"
    return SORTED


def resolve_experts_implementation(name: str | None, x: torch.Tensor, num_experts: int) -> str:
    """The implementation a call on `x` runs: `name` (a config's `experts_implementation`), the default's choice
    for `x`'s device and compute dtype where `name` is `"taskmoe_auto"` (or unset)."""
    if name is None or name == AUTO:
        return default_experts_implementation(x.device, compute_dtype(x), num_experts)
    return name


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

    The same numbers as multiplying by `(g* - sg(g*)) + 1` (what the other implementations are given) without the
    multiplication: no (tokens, hidden) product in the forward, and in the backward the outputs' gradient is a gather
    by the permutation and the gate's is one product and sum, `dL/dg* = <dL/dy, E*(x)>`."""

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
    recompile limit; as a graph break the loop runs eagerly and the rest of the layer stays compiled. (The stacked
    experts never reach it under torch.compile: `sorted_experts_forward` runs grouped GEMMs there.)"""
    ends = ends.tolist()
    chunks = x_sorted.split([end - start for start, end in zip([0, *ends[:-1]], ends)])
    return torch.cat([expert(chunk) for expert, chunk in zip(experts, chunks)])


class ExpertFFN(nn.Module):
    """One expert: BERT's intermediate and output projections, `w_out(act(w_in(x)))` (eq. 1): the FFN of a layer
    with one expert (MT-Dense, a layer outside `moe_layers`), kept as the dense model's own `nn.Linear`s.
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


#: an `ExpertBank`'s stacked weights: a model holding expert banks declares these as its `stacked_weights` (upcycling
#: copies a dense projection into every slice)
EXPERT_BANK_WEIGHTS = (StackedWeight(r".+\.experts\.(up_proj|down_proj)(_bias)?"),)


@use_experts_implementation(has_gate=False, has_bias=True)
class ExpertBank(nn.Module):
    """The `N` experts of one MoE layer, each `down_i act(up_i x)` (eq. 1), stored stacked in transformers' experts
    layout: `up_proj` `(N, intermediate, hidden)` and `up_proj_bias` `(N, intermediate)`, `down_proj` `(N, hidden,
    intermediate)` and `down_proj_bias` `(N, hidden)`, `act_fn`; slice `i` holds what expert `i`'s `nn.Linear`s would
    (so a dense FFN's weights broadcast into every slice when upcycling).

    Declared with transformers' `use_experts_implementation` (no gate projection, biases): `forward(hidden_states
    (tokens, hidden), top_k_index (tokens, k), top_k_weights (tokens, k)) -> (tokens, hidden)` runs the implementation
    `config.experts_implementation` names in transformers' registry: transformers' `eager` (this class's own forward:
    every expert on every token, mixed by the weights; what a captured program runs), `batched_mm`, `grouped_mm`, any
    kernel registered there, or MT-TaG's `"taskmoe_sorted"` (`sorted_experts_forward`) and the default
    `"taskmoe_auto"` (`default_experts_implementation`). peft's LoRA reaches the experts through
    `target_parameters=["experts.up_proj", "experts.down_proj"]` (a `ParamWrapper` on this module: the weights are
    read in `forward` only, where its parametrization is active).

    `config`: the model's config (its `experts_implementation` is read on each call; `hidden_size`,
    `intermediate_size`, `hidden_act` and `num_experts` are the defaults of the other arguments). Indexing (`bank[i]`)
    and iteration give each expert as a callable, for analyses.
    """

    def __init__(self, config, num_experts: int | None = None, hidden_size: int | None = None,
                 intermediate_size: int | None = None, hidden_act: str | nn.Module | None = None):
        super().__init__()
        self.num_experts = config.num_experts if num_experts is None else num_experts
        hidden = config.hidden_size if hidden_size is None else hidden_size
        inter = config.intermediate_size if intermediate_size is None else intermediate_size
        act = config.hidden_act if hidden_act is None else hidden_act
        self.up_proj = nn.Parameter(torch.empty(self.num_experts, inter, hidden))
        self.up_proj_bias = nn.Parameter(torch.zeros(self.num_experts, inter))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, hidden, inter))
        self.down_proj_bias = nn.Parameter(torch.zeros(self.num_experts, hidden))
        self.act_fn = ACT2FN[act] if isinstance(act, str) else act
        for weight in (self.up_proj, self.down_proj):  # as `nn.Linear` draws each (the model's `_init_weights` redraws)
            for expert in weight.detach():
                nn.init.kaiming_uniform_(expert, a=5**0.5)

    @classmethod
    def copy_of(cls, config, w_in: nn.Linear, act: nn.Module, w_out: nn.Linear, num_experts: int) -> ExpertBank:
        """`num_experts` experts, each a copy of a dense FFN (`w_in`, `act`, `w_out`: the dense model's own modules,
        e.g. BERT's `intermediate.dense`, `intermediate.intermediate_act_fn`, `output.dense`); `config` the model's."""
        bank = cls(config, num_experts, w_in.in_features, w_in.out_features, act)
        with torch.no_grad():
            for mine, dense in ((bank.up_proj, w_in.weight), (bank.up_proj_bias, w_in.bias),
                                (bank.down_proj, w_out.weight), (bank.down_proj_bias, w_out.bias)):
                mine.copy_(dense.expand_as(mine) if dense is not None else torch.zeros_like(mine))
        # (no `.to` when the dtype is already the dense model's: a module moved under FakeTensorMode cannot swap)
        return bank if bank.up_proj.dtype == w_in.weight.dtype else bank.to(w_in.weight.dtype)

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        """N(0, std) weights and zero biases (BERT's `nn.Linear` init, per expert), through `transformers.
        initialization`, which leaves weights a checkpoint loaded alone."""
        from transformers import initialization as init

        init.normal_(self.up_proj, mean=0.0, std=std)
        init.normal_(self.down_proj, mean=0.0, std=std)
        init.zeros_(self.up_proj_bias)
        init.zeros_(self.down_proj_bias)

    def __len__(self) -> int:
        return self.num_experts

    def __getitem__(self, index: int):
        """Expert `index` as a callable `(..., hidden) -> (..., hidden)` (its slices of the stacked weights)."""
        if not -self.num_experts <= index < self.num_experts:
            raise IndexError(f"expert {index} of {self.num_experts}")
        return _Expert(self, index % self.num_experts)

    def __iter__(self):
        return (self[i] for i in range(self.num_experts))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """transformers' `eager`: every expert on every token, `(tokens, hidden)`, each output scaled by the token's
        weight for that expert (its `top_k_weights` entry where chosen, 0 otherwise) and summed. No shape depends on
        the routes (a captured program runs it: `torch.export`, ONNX); `num_experts` times the FFN compute."""
        return every_expert_forward(self, hidden_states, top_k_index, top_k_weights)

    def extra_repr(self) -> str:
        inter, hidden = self.up_proj.shape[1:]
        return f"num_experts={self.num_experts}, hidden={hidden}, intermediate={inter}"


def every_expert_forward(bank: ExpertBank, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor) -> torch.Tensor:
    """`ExpertBank`'s own forward (transformers' `eager`): every expert on every token, mixed by the weights."""
    # (tokens, experts): each token's weight for each expert, 0 where not chosen
    combine = top_k_weights.new_zeros(hidden_states.shape[0], bank.num_experts).scatter_add(1, top_k_index,
                                                                                            top_k_weights)
    h = bank.act_fn(torch.einsum("th,eih->tei", hidden_states, bank.up_proj) + bank.up_proj_bias)  # (tokens, E, inter)
    y = torch.einsum("tei,ehi->teh", h, bank.down_proj) + bank.down_proj_bias  # (tokens, experts, hidden)
    return torch.einsum("teh,te->th", y, combine.to(y.dtype))  # (tokens, hidden)


def sorted_experts_forward(bank: ExpertBank, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor, straight_through: bool = False,
                           expert_range: torch.Tensor | None = None, loop: bool | None = None) -> torch.Tensor:
    """MT-TaG's experts implementation, `"taskmoe_sorted"` in transformers' registry (`docs/moe-dispatch.md`): the
    slots (token, choice) sorted by expert with one sort on 8-bit keys, the tokens gathered in that order
    (`permute_rows`: no scatter of atomic adds in the backward), each expert on its contiguous slice -- a loop of
    `F.linear`s in eager code on a CPU (one host read per layer, the slice sizes), else one grouped GEMM per
    projection (`_grouped_product`: no host read; traceable by torch.compile in every dtype) -- and the outputs put
    back in token order (`put_back_rows`, a copy or a gather, not an `index_add_`). Top-1 scales in token order,
    after the put-back; top-k sums each token's slots.

    The arguments of `TaskMoE`'s calls: `straight_through` (top-1): `top_k_weights` are the chosen experts' gate
    probabilities and the value is the experts' outputs unscaled, with the gradient of `g* E*(x)` reaching the gate
    (`_PutBackStraightThrough`; the other implementations are given weights `(g* - sg(g*)) + 1` to multiply in: the
    same numbers); `expert_range`: `arange(num_experts)` in 8-bit when the caller keeps one for every layer. `loop`:
    the loop (True: `"taskmoe_sorted_loop"`) or the grouped GEMMs (False: `"taskmoe_sorted_grouped"`) everywhere;
    None (`"taskmoe_sorted"`): `loops_over_experts`. In a captured program (`torch.export`, ONNX) every expert runs
    on every token (`every_expert_forward`)."""
    if is_capturing():  # no shape may depend on the routes
        if straight_through:
            top_k_weights = (top_k_weights - top_k_weights.detach()) + 1.0
        return every_expert_forward(bank, hidden_states, top_k_index, top_k_weights)
    return _sorted_dispatch(hidden_states, top_k_index, top_k_weights, bank.num_experts,
                            partial(_experts_on_slices, bank, loop=loop), straight_through, expert_range, cast=True)


def _sorted_dispatch(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, n: int, on_slices,
                     straight_through: bool = False, expert_range: torch.Tensor | None = None,
                     cast: bool = False) -> torch.Tensor:
    """`sorted_experts_forward`'s dispatch around `on_slices(x_sorted, ends, sorted_expert, expert_range)`, which
    runs each of the `n` experts on its slice of the sorted slots; `cast`: cast `x` to autocast's dtype before the
    permutation (experts that compute in it). Also the dispatch of experts that are whole modules (`TaskMoE`)."""
    k = top_k_index.shape[-1]
    flat_expert = top_k_index.reshape(-1)  # (tokens*k,): slot s = token s//k, its (s%k)-th choice
    # slots grouped by expert, and their experts. Sorted on 8-bit keys: a GPU's radix sort makes a pass per few
    # key bits, so int64 keys cost it about eight times the passes (33 us of an H100's 4,096-token step)
    keys = flat_expert.to(torch.uint8) if n <= 256 else flat_expert
    sorted_key, order = torch.sort(keys, stable=True)  # the slots' experts, sorted, in the keys' dtype
    # where each expert's slice ends: a search of the sorted experts, whose size is fixed (no `bincount`, whose
    # output size is read back from the device on a GPU), in int32 as the grouped GEMM's offsets are
    if expert_range is None or expert_range.dtype != keys.dtype:
        expert_range = torch.arange(n, dtype=keys.dtype, device=x.device)
    ends = torch.searchsorted(sorted_key, expert_range, right=True, out_int32=True)  # (experts,)
    if k == 1:
        # under autocast the experts compute in its dtype: cast before the permutation (and its backward), which
        # then moves half the bytes (a cast is elementwise, so the numbers are the same). Top-1 only: with k > 1
        # a token's slots are summed, in `x`'s dtype (the put-back's sum, the gradient's `index_add_`)
        dtype = compute_dtype(x) if cast else x.dtype
        if x.dtype != dtype:
            x = x.to(dtype)
        x_sorted = permute_rows(x, order)  # (tokens, hidden), contiguous per expert
    else:
        token_of_slot = order // k
        x_sorted = x.index_select(0, token_of_slot)  # (tokens*k, hidden), contiguous per expert
    y_sorted = on_slices(x_sorted, ends, sorted_key, expert_range)  # (tokens*k, hidden)
    if k == 1:  # (tokens, hidden) back in token order
        if straight_through and torch.is_grad_enabled():
            return _PutBackStraightThrough.apply(y_sorted, order, top_k_weights)
        y = put_back_rows(y_sorted, order)
        # (without a backward the straight-through value is the expert's output; the gate's weights scale the
        # outputs after, in token order: no gather of the weights)
        return y if straight_through else y * top_k_weights
    y_sorted = y_sorted * top_k_weights.reshape(-1).index_select(0, order).unsqueeze(-1)
    return torch.zeros_like(x).index_add_(0, token_of_slot, y_sorted)  # sum of a token's k experts


def _experts_on_slices(bank: ExpertBank, x: torch.Tensor, ends: torch.Tensor, slot_expert: torch.Tensor,
                       expert_range: torch.Tensor, loop: bool | None = None) -> torch.Tensor:
    """Each expert on its slice of `x` `(slots, hidden)`, sorted by expert: `ends` `(N,)` int32 where each expert's
    slice ends, `slot_expert` `(slots,)` each slot's expert (the 8-bit sort keys), `expert_range` `arange(N)` in their
    dtype. A loop of `F.linear`s in eager code on a CPU (where it is the faster), else one grouped GEMM per
    projection (`loop`: either one everywhere)."""
    dtype = compute_dtype(x)
    if loops_over_experts(x) if loop is None else loop:
        weights = (bank.up_proj, bank.up_proj_bias, bank.down_proj, bank.down_proj_bias)
        if torch.is_autocast_enabled(x.device.type):
            # cast as stored, once, not each expert's slices in its `F.linear`s: four casts per layer where there
            # were four per expert, in the forward and in the backward (a cast is elementwise: the same numbers)
            weights = tuple(w.to(dtype) for w in weights)
        w_in, b_in, w_out, b_out = (w.unbind(0) for w in weights)
        act = bank.act_fn
        experts = [
            lambda chunk, i=i: F.linear(act(F.linear(chunk, w_in[i], b_in[i])), w_out[i], b_out[i])
            for i in range(bank.num_experts)
        ]
        return _expert_loop(experts, x, ends)
    # the grouped GEMM takes (experts, in, out): the stored weights transposed, a view
    h = _grouped_product(x.to(dtype), bank.up_proj.to(dtype).transpose(1, 2), ends)  # (slots, inter)
    if torch.is_grad_enabled():
        # each slot's expert as a one-hot row: the biases reach the slots by a product whose backward is a product
        # too (`index_select` of the biases would scatter their gradients back with contended atomic adds)
        slot_one_hot = one_hot(slot_expert, bank.num_experts, dtype, expert_range)  # (slots, experts)
        h = bank.act_fn(torch.addmm(h, slot_one_hot, bank.up_proj_bias.to(dtype)))
        y = _grouped_product(h, bank.down_proj.to(dtype).transpose(1, 2), ends)  # (slots, hidden)
        return torch.addmm(y, slot_one_hot, bank.down_proj_bias.to(dtype))
    # no gradient: a gather of the biases is the cheaper (a (slots, experts) product with K = experts is not; the
    # H200's replayed bf16 inference of MT-TaG took 4.63 ms with the products against 4.35 with the gathers)
    slot_expert = slot_expert.long()  # (an index of `index_select`: int64, or int32, not 8-bit)
    h = bank.act_fn(h + bank.up_proj_bias.to(dtype).index_select(0, slot_expert))
    y = _grouped_product(h, bank.down_proj.to(dtype).transpose(1, 2), ends)  # (slots, hidden)
    return y + bank.down_proj_bias.to(dtype).index_select(0, slot_expert)


def loops_over_experts(x: torch.Tensor) -> bool:
    """Whether `sorted_experts_forward` runs its experts on `x` by a loop of `F.linear`s (eager code on a CPU, where
    it is the faster) or by grouped GEMMs (elsewhere, and under torch.compile: no graph break)."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


def _grouped_product(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """`x` `(slots, in)` sorted by group times each group's `weight` `(groups, in, out)`, `(slots, out)`: torch's
    `F.grouped_mm` where it runs (the widths 16-byte aligned; under torch.compile in bf16 only: torch 2.13's meta
    kernel takes no other dtype), else transformers' grouped product (`transformers::grouped_mm_fallback`: a loop
    of products behind a custom op with a fake kernel, which torch.compile traces in every dtype)."""
    if grouped_mm_fits(x.shape[1], weight.shape[2]) and (
        x.dtype == torch.bfloat16 or not torch.compiler.is_compiling()
    ):
        return F.grouped_mm(x, weight, offs=ends)
    return GROUPED_MM_FALLBACK(x, weight, ends)


def auto_experts_forward(bank: ExpertBank, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor, **kwargs) -> torch.Tensor:
    """`"taskmoe_auto"` (the default): the implementation `default_experts_implementation` picks for this call's
    device and compute dtype; `kwargs` (`sorted_experts_forward`'s) go to MT-TaG's own only."""
    name = default_experts_implementation(hidden_states.device, compute_dtype(hidden_states), bank.num_experts)
    if name == SORTED:
        return sorted_experts_forward(bank, hidden_states, top_k_index, top_k_weights, **kwargs)
    return every_expert_forward(bank, hidden_states, top_k_index, top_k_weights)  # "eager"


ALL_EXPERTS_FUNCTIONS.register(SORTED, sorted_experts_forward)
ALL_EXPERTS_FUNCTIONS.register(SORTED_LOOP, partial(sorted_experts_forward, loop=True))
ALL_EXPERTS_FUNCTIONS.register(SORTED_GROUPED, partial(sorted_experts_forward, loop=False))
ALL_EXPERTS_FUNCTIONS.register(AUTO, auto_experts_forward)


class _Expert:
    """One expert of an `ExpertBank` as a callable (`bank[i]`)."""

    def __init__(self, bank: ExpertBank, index: int):
        self.bank, self.index = bank, index

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        bank, i = self.bank, self.index
        hidden = F.linear(x, bank.up_proj[i], bank.up_proj_bias[i])
        return F.linear(bank.act_fn(hidden), bank.down_proj[i], bank.down_proj_bias[i])


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

    def __init__(self, config, layer_idx: int | None = None, experts: ExpertBank | Sequence[nn.Module] | None = None,
                 low_rank_ffn: nn.Module | None = None, context=None):
        """`config`: a `TaskMoEConfig` (hidden and intermediate sizes, activation, `num_experts`, `gating`,
        `top_k`, `expert_weighting`, `experts_implementation`, the auxiliary-loss coefficients, the tasks), read on
        each call for its `experts_implementation`. A layer outside `config.moe_layer_indices` (`layer_idx`) is dense:
        one expert, no gate. `experts`: the experts themselves, e.g. copies of a dense model's FFN
        (`hf_taskmoe.models.task_moe`), instead of fresh ones: an `ExpertBank` (stacked two-projection experts on
        transformers' experts interface), or modules mapping `(..., hidden)` to `(..., hidden)` (e.g. a gated FFN,
        run by a loop over the sorted tokens whatever the implementation). Fresh experts are an `ExpertBank`; a
        one-expert (dense) layer is one `ExpertFFN` in `experts.0`, the dense FFN as it was, at no cost for
        stacking.

        `low_rank_ffn` (MT-TaG with `expert_rank`, instead of `experts`): the dense FFN itself, one copy, whose
        linears are `TokenLowRankExperts` holding each expert's LoRA delta; it sits in `experts.0`. The layer routes as
        with whole experts, gives each wrapped linear its tokens' combine weights (`(batch, seq, experts)`: one-hot of
        the chosen expert under top-1; the renormalised top-k probabilities, with their gradient, under top-k), runs
        the FFN once on every token (`W x + s * sum_j d_tj B_j A_j x` on each linear: expert `j` is the FFN with its
        deltas; the decisions reach the linears through `context`, the model's `TaskContext`, the way task routing's
        do: in its flags, keyed by the layer, while the FFN runs; a layer built on its own makes its own context) and
        weights the output: straight-through multiplies by `(g - sg(g)) + 1` (exactly 1.0 in value, `g` the chosen
        experts' summed probability), `"gate"` by `g`. Under top-k the deltas are mixed, not the experts'
        outputs (one FFN run). `experts_implementation` does not apply (nothing is stacked)."""
        super().__init__()
        moe_layer = layer_idx is None or layer_idx in config.moe_layer_indices
        self.config = config
        self.num_experts = config.num_experts if moe_layer else 1
        self.num_tasks = config.num_tasks
        self.top_k = config.top_k if self.num_experts > 1 else 1
        self.gating = config.gating
        self.expert_weighting = config.expert_weighting
        self.compute_aux_loss = config.router_aux_loss_coef > 0
        self.compute_z_loss = config.router_z_loss_coef > 0
        self.low_rank = low_rank_ffn is not None
        if self.low_rank:
            if experts is not None or self.num_experts == 1:
                raise ValueError(
                    f"TaskMoE of layer {layer_idx}: `low_rank_ffn` replaces `experts` (not both) in an MoE layer "
                    f"(num_experts > 1), got experts={experts is not None}, num_experts={self.num_experts}."
                )
            experts = [low_rank_ffn]
            if context is None:  # a layer on its own: a context of its own (a model's layers share the model's)
                from ..backbones.base import TaskContext

                context = TaskContext()
            self.decisions_key = token_decisions_key(layer_idx if layer_idx is not None else 0)
            for linear in low_rank_ffn.modules():
                if isinstance(linear, TokenLowRankExperts):
                    linear.context, linear.route_index = context, layer_idx if layer_idx is not None else 0
        elif experts is not None and len(experts) != self.num_experts:
            raise ValueError(f"TaskMoE of layer {layer_idx} takes {self.num_experts} experts, got {len(experts)}.")
        self.context = context  # a plain object (no weights): shared with the model, not saved
        if experts is None and self.num_experts > 1:
            experts = ExpertBank(config)
        elif experts is None:
            experts = [ExpertFFN(config.hidden_size, config.intermediate_size, config.hidden_act)]
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
        if self.router is None:  # MT-Dense: the FFN itself, no routing.
            return MoEOutput(self.experts[0](hidden_states))

        logits = self.route(hidden_states, task_ids)  # (batch, seq, experts) fp32
        probs = logits.softmax(dim=-1)
        top_p, top_e = probs.topk(self.top_k, dim=-1)  # (batch, seq, k)
        if self.low_rank:
            y = self._low_rank_forward(hidden_states, top_p, top_e)
        else:
            y = self._experts_forward(hidden_states, top_p, top_e)

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

    def _low_rank_forward(self, hidden_states: torch.Tensor, top_p: torch.Tensor,
                          top_e: torch.Tensor) -> torch.Tensor:
        """The dense FFN once on every token, each token's chosen deltas on its linears (`low_rank_ffn`)."""
        if self.top_k == 1:  # exactly one-hot: the chosen expert's delta alone
            decisions = F.one_hot(top_e[..., 0], self.num_experts).to(hidden_states.dtype)  # (batch, seq, experts)
        else:  # the deltas mixed by the renormalised top-k probabilities
            share = top_p / top_p.sum(dim=-1, keepdim=True)
            decisions = top_p.new_zeros(*top_p.shape[:-1], self.num_experts).scatter(-1, top_e, share)
        # the FFN's linears read them from the context (`TokenLowRankExperts.routing`), for this call only: a new dict,
        # so that a snapshot of the flags (a checkpointed layer's) is not changed
        context = self.context
        flags = context.flags
        context.flags = {**flags, self.decisions_key: decisions}
        try:
            y = self.experts[0](hidden_states)
        finally:
            context.flags = flags
        g = top_p.sum(dim=-1, keepdim=True)  # (batch, seq, 1) fp32: the chosen experts' probability
        weight = g if self.expert_weighting == "gate" else (g - g.detach()) + 1.0  # straight-through: 1.0 in value
        return y * weight.to(y.dtype)

    def _experts_forward(self, hidden_states: torch.Tensor, top_p: torch.Tensor,
                         top_e: torch.Tensor) -> torch.Tensor:
        """Whole experts: the chosen experts on their tokens (the dispatch `experts_implementation` names)."""
        batch, seq, hidden = hidden_states.shape
        x = hidden_states.reshape(-1, hidden)  # (tokens, hidden)
        top_k_index = top_e.view(-1, self.top_k)  # (tokens, k)
        # top-1 straight-through in MT-TaG's own dispatch: the value is the expert's output, the gate's gradient that
        # of eq. 6, without a (tokens, hidden) product (`_PutBackStraightThrough`); elsewhere the weights multiplied
        # in are 1.0 in value (`_combine_weights`): the same numbers
        straight_through = self.top_k == 1 and self.expert_weighting == "straight_through" and not is_capturing()
        ours = not self.stacked or (
            resolve_experts_implementation(self.config._experts_implementation, x, self.num_experts)
            in SORTED_IMPLEMENTATIONS
        )
        if ours and straight_through:
            weights = top_p.view(-1, 1)  # (tokens, 1)
        else:
            weights = self._combine_weights(top_p).to(hidden_states.dtype).view(-1, self.top_k)  # (tokens, k)
        if not self.stacked:  # whole FFN modules: the loop over the sorted tokens
            y = self._module_experts(x, top_k_index, weights, straight_through)
        elif ours:
            y = self.experts(x, top_k_index, weights, straight_through=straight_through,
                             expert_range=self._expert_range(x.device))
        else:  # an implementation of transformers' registry
            y = self.experts(x, top_k_index, weights)
        return y.view(batch, seq, hidden)

    def _expert_range(self, device) -> torch.Tensor:
        """`arange(num_experts)` in 8-bit (the sort keys' dtype), made once per forward for every layer
        (`shared_tensor`)."""
        n = self.num_experts
        return self.shared_tensor(("experts", n, device), lambda: torch.arange(n, dtype=torch.uint8, device=device))

    def _module_experts(self, x: torch.Tensor, top_k_index: torch.Tensor, weights: torch.Tensor,
                        straight_through: bool) -> torch.Tensor:
        """Experts that are whole FFN modules (DistilBERT's `ffn`, ModernBERT's gated `mlp`), on `x` `(tokens,
        hidden)`: MT-TaG's sorted dispatch (`_sorted_dispatch`) with a loop over the experts' slices
        (`_expert_loop`), whatever `experts_implementation` says; in a captured program (`torch.export`, ONNX) every
        expert on every token, masked by the weights."""
        if is_capturing():  # no shape may depend on the routes
            combine = weights.new_zeros(x.shape[0], self.num_experts).scatter_add(1, top_k_index, weights)
            outputs = torch.stack([expert(x) for expert in self.experts], dim=1)  # (tokens, experts, hidden)
            return torch.einsum("teh,te->th", outputs, combine.to(outputs.dtype))  # (tokens, hidden)
        return _sorted_dispatch(x, top_k_index, weights, self.num_experts,
                                lambda x_sorted, ends, *_: _expert_loop(self.experts, x_sorted, ends),
                                straight_through, self._expert_range(x.device))

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
