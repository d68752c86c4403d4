"""Generation under hard routes at the dense model's launch count: a routed layer's experts run as one layer.

Under a hard route each row of a mixed-task batch uses one expert per routed layer. Running each expert on its own
rows (`RoutedLayer`'s per-expert path) is the dense model's arithmetic but one whole layer call per expert used: a
decoding step of a small batch is bound by launches on a GPU, so a batch mixing three experts costs about three
dense steps. Here one copy of the layer runs on all of the rows, cut into segments that each use one expert (the
route is a function of the task, known when generation starts): the runs of the batch's own order when they are few
(`generate` sorts its rows by task, `task_sorted_generate`, so a layer's runs are the tasks'), else the rows sorted
by expert once per generation, gathered before the layer and put back after it:

- each linear (`nn.Linear`, GPT-2's `Conv1D`) is one grouped GEMM over the experts' row segments (`F.grouped_mm`
  with the segment ends, the segmented GEMM of multi-LoRA servers), each expert's weight applied to its rows only;
- each norm (a module whose only parameters are a 1-D `weight` and maybe `bias`) is the layer's own norm holding each
  row's own expert's parameters, `(rows, 1, width)`, where its forward broadcasts them (`weight * normalised`
  norms: RMSNorm, T5's; the dense model's operations, the same numbers), else (`LayerNorm`) run with a unit weight
  and no bias, its output multiplied by each row's weight and shifted by its bias (the same up to rounding);
- any other module with parameters must be equal in every expert (shared), else the layer keeps the per-expert path.

The layer's attention keeps one key/value cache slot (expert 0's) holding every row, in the batch's order or sorted
by expert (`SlotRows.set_slot_rows`), so beam search's reordering is translated as for any slot that keeps a row
subset. The segments' weights are stacked once per generation (`GroupedRoute.module`, freed with the generation's
plan): while a generation runs, the routed layers' weights are held about twice (a run beyond one per expert adds an
expert's copy).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from ..utils import inverse_permutation

__all__ = ["GroupedRoute", "grouped_route"]


class GroupedRoute(list):
    """One routed layer's plan entries (a list of `PlanEntry`, as `hard_route_plan` makes them) when several experts
    share the batch, with the row segments the grouped copy runs: `segments` `[(expert, rows)]` on the host, each a
    contiguous run of the rows in `order` (on the device; None: the batch's own order, nothing gathered) and
    `inverse`, its inverse. `module(experts)` builds the layer's grouped copy on first use."""

    def __init__(self, entries, segments: list[tuple[int, int]], order: torch.Tensor | None):
        super().__init__(entries)
        self.segments, self.order = segments, order
        self.inverse = None if order is None else inverse_permutation(order)
        self._module: nn.Module | None = None
        self._built = False

    def module(self, experts, unused: tuple[str, ...] = ()) -> nn.Module | None:
        """The grouped copy of a layer whose experts are `experts` (None where some module cannot be grouped);
        `unused`: `grouped_layer`'s, the same at every call for one layer."""
        if not self._built:
            device = next(iter(experts[0].parameters())).device
            self._module, self._built = grouped_layer(list(experts), self.segments, device, unused), True
        return self._module


def grouped_route(entries: list, row_experts: list[int], experts: int) -> list:
    """`entries` (one layer's `PlanEntry`s) as a `GroupedRoute` when several unscaled experts share the rows:
    `row_experts` is each row's expert in this layer (host). Where the rows' experts form few runs in the batch's
    own order (at most two per expert: a batch sorted by task, as `generate` sorts it) the runs are the segments and
    nothing is gathered (each run's weights are stacked, so a run more than the experts costs a copy of an expert's
    weights); else the rows are sorted by expert, one segment per expert."""
    if len(entries) < 2 or any(e.rows is None or e.scale for e in entries):
        return entries
    runs: list[tuple[int, int]] = []
    for expert in row_experts:
        if runs and runs[-1][0] == expert:
            runs[-1] = (expert, runs[-1][1] + 1)
        else:
            runs.append((expert, 1))
    if len(runs) <= 2 * experts:
        return GroupedRoute(entries, runs, None)
    ordered = sorted(entries, key=lambda e: e.expert)
    segments = [(e.expert, e.rows.numel()) for e in ordered]
    return GroupedRoute(entries, segments, torch.cat([e.rows for e in ordered]))


def _uses_grouped_mm(weight: torch.Tensor) -> bool:
    """`F.grouped_mm` where it has a kernel for these weights: on a CPU, or in bf16 on an accelerator (torch's fp16 and
    fp32 paths read the offsets back), with 16-byte aligned widths."""
    if not hasattr(F, "grouped_mm") or weight.shape[-1] % 8 or weight.shape[-2] % 8:
        return False
    return weight.device.type == "cpu" or weight.dtype == torch.bfloat16


class GroupedLinear(nn.Module):
    """The experts' linears of one layer as one module: each row segment through its expert's weight. `weight`
    `(segments, out, in)` (each segment's expert's, in `nn.Linear`'s layout; the grouped GEMM takes its transposed
    view, as `ExpertBank` passes its experts), `bias_rows` `(rows, out)` or None, `sizes` each segment's rows."""

    def __init__(self, weight: torch.Tensor, bias_rows: torch.Tensor | None, sizes: list[int], ends: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias_rows", bias_rows, persistent=False)
        self.sizes, self.rows, self.ends = sizes, sum(sizes), ends
        self.grouped = _uses_grouped_mm(weight)
        self.weight_t = weight.transpose(1, 2)  # (segments, in, out): the grouped GEMM's operand, viewed once
        self._offsets: dict[int, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.rows
        flat = x.reshape(-1, x.shape[-1])
        per_row = flat.shape[0] // rows  # tokens per row: the step's length
        if self.grouped:
            offsets = self._offsets.get(per_row)
            if offsets is None:  # one per step length (the prompt, then 1): made once, read by every later step
                offsets = self._offsets[per_row] = self.ends * per_row
            y = F.grouped_mm(flat, self.weight_t, offs=offsets)
        else:  # one product per segment (the sizes are on the host)
            segments = flat.split([size * per_row for size in self.sizes])
            y = torch.cat([F.linear(segment, self.weight[j]) for j, segment in enumerate(segments)])
        if self.bias_rows is not None:
            y = (y.view(rows, per_row, -1) + self.bias_rows.unsqueeze(1)).view(flat.shape[0], -1)
        return y.view(*x.shape[:-1], y.shape[-1])


class _RowAffine:
    """A forward hook on a norm run with a unit weight: each row's output times its expert's weight (plus bias)."""

    def __init__(self, weight_rows: torch.Tensor, bias_rows: torch.Tensor | None):
        self.weight_rows, self.bias_rows = weight_rows, bias_rows

    def __call__(self, module, args, output):
        shape = (output.shape[0],) + (1,) * (output.dim() - 2) + (output.shape[-1],)
        if output.shape[0] != self.weight_rows.shape[0]:
            raise RuntimeError(f"A grouped norm of {self.weight_rows.shape[0]} rows gave {output.shape[0]}.")
        if self.bias_rows is None:
            return output * self.weight_rows.view(shape)
        return torch.addcmul(self.bias_rows.view(shape), output, self.weight_rows.view(shape))  # one operation


def _is_norm(module: nn.Module, params: dict) -> bool:
    return set(params) in ({"weight"}, {"weight", "bias"}) and all(p.dim() == 1 for p in params.values()) and \
        not isinstance(module, (nn.Linear, Conv1D, nn.Embedding))


#: `_norm_form` of each norm class and width already probed
_NORM_FORMS: dict[tuple[type, int, bool], str | None] = {}


def _norm_form(module: nn.Module, params: dict) -> str | None:
    """How a grouped copy runs the norm with each row's own expert's parameters: `"per_row"`, the parameters of shape
    `(rows, 1, width)` swapped in, which the norm's own forward broadcasts (`weight * normalised` written as an
    element-wise product: RMSNorm, T5's; the dense model's operations, the same numbers); `"scaled"`, run with a unit
    weight and no bias, its output times each row's weight plus its bias (`nn.LayerNorm`, whose weight must have the
    normalised shape: one more product); None, neither (a `(1 + weight)` norm, say): the per-expert path. A probe on
    the CPU with random parameters swapped in (`functional_call`): nothing is read from the model's device. Probed
    once per class and width."""
    key = (type(module), params["weight"].shape[0], "bias" in params)
    if key not in _NORM_FORMS:
        _NORM_FORMS[key] = _probe_norm(module, params)
    return _NORM_FORMS[key]


def _probe_norm(module: nn.Module, params: dict) -> str | None:
    from torch.func import functional_call

    g = torch.Generator().manual_seed(0)
    width = params["weight"].shape[0]
    probe = torch.randn(2, 3, width, generator=g)
    drawn = [{name: torch.rand(width, generator=g) + 0.5 for name in params} for _ in range(2)]  # each row's own
    with torch.no_grad():
        expected = torch.cat([functional_call(module, own, (probe[i:i + 1],)) for i, own in enumerate(drawn)])
        try:
            rows = {name: torch.stack([own[name] for own in drawn]).unsqueeze(1) for name in params}  # (2, 1, width)
            if torch.equal(functional_call(module, rows, (probe,)), expected):
                return "per_row"
        except RuntimeError:  # the norm's forward takes parameters of its normalised shape only
            pass
        unit = {"weight": torch.ones(width), **({"bias": torch.zeros(width)} if "bias" in params else {})}
        weight = torch.stack([own["weight"] for own in drawn]).unsqueeze(1)
        bias = torch.stack([own["bias"] for own in drawn]).unsqueeze(1) if "bias" in params else 0.0
        scaled = functional_call(module, unit, (probe,)) * weight + bias
    return "scaled" if torch.allclose(scaled, expected, rtol=1e-4, atol=1e-5) else None


def _clone_structure(module: nn.Module) -> nn.Module:
    """A copy of `module`'s tree whose modules are new objects with their own registries (submodules, parameters,
    buffers, hooks) holding the same tensors: submodules and parameters can be swapped in the copy without touching
    the original, and nothing is copied (`copy.deepcopy` of a layer took 0.14 s of a 0.68 s generation here)."""
    clone = copy.copy(module)
    for name, value in vars(module).items():
        if isinstance(value, (dict, set)):
            setattr(clone, name, copy.copy(value))  # the registries: new containers, the same entries
    for name, child in module._modules.items():
        if child is not None:
            clone._modules[name] = _clone_structure(child)
    return clone


@torch.no_grad()
def grouped_layer(experts: list[nn.Module], segments: list[tuple[int, int]], device,
                  unused: tuple[str, ...] = ()) -> nn.Module | None:
    """A copy of `experts[0]` running each row segment through its expert (`segments`: `(expert, rows)` in row order);
    None where a module with parameters is neither a linear, a norm nor shared by every expert. `unused`: names of
    modules the caller keeps from running in the copy (T5's relative-position table of block 0, whose bias the caller
    computes per row and passes in): they keep expert 0's parameters, whatever the other experts hold."""
    template = _clone_structure(experts[0])
    # hooks on the expert itself watch expert 0's own calls (the per-expert path's instrumentation): not the copy's
    template._forward_pre_hooks.clear()
    template._forward_hooks.clear()
    sizes = [rows for _, rows in segments]
    segment_expert = [expert for expert, _ in segments]
    row_expert = torch.repeat_interleave(torch.tensor(segment_expert), torch.tensor(sizes)).to(device)
    ends = torch.tensor(sizes).cumsum(0).to(device=device, dtype=torch.int32)  # where each segment's rows end
    for name, module in list(template.named_modules()):
        params = dict(module.named_parameters(recurse=False))
        if not params or name in unused:
            continue
        own = [expert.get_submodule(name) if name else expert for expert in experts]
        if isinstance(module, (nn.Linear, Conv1D)):
            # nn.Linear stores (out, in), GPT-2's Conv1D (in, out): stacked as (segments, out, in)
            weights = [m.weight if isinstance(m, nn.Linear) else m.weight.t() for m in own]
            weight = torch.stack([weights[e] for e in segment_expert]).contiguous()
            bias = None if module.bias is None else torch.stack([m.bias for m in own]).index_select(0, row_expert)
            parent, _, child = name.rpartition(".")
            setattr(template.get_submodule(parent) if parent else template, child,
                    GroupedLinear(weight, bias, sizes, ends))
        elif _is_norm(module, params):
            form = _norm_form(module, params)
            if form is None:
                return None
            rows = {name: torch.stack([getattr(m, name) for m in own]).index_select(0, row_expert) for name in params}
            if form == "per_row":  # each row's own parameters, (rows, 1, width), broadcast by the norm itself
                for name, value in rows.items():
                    del module._parameters[name]
                    module.register_buffer(name, value.unsqueeze(1), persistent=False)
                continue
            # the copy's own unit weight (and zero bias); expert 0's parameters are untouched
            module._parameters["weight"] = nn.Parameter(torch.ones_like(params["weight"]), requires_grad=False)
            if "bias" in params:
                module._parameters["bias"] = nn.Parameter(torch.zeros_like(params["bias"]), requires_grad=False)
            module.register_forward_hook(_RowAffine(rows["weight"], rows.get("bias")))
        else:
            for param_name, param in params.items():
                if any(not torch.equal(getattr(m, param_name), param) for m in own[1:]):
                    return None  # differs per expert and is neither a linear nor a norm: the per-expert path
    return template


#: `generate` arguments that may depend on a row's position in the batch (or watch the output as it is made): with
#: any of them, or asked for a dict output, the batch is left in its order
_ORDER_DEPENDENT = ("streamer", "prefix_allowed_tokens_fn", "logits_processor", "stopping_criteria", "assistant_model",
                    "return_dict_in_generate", "output_scores", "output_logits", "output_attentions",
                    "output_hidden_states")


def task_sorted_generate(generate, input_ids: torch.Tensor, kwargs: dict, host_task_ids: list[int] | None,
                         generation_config=None):
    """Run `generate(input_ids=..., **kwargs)` on the batch's rows sorted by task, and put the sequences back in the
    batch's order: rows of a task share a route, so every grouped layer's segments are runs of the batch's own order
    and no layer gathers its rows (`grouped_route`). Only for a plain tensor output and no argument that could see the
    order (`_ORDER_DEPENDENT`); else, or already sorted, as it is. `host_task_ids`: the rows' tasks on the host (None:
    not known there, not sorted); `generation_config`: the one the call runs with (its output flags count too)."""
    batch = input_ids.shape[0]
    if host_task_ids is None or any(kwargs.get(name) or getattr(generation_config, name, None)
                                    for name in _ORDER_DEPENDENT):
        return generate(input_ids=input_ids, **kwargs)
    order = sorted(range(batch), key=host_task_ids.__getitem__)
    if order == list(range(batch)):
        return generate(input_ids=input_ids, **kwargs)
    index = torch.tensor(order, device=input_ids.device)
    kwargs = {k: v.index_select(0, index) if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == batch else v
              for k, v in kwargs.items()}
    out = generate(input_ids=input_ids.index_select(0, index), **kwargs)
    inverse = inverse_permutation(index)
    return out.view(batch, -1, out.shape[-1]).index_select(0, inverse).view(out.shape)
