"""Low-rank experts: one dense linear shared by every expert, plus each expert's own LoRA delta.

`LowRankExperts` wraps one linear of a routed layer (`nn.Linear`, or transformers' `Conv1D` for GPT-2, whose weight is
stored `(in, out)`): `base_layer` is the dense layer's own module (frozen unless the model trains its base), and
expert `j` adds `scaling * B_j A_j x` with `A_j` `(r, in)` (peft's init: Kaiming-uniform, `a = sqrt(5)`, per expert)
and `B_j` `(out, r)` zero at init, `scaling = alpha / r` (peft's `lora_alpha / r`). A row `b` whose routing decisions
are `d_b` `(experts,)` computes

    base(x_b) + scaling * sum_j d_bj B_j A_j x_b

for its tokens: one base product for every row, then the low-rank products. With every `B` zero the output is the
dense layer's exactly, whatever the decisions.

Two ways to compute the deltas, chosen from the model's configuration and state (`expert_path`), never from the
decisions' values (nothing is read back to the host):

- `"mix"` (every expert): `h = x A^T` over the experts' stacked factors `(E * r, in)`, each expert's `r` columns
  scaled by the row's decision, then `h B^T` over the stacked `(out, E * r)`: two GEMMs of rank `E * r`. Soft routes
  (`softmax`, `average`, `gumbel_softmax`) need it, and so does straight-through training (`gumbel_softmax_st`), whose
  router gradient reaches every expert's delta.
- `"one"` (one expert per row): each row's chosen expert (`decisions.argmax(-1)`, on the device) has its factors
  gathered (`index_select`: `(batch, r, in)`, `(batch, out, r)`) and applied with two `torch.bmm`: rank-`r` compute
  per row, punica's BGMV in plain torch. The delta is multiplied by the chosen decision's value (exactly 1 under a
  hard route; `selection="hard"` carries its `p / sg(p)` router gradient through it). Hard routes take it: `hard` in
  training, every one-hot route at evaluation and in generation. In generation the rows' routes are fixed, so the
  model's `generate` puts a dict in the context (`flags["expert_rows"]`, kept on that call's cache) in which each
  linear keeps its rows' gathered factors from the first step on (`row_factors`, `add_row_deltas`): the later steps
  gather nothing.

`TokenLowRankExperts` is the per-token sibling MT-TaG uses with `expert_rank`: the decisions reach both the same way,
through the model's `TaskContext` (one mechanism: restored under gradient checkpointing, traced by torch.compile);
its MoE layer puts each token's decisions `(batch, seq, experts)` (one-hot of the token's chosen expert under top-1)
in the context's flags, keyed by the layer, while it runs the FFN, and the `"mix"` path above computes
`base(x_t) + scaling * sum_j d_tj B_j A_j x_t` in the same two stacked GEMMs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from ..utils import check_float

__all__ = ["EXPERT_PATHS", "LowRankExperts", "LowRankSpec", "TokenLowRankExperts", "check_low_rank_fields",
           "expert_path", "token_decisions_key", "wrap_linears"]

#: the two ways of computing the deltas (module docstring)
EXPERT_PATHS = ("mix", "one")
#: selections whose decisions are one-hot in value wherever their gradient does not need every expert
ONE_HOT_SELECTIONS = ("hard", "gumbel_softmax_st")


def expert_path(selection: str, needs_every_expert: bool, decisions_given: bool) -> str:
    """Which path computes a forward's deltas: `"one"` (one expert per row) for the hard routes -- `selection` `hard`,
    or `gumbel_softmax_st` but in training with gradients (`needs_every_expert`: straight-through needs every expert's
    delta) -- of the router's own decisions; `"mix"` (every expert, mixed by the decisions) otherwise, and for
    decisions given by hand (`routing_weights=`), which may be anything."""
    if decisions_given or needs_every_expert or selection not in ONE_HOT_SELECTIONS:
        return "mix"
    return "one"


def _dims(base: nn.Module) -> tuple[int, int]:
    """`(in, out)` of a linear: `nn.Linear` stores its weight `(out, in)`, `Conv1D` `(in, out)`."""
    if isinstance(base, Conv1D):
        return base.weight.shape[0], base.weight.shape[1]
    return base.in_features, base.out_features


class LowRankExperts(nn.Module):
    """One linear of a routed layer with `num_experts` LoRA deltas (module docstring). The routing decisions of the
    current forward are read from the model's `TaskContext` (`flags["routing_weights"][:, route_index]`, `(batch,
    experts)`) and the path from `flags["expert_path"]`: the context the family fills before calling the dense model,
    and restores while a checkpointed layer is recomputed (`TaskContext.checkpoint_kwargs`).

    `weight` and `bias` read through to the base layer (the dense modules read them: T5's feed-forward its `wo`'s
    dtype)."""

    def __init__(self, base_layer: nn.Module, num_experts: int, rank: int, alpha: float, dropout: float = 0.0,
                 route_index: int = 0, context=None):
        super().__init__()
        self.base_layer = base_layer
        self.in_features, self.out_features = _dims(base_layer)
        self.num_experts, self.rank = num_experts, rank
        self.scaling = alpha / rank
        self.fan_in_fan_out = isinstance(base_layer, Conv1D)  # peft's name for a weight stored (in, out)
        self.route_index = route_index
        self.context = context  # a plain object (no weights): shared with the model, not saved
        weight = base_layer.weight
        self.lora_A = nn.Parameter(torch.empty(num_experts, rank, self.in_features, device=weight.device,
                                               dtype=weight.dtype))
        self.lora_B = nn.Parameter(torch.zeros(num_experts, self.out_features, rank, device=weight.device,
                                               dtype=weight.dtype))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.reset_lora_parameters()

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base_layer.bias

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        """peft's LoRA init, per expert: `A_j` Kaiming-uniform (`a = sqrt(5)`, fan-in `in`), `B_j` zero."""
        from transformers import initialization as init

        # transformers' guarded init skips a loaded weight by its flag, which a slice (`lora_A[j]`) does not carry
        if not getattr(self.lora_A, "_is_hf_initialized", False):
            for j in range(self.num_experts):
                init.kaiming_uniform_(self.lora_A[j], a=math.sqrt(5))
        init.zeros_(self.lora_B)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, experts={self.num_experts}, rank={self.rank}, "
                f"scaling={self.scaling:g}")

    def delta_weight(self, expert: int) -> torch.Tensor:
        """Expert `expert`'s `scaling * B_j A_j` in the base weight's layout (`(out, in)`; `(in, out)` for Conv1D)."""
        delta = self.scaling * (self.lora_B[expert] @ self.lora_A[expert])  # (out, in)
        return delta.T if self.fan_in_fan_out else delta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        rows = self.context.flags.get("expert_rows") if self.context is not None else None
        if rows is not None:  # a generation's decoding step: each row's factors, gathered at its first step
            factors = rows.get(self)
            if factors is None or factors[0].shape[0] != x.shape[0]:
                factors = rows[self] = self.row_factors(self.routing()[0])
            return self.add_row_deltas(out, x, *factors)
        decisions, path = self.routing()
        return out + self.delta(x, decisions, path).to(out.dtype)

    @torch.no_grad()
    def row_factors(self, decisions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's chosen expert's factors for the `"one"` path, gathered once for the rows of a generation (their
        routes do not change while they decode): `A` `(batch, in, r)` times the chosen decision's value and
        `scaling`, and `B` `(batch, r, out)`, both contiguous in the layout `torch.bmm` reads fastest. On the device,
        nothing read back; no gradient (generation only)."""
        idx = decisions.argmax(-1)  # (b,) each row's expert
        value = decisions.gather(1, idx[:, None]).to(self.lora_A.dtype) * self.scaling  # (b, 1)
        A = self.lora_A.index_select(0, idx).transpose(1, 2) * value[:, :, None]  # (b, in, r)
        B = self.lora_B.index_select(0, idx).transpose(1, 2).contiguous()  # (b, r, out)
        return A.contiguous(), B

    def add_row_deltas(self, out: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        """`out + x_b A_b B_b` per row `b` with `row_factors`' `A`, `B`: two batched products, the second adding
        into the base output (`baddbmm`)."""
        shape = x.shape
        h = torch.bmm(self.dropout(x).reshape(shape[0], -1, shape[-1]).to(A.dtype), A)  # (b, T, r)
        if h.dtype != out.dtype:
            return out + torch.bmm(h, B).view(out.shape).to(out.dtype)
        return torch.baddbmm(out.reshape(shape[0], -1, out.shape[-1]), h, B).view(out.shape)  # (b, T, out)

    def routing(self) -> tuple[torch.Tensor, str]:
        """This forward's decisions `(batch, experts)` and path, from the model's `TaskContext`."""
        flags = self.context.flags if self.context is not None else {}
        weights = flags.get("routing_weights")
        if weights is None:
            self.context.require_task_ids()  # raises: called outside the model's forward
        return weights[:, self.route_index], flags.get("expert_path", "mix")

    def delta(self, x: torch.Tensor, decisions: torch.Tensor, path: str = "mix") -> torch.Tensor:
        """`scaling * sum_j d_bj B_j A_j x_b` for `x` `(batch, ..., in)` and `decisions` `(batch, experts)` (one row's
        for all its tokens), or per token, `decisions` `(batch, ..., experts)` with `x`'s leading shape (MT-TaG's
        token routing, `"mix"` path only: `scaling * sum_j d_tj B_j A_j x_t`)."""
        shape = x.shape
        x = self.dropout(x).reshape(shape[0], -1, shape[-1])  # (b, T, in)
        A, B = self.lora_A, self.lora_B  # (E, r, in), (E, out, r)
        d = decisions.to(x.dtype)
        per_token = d.dim() == len(shape)
        if per_token:
            if path != "mix":
                raise ValueError(f"Per-token decisions take the 'mix' path, got path={path!r}.")
            d = d.reshape(shape[0], -1, d.shape[-1])  # (b, T, E)
        if path == "one":
            idx = d.argmax(-1)  # (b,) each row's expert, on the device
            # the chosen decision's value (exactly 1 under a hard route; its gradient, if any) and the scale multiply
            # the rank-r product, not the output: r columns, not `out`, in the forward, the backward and the memory
            value = d.gather(1, idx[:, None]) * self.scaling  # (b, 1)
            h = torch.bmm(x, A.index_select(0, idx).transpose(1, 2)) * value[:, :, None]  # (b, T, r)
            y = torch.bmm(h, B.index_select(0, idx).transpose(1, 2))  # (b, T, out)
        elif path == "mix":
            E, r = self.num_experts, self.rank
            h = x @ A.reshape(E * r, -1).T  # (b, T, E * r)
            scale = (d * self.scaling).repeat_interleave(r, dim=-1)  # each expert's r columns by its decision
            h = h * (scale if per_token else scale[:, None, :])
            y = h @ B.permute(1, 0, 2).reshape(-1, E * r).T  # (b, T, out)
        else:
            raise ValueError(f"`path` must be one of {EXPERT_PATHS}, got {path!r}.")
        return y.reshape(*shape[:-1], y.shape[-1])


class TokenLowRankExperts(LowRankExperts):
    """`LowRankExperts` whose decisions are per token (MT-TaG with `expert_rank`): the MoE layer that owns it
    (`hf_taskmoe.layers.moe.TaskMoE`, layer `route_index`) puts each token's combine weights `(batch, seq, experts)`
    (one-hot of the token's chosen expert under top-1) in the same `TaskContext` as task routing's decisions, under
    `token_decisions_key(route_index)`, for the time its FFN runs (restored with the context when a checkpointed layer
    is recomputed). The deltas take the `"mix"` path: `base(x) + scaling * sum_j d_tj B_j A_j x_t` in one stacked
    product of rank `experts * rank`, no loop over the experts, nothing read back to the host. Outside its owner's
    forward (no decisions in the context) it is refused."""

    def routing(self) -> tuple[torch.Tensor, str]:
        flags = self.context.flags if self.context is not None else {}
        decisions = flags.get(token_decisions_key(self.route_index))
        if decisions is None:
            raise RuntimeError(
                "A TokenLowRankExperts runs inside its MoE layer's forward, which puts its tokens' decisions in the "
                "task context."
            )
        return decisions, "mix"


def token_decisions_key(layer: int) -> str:
    """The `TaskContext.flags` key under which MoE layer `layer` gives its `TokenLowRankExperts` its tokens'
    decisions."""
    return f"token_decisions.{layer}"


def check_low_rank_fields(config, default_targets: str) -> None:
    """Validate a config's `expert_rank`, `expert_alpha`, `expert_dropout`, `expert_targets` and `train_base` (the
    latter four apply only with `expert_rank` set); `default_targets` says what `expert_targets=None` means."""
    rank = config.expert_rank
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        raise ValueError(
            f"`expert_rank` must be None (experts are whole copies) or a positive integer (the rank of the low-rank "
            f"experts), got {rank!r}."
        )
    if config.expert_alpha is not None:
        config.expert_alpha = check_float(config.expert_alpha, "expert_alpha", minimum=0.0)
    config.expert_dropout = check_float(config.expert_dropout, "expert_dropout", minimum=0.0)
    if config.expert_dropout >= 1.0:
        raise ValueError(f"`expert_dropout` must be in [0, 1), got {config.expert_dropout}.")
    targets = config.expert_targets
    if targets is not None:
        if isinstance(targets, str) or not isinstance(targets, (list, tuple)) or not targets or not all(
                isinstance(t, str) and t for t in targets):
            raise ValueError(
                f"`expert_targets` must be None ({default_targets}) or a non-empty list of module names or suffixes, "
                f"got {targets!r}."
            )
        config.expert_targets = list(targets)
    if not isinstance(config.train_base, bool):
        raise ValueError(f"`train_base` must be a bool, got {config.train_base!r}.")
    if rank is None:
        given = {name: getattr(config, name) for name in ("expert_alpha", "expert_targets")
                 if getattr(config, name) is not None}
        if config.expert_dropout:
            given["expert_dropout"] = config.expert_dropout
        if config.train_base:
            given["train_base"] = True
        if given:
            raise ValueError(
                f"{sorted(given)} apply to low-rank experts only: set `expert_rank` (a positive integer) too, got "
                f"{given} with expert_rank=None."
            )


@dataclass(frozen=True)
class LowRankSpec:
    """How a routed layer's linears get low-rank experts: `num_experts` deltas of rank `rank`, scale `alpha / rank`,
    `dropout` on the delta's input, on the linears named by `targets` (None: every linear of the layer; else module
    names relative to the layer, or suffixes of them: `"q_proj"`, `"self_attn.o_proj"`)."""

    num_experts: int
    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] | None = None

    def targeted(self, name: str) -> bool:
        return self.targets is None or any(name == t or name.endswith(f".{t}") for t in self.targets)


def wrap_linears(layer: nn.Module, spec: LowRankSpec, route_index: int, context) -> list[str]:
    """Replace each targeted linear of `layer` (`nn.Linear` or `Conv1D`) by a `LowRankExperts` around it, reading the
    decisions of routed layer `route_index` from `context`. Returns the wrapped modules' names (relative to `layer`)."""
    names = [name for name, module in layer.named_modules()
             if isinstance(module, (nn.Linear, Conv1D)) and name and spec.targeted(name)]
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = layer.get_submodule(parent) if parent else layer
        base = getattr(owner, child)
        setattr(owner, child, LowRankExperts(base, spec.num_experts, spec.rank, spec.alpha, spec.dropout,
                                             route_index, context))
    return names
