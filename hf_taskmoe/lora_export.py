"""Export a task-routed model as one dense base model plus one peft LoRA adapter per task.

A task-routed model (`TaskRoutedForCausalLM`, `TaskRoutedForSeq2SeqLM`, `BartTaskRouted`) under hard routes computes,
for each task, a plain dense model: `export_task(task)` builds it. Serving engines (vLLM, SGLang, LoRAX, TGI) and peft
itself batch requests for *different LoRA adapters on one base model*; `export_task_adapters` (or the models' method
`model.export_task_adapters(path)`) writes the routed model in that form:

    path/base/          the dense model (`save_pretrained`), one choice of shared weights at each routed layer
    path/<task>/        peft LoRA adapter of the task (`PeftModel.save_pretrained`): adapter_config.json + safetensors
    path/hf_taskmoe_adapters.json   what was exported: routes, base choice, rank, what was folded, carried or dropped

Each adapter holds, for every routed layer and every linear in it (GPT-2's `Conv1D` included, `fan_in_fan_out`), the
truncated SVD of `W_task - W_base` at `rank` (`lora_alpha = rank`: the LoRA scale is 1): the exact float64 SVD, or on
a GPU (`svd="auto"`) a float64 subspace iteration batched over the matrices of one shape (`hf_taskmoe.low_rank_svd`).
What LoRA weights cannot carry is handled as follows:

* a norm whose weight differs from the base's is *folded* into the linears it feeds, as the architecture's declaration
  names them (`Backbone.norm_consumers`; pre-norm layers: Llama's `input_layernorm` feeds q/k/v, GPT-2's `ln_1` feeds
  `c_attn`, ...; a norm scaling by `offset + w`, Gemma's, folds `offset + w`): the task's layer computes
  `W_t (w_t * x_hat + b_t) + c_t`, which equals `W'(w_b * x_hat + b_b) + c'` with `W' = W_t diag(w_t / w_b)` and
  `c' = c_t + W_t b_t - W' b_b`, so the base's norm serves every task and the difference moves into the adapter
  (exact; not possible where a base norm weight is 0, nor for post-norm layers, whose norm feeds the residual stream);
* a linear's bias that differs (or a bias folded in from a norm) goes in peft's `lora_bias` (a bias on LoRA's B,
  loaded by peft and applied per row in mixed batches; check that a serving engine loads it) -- or is dropped with
  `carry_biases=False`;
* anything else that differs (a post-norm layer's norms -- BART's, which normalise after the residual, so their
  output feeds the residual stream as well as the next linears --, T5's relative-position table of a routed first
  block, a norm that cannot be folded) has no place in what peft runs in mixed batches (peft's `modules_to_save`
  wrapper mixes batches only for linear, embedding and convolution modules; T5's table is looked up by position
  bucket, not by row): it is *dropped*, the base's value serves the task, and its relative size
  `||delta|| / ||W_task||` is recorded in the manifest and returned. `lossless=True` refuses such an export before
  writing anything, saying what and why.

Folding and the bias carried make the export exact at full rank for every architecture whose declaration names its
norms' consumers (Llama, Qwen2, Mistral, GPT-2, Gemma, ...; T5 but for a routed relative-position table; BART and
OLMo 2 but for norms that differ per expert): the only error left is the rank's truncation.

The base (`base=`): `"mean"` (default) takes at each routed layer the mean of the exported tasks' routed weights
(each task once; an expert no exported task takes does not count): the point nearest all of them in the Frobenius
norm: the sum of the squared deltas the adapters carry is the smallest, so truncation tends to lose less.
`"majority"` takes the expert the most exported tasks use (ties: the lowest index): every task on it is exact there
with a zero adapter and the base is a model some tasks run exactly (a request with no adapter gets a real route), but
a task off it carries the whole difference between two experts. `"expert0"` takes expert 0 (upcycling gives it no
special role). A dense model of the same architecture (the checkpoint `from_dense` forked) gives the routed layers
(all other weights are the routed model's, what every task runs). At full rank every choice is exact; below it, on
the tiny trained checkpoint of `benchmarks/lora_export.py`, `"mean"` agreed with the routed model's greedy tokens
on 76% / 91% at ranks 8 / 16 where `"majority"` did on 52% / 84% (docs/serving-adapters.md).
"""

from __future__ import annotations

import copy
import fnmatch
import json
import os
import shutil
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from .layers.low_rank import LowRankExperts
from .low_rank_svd import SVD_METHODS, truncated_svds

__all__ = ["AdapterExport", "BASES", "export_task_adapters", "routed_layer_experts"]

#: the base choices `export_task_adapters(base=...)` takes by name
BASES = ("mean", "majority", "expert0")
MANIFEST = "hf_taskmoe_adapters.json"
BASE_FOLDER = "base"


# --------------------------------------------------------------------------------------------- the model's internals
def routed_layer_experts(model) -> list[tuple[str, int, list[nn.Module]]]:
    """`(name, route index, experts)` of each routed layer: its module name in `model.export_task(...)`'s dense model
    (`"model.layers.3"`), its index on the router's layer axis (`model.hard_route(task)[index]` is the task's expert
    there), and its experts (modules of the dense layer's class, in expert order).

    The only place this module reads the routed model's internals (`_layer_stacks`, a routed layer's `route_index` and
    `experts`)."""
    stacks = getattr(model, "_layer_stacks", None)
    if stacks is None or not callable(getattr(model, "export_task", None)) or not callable(
        getattr(model, "hard_route", None)
    ):
        raise TypeError(
            f"export_task_adapters takes a task-routed model with hard routes (TaskRoutedForCausalLM, "
            f"TaskRoutedForSeq2SeqLM, BartTaskRouted), got {type(model).__name__}."
        )
    found = []
    for prefix, layers in stacks().items():
        for i, layer in enumerate(layers):
            if layer.route_index is not None:
                found.append((f"{prefix}{i}", int(layer.route_index), list(layer.experts)))
    return found


# --------------------------------------------------------------------------------------------- the declared norms
def _norm_consumers(backbone, name: str, layer: nn.Module) -> dict[str, tuple[str, ...]]:
    """The norms of `layer` (named `name` in the dense model) that can be folded, and the linears each feeds: the
    declaration's (`Backbone.norm_consumers`, an encoder-decoder's decoder layers' `decoder_norm_consumers`), each
    pattern matching at least one linear of the layer (else the norm is not folded: a variant of the layer without
    those linears). Empty for a post-norm layer, whose norms feed the residual stream."""
    if backbone.post_norm:
        return {}
    decoder = backbone.decoder_layers is not None and f".{backbone.decoder_layers}." in f".{name}."
    modules = dict(layer.named_modules())
    linears = [n for n, m in modules.items() if _is_linear(m)]
    found = {}
    for norm, patterns in backbone.layer_norm_consumers(decoder).items():
        matched = [[n for n in linears if fnmatch.fnmatchcase(n, p)] for p in patterns]
        if getattr(modules.get(norm), "weight", None) is not None and all(matched):
            found[norm] = tuple(n for names in matched for n in names)
    return found


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, Conv1D))


def _matrix(module: nn.Module) -> torch.Tensor:
    """A linear's weight as `(out, in)` float64 (GPT-2's `Conv1D` stores `(in, out)`)."""
    weight = module.weight.detach().double()
    return weight.t() if isinstance(module, Conv1D) else weight


def _bias(module: nn.Module, out: int) -> torch.Tensor:
    bias = getattr(module, "bias", None)
    if bias is None:
        return torch.zeros(out, dtype=torch.float64, device=module.weight.device)
    return bias.detach().double()


# --------------------------------------------------------------------------------------------- the result
@dataclass
class AdapterExport:
    """What `export_task_adapters` wrote (also in `path/hf_taskmoe_adapters.json`).

    `dropped`: per task, `{parameter name: ||task - base|| / ||task||}` of what the export could not carry (the base's
    value serves the task there); empty for every task means the export is exact up to the rank. `weight_error`: per
    task, the largest relative truncation error `||delta - B A|| / ||W_task||` over its linears (0 at full rank).
    `svd`: how the truncated decompositions were computed (`"exact"`: float64 SVDs; `"auto"` / `"subspace"`: the
    subspace iteration where the rank is below a matrix's own, `export_task_adapters(svd=...)`); `svd_iterations`:
    per task, the most iterations one of its batches took (0: none iterated).
    `folded`: per task, the norms folded into the linears they feed. `lora_bias`: the tasks whose adapter carries
    biases (peft's `lora_bias`)."""

    path: str
    base: str
    rank: int
    requested_rank: int | str
    tasks: list[str]
    routes: dict[str, list[int]]
    base_experts: dict[str, int | None]
    target_modules: list[str]
    folded: dict[str, list[str]] = field(default_factory=dict)
    lora_bias: list[str] = field(default_factory=list)
    dropped: dict[str, dict[str, float]] = field(default_factory=dict)
    weight_error: dict[str, float] = field(default_factory=dict)
    force_argmax: bool = False
    svd: str = "exact"
    svd_iterations: dict[str, int] = field(default_factory=dict)
    #: how the adapters were made: `"svd"` (the truncated differences of whole experts) or `"low_rank_experts"` (a
    #: model with `expert_rank`: each adapter is its route's deltas, copied: no SVD, nothing lost)
    method: str = "svd"

    @property
    def exact(self) -> bool:
        """Nothing dropped for any task: the export is exact up to the rank."""
        return not any(self.dropped.values())

    def adapter_path(self, task: str) -> str:
        return os.path.join(self.path, task)

    @property
    def base_path(self) -> str:
        return os.path.join(self.path, BASE_FOLDER)


# --------------------------------------------------------------------------------------------- checks
def _check_rank(rank) -> int | str:
    if rank == "full":
        return rank
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"`rank` must be a positive int or 'full', got {rank!r}.")
    return rank


def _check_tasks(model, tasks) -> list[str]:
    names = list(model.config.task_names)
    if tasks is None:
        tasks = names
    if isinstance(tasks, str) or not list(tasks):
        raise ValueError(f"`tasks` must be a non-empty list of task names (of {names}), got {tasks!r}.")
    tasks = list(tasks)
    unknown = [t for t in tasks if t not in names]
    if unknown:
        raise ValueError(f"Unknown task(s) {unknown}; the model's tasks are {names}.")
    if len(set(tasks)) != len(tasks):
        raise ValueError(f"`tasks` names a task twice: {tasks}.")
    for reserved in (BASE_FOLDER, "default"):
        if reserved in tasks:
            raise ValueError(
                f"A task named {reserved!r} cannot be exported as an adapter folder: "
                + ("the base model is written to path/base." if reserved == BASE_FOLDER else
                   "peft saves an adapter named 'default' at the folder's root, not in path/default.")
            )
    return tasks


def _check_path(path, overwrite: bool, clear: bool = False) -> Path:
    """Refuse a file or (without `overwrite`) a non-empty folder; `clear`: empty the folder (after every check)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"`path` {str(path)!r} exists and is not a folder.")
    if path.is_dir() and any(path.iterdir()):
        if not overwrite:
            raise ValueError(f"`path` {str(path)!r} exists and is not empty; pass overwrite=True to replace it.")
        if clear:
            shutil.rmtree(path)
    return path


def _target_modules(model: nn.Module, linears: list[str]) -> list[str]:
    """The linears' own names (`q_proj`, ...: what engines expect) when peft's suffix matching finds exactly these
    linears by them (every layer routed); else their full names."""
    leaves = sorted({n.rsplit(".", 1)[-1] for n in linears})
    matched = {n for n, _ in model.named_modules() if n and n.rsplit(".", 1)[-1] in leaves}
    return leaves if matched == set(linears) else list(linears)


def _routes(model, tasks: list[str], force_argmax: bool) -> dict[str, list[int]]:
    routes = {}
    for task in tasks:
        try:
            routes[task] = model.hard_route(task, force_argmax=False)
        except ValueError:
            if not force_argmax:
                raise ValueError(
                    f"Task {task!r} has a soft route (selection {model.config.selection!r}): each routed layer mixes "
                    "its experts per input, which neither one dense base nor a LoRA adapter holds. Export a hard "
                    "route: train with selection='gumbel_softmax_st' or 'hard', or pass force_argmax=True to export "
                    "the arg-max experts (the adapters then differ from the routed model's outputs)."
                ) from None
            routes[task] = model.hard_route(task, force_argmax=True)
    return routes


# --------------------------------------------------------------------------------------------- base
def _mean_state(modules: list[nn.Module]) -> dict[str, torch.Tensor]:
    states = [m.state_dict() for m in modules]
    return {
        k: (torch.stack([s[k].double() for s in states]).mean(0).to(v.dtype) if v.is_floating_point() else v)
        for k, v in states[0].items()
    }


def _build_base(model, tasks, routes, layers, base, force_argmax) -> tuple[PreTrainedModel, str, dict]:
    """The dense model of the first task's export with each routed layer replaced by the base choice."""
    dense = model.export_task(tasks[0], force_argmax=force_argmax)
    chosen: dict[str, int | None] = {}
    if isinstance(base, PreTrainedModel):
        source, label = base, f"dense:{getattr(base.config, 'name_or_path', '') or type(base).__name__}"
        if type(source) is not type(dense):
            raise ValueError(f"A dense base must be a {type(dense).__name__} (the routed model's dense class), got "
                             f"{type(source).__name__}.")
    elif base in BASES:
        source, label = None, base
    else:
        raise ValueError(f"`base` must be one of {BASES} or a dense model of the routed model's class, got {base!r}.")
    with torch.no_grad():
        for name, index, experts in layers:
            target = dense.get_submodule(name)
            if source is not None:
                state, chosen[name] = source.get_submodule(name).state_dict(), None
            elif label == "mean":
                state, chosen[name] = _mean_state([experts[routes[t][index]] for t in tasks]), None
            else:
                counts = [sum(routes[t][index] == j for t in tasks) for j in range(len(experts))]
                j = 0 if label == "expert0" else max(range(len(experts)), key=lambda e: (counts[e], -e))
                state, chosen[name] = experts[j].state_dict(), j
            try:
                target.load_state_dict(state, strict=True)
            except RuntimeError as error:
                raise ValueError(f"The base's layer {name} does not fit the routed model's: {error}") from None
    config = dense.config
    if hasattr(config, "hf_taskmoe_task"):
        delattr(config, "hf_taskmoe_task")
    config.hf_taskmoe_adapter_base = label
    return dense, label, chosen


# --------------------------------------------------------------------------------------------- deltas
@dataclass
class _LayerDelta:
    weights: dict[str, torch.Tensor]  # linear name -> (out, in) delta, float64
    biases: dict[str, torch.Tensor]  # linear name -> (out,) delta (only the nonzero ones)
    norms: dict[str, torch.Tensor]  # linear name -> the task's (out, in) weight, for relative errors
    folded: list[str]
    dropped: dict[str, float]


def _relative(delta: torch.Tensor, reference: torch.Tensor) -> float:
    scale = float(reference.double().norm())
    return float(delta.double().norm()) / (scale if scale > 0 else 1.0)


def _layer_delta(backbone, name: str, base_layer: nn.Module, task_layer: nn.Module,
                 carry_biases: bool) -> _LayerDelta:
    """What the task's layer differs by from the base's, in the form an adapter carries."""
    linears = {n: m for n, m in task_layer.named_modules() if _is_linear(m)}
    base_modules = dict(base_layer.named_modules())
    weights = {n: _matrix(m) for n, m in linears.items()}
    biases = {n: _bias(m, w.shape[0]) for (n, m), w in zip(linears.items(), weights.values())}
    handled: set[str] = {f"{n}.weight" for n in linears} | {f"{n}.bias" for n in linears}
    folded, dropped = [], {}
    offset = backbone.norm_weight_offset  # the norm scales by `offset + weight` (Gemma: 1)
    for norm, feeds in _norm_consumers(backbone, name, task_layer).items():
        t_norm, b_norm = task_layer.get_submodule(norm), base_modules[norm]
        w_t, w_b = t_norm.weight.detach().double() + offset, b_norm.weight.detach().double() + offset
        nb_t = getattr(t_norm, "bias", None)
        nb_b = getattr(b_norm, "bias", None)
        nb_t = nb_t.detach().double() if nb_t is not None else None
        nb_b = nb_b.detach().double() if nb_b is not None else None
        same = torch.equal(w_t, w_b) and (nb_t is None or torch.equal(nb_t, nb_b))
        handled |= {f"{norm}.weight", f"{norm}.bias"}
        if same:
            continue
        if bool((w_b == 0).any()):
            dropped[f"{name}.{norm}"] = _relative(
                torch.cat([w_t - w_b] + ([nb_t - nb_b] if nb_t is not None else [])),
                torch.cat([w_t] + ([nb_t] if nb_t is not None else [])),
            )
            continue  # a zero in the base's norm weight loses the direction: nothing to fold through
        ratio = w_t / w_b
        for lin in feeds:
            w_task = weights[lin]
            folded_w = w_task * ratio[None, :]
            if nb_t is not None:  # c' = c_t + W_t b_t - W' b_b
                biases[lin] = biases[lin] + w_task @ nb_t - folded_w @ nb_b
            weights[lin] = folded_w
        folded.append(f"{name}.{norm}")
    out_weights, out_biases, refs = {}, {}, {}
    for n in linears:
        base_mod = base_modules[n]
        out_weights[n] = weights[n] - _matrix(base_mod)
        refs[n] = weights[n]
        bias_delta = biases[n] - _bias(base_mod, weights[n].shape[0])
        if bool((bias_delta != 0).any()):
            if carry_biases:  # a linear without a bias gets one through lora_bias too (a folded norm bias)
                out_biases[n] = bias_delta
            else:
                dropped[f"{name}.{n}.bias"] = _relative(bias_delta, biases[n])
    # anything else in the layer that differs: dropped
    base_params = dict(base_layer.named_parameters())
    for pname, param in task_layer.named_parameters():
        if pname in handled:
            continue
        other = base_params[pname]
        if not torch.equal(param, other):
            dropped[f"{name}.{pname}"] = _relative(param.detach() - other.detach(), param.detach())
    return _LayerDelta(out_weights, out_biases, refs, folded, dropped)


def _task_deltas(backbone, layers, base_model, route, carry_biases) -> list[tuple[str, _LayerDelta]]:
    """Each routed layer's delta for a task whose route is `route`: the task's layer is the expert the route takes
    there (the layer `export_task` loads into its dense model)."""
    return [
        (name, _layer_delta(backbone, name, base_model.get_submodule(name), experts[route[index]], carry_biases))
        for name, index, experts in layers
    ]


def _check_outside_layers(base_model, dense, layers, task) -> None:
    """Every weight outside the routed layers is the routed model's own, the same for every task."""
    prefixes = tuple(f"{name}." for name, _, _ in layers)
    base_state = base_model.state_dict()
    for key, value in dense.state_dict().items():
        if not key.startswith(prefixes) and not torch.equal(value, base_state[key]):
            raise RuntimeError(f"Task {task!r}'s export differs from the base outside the routed layers at {key}.")


# --------------------------------------------------------------------------------------------- export
def _check_flags(svd: str, **flags) -> None:
    """`export_task_adapters`' bool flags and `svd` method, refused with the argument's name."""
    for flag, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"`{flag}` must be a bool, got {value!r}.")
    if svd not in SVD_METHODS:
        raise ValueError(f"`svd` must be one of {SVD_METHODS}, got {svd!r}.")


def _survey_tasks(backbone, layers, base_model, routes, tasks, carry_biases) -> tuple[dict, dict, list[str]]:
    """Pass 1 of `export_task_adapters`: per task, what its export drops and folds, and the tasks whose adapters
    carry bias differences (nothing is written)."""
    dropped, folded, biased = {}, {}, []
    for task in tasks:
        deltas = _task_deltas(backbone, layers, base_model, routes[task], carry_biases)
        dropped[task] = {k: v for _, d in deltas for k, v in d.dropped.items()}
        folded[task] = [f for _, d in deltas for f in d.folded]
        if any(d.biases for _, d in deltas):
            biased.append(task)
        del deltas
    return dropped, folded, biased


def _refuse_lossy(dropped: dict, carry_biases: bool, post_norm: bool) -> None:
    """`lossless=True` with something dropped: the one paragraph naming what and why."""
    what = sorted({k for d in dropped.values() for k in d})
    raise ValueError(
        f"lossless=True: this export cannot carry {len(what)} differing parameter(s) "
        f"(e.g. {what[:4]}): peft runs mixed-adapter batches only through LoRA on linear layers"
        + (" and these are not linears, norms foldable into the next linears, or biases of linears"
           if carry_biases else ", and carry_biases=False drops bias differences")
        + (" (a post-norm layer's norm feeds the residual stream: it cannot be folded)" if post_norm else "")
        + ". Train with these parts shared across experts, or export with lossless=False and read the cost in "
        "the returned `dropped`."
    )


def _write_base(path: Path, base_model, tokenizer) -> None:
    """The dense base (and the tokenizer, when given) under `path/base`."""
    path.mkdir(parents=True, exist_ok=True)
    base_dir = path / BASE_FOLDER
    base_model.save_pretrained(base_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(base_dir)


def _write_task_adapter(work, config, task: str, deltas, flat, factors, path: Path):
    """Inject `task`'s LoRA into `work` with peft, copy its factors (and bias differences) in, save the adapter under
    `path/<task>`; returns the peft model (to unload) and the worst relative weight error."""
    from peft import get_peft_model

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*lora_bias=True.*")  # a linear without a bias: merge-only
        peft_model = get_peft_model(work, config, adapter_name=task)
    worst = 0.0
    layer_deltas = dict(deltas)
    with torch.no_grad():
        for (name, n, _), (a, b, error) in zip(flat, factors):
            delta = layer_deltas[name]
            lora = peft_model.base_model.model.get_submodule(f"{name}.{n}")
            lora.lora_A[task].weight.copy_(a.to(lora.lora_A[task].weight.dtype))
            lora.lora_B[task].weight.copy_(b.to(lora.lora_B[task].weight.dtype))
            if lora.lora_B[task].bias is not None:
                bias = delta.biases.get(n)
                lora.lora_B[task].bias.copy_(bias.to(lora.lora_B[task].bias.dtype) if bias is not None
                                             else torch.zeros_like(lora.lora_B[task].bias))
            worst = max(worst, error / max(float(delta.norms[n].norm()), 1e-30))
    with warnings.catch_warnings():  # peft 0.21 takes lora_B's 1-D bias for an unsharded ZeRO-3 tensor
        warnings.filterwarnings("ignore", message=r".*LoRA tensor\(s\) have invalid shape.*")
        peft_model.save_pretrained(str(path), selected_adapters=[task])
    return peft_model, worst


def _write_adapters(base_model, backbone, layers, routes, tasks, linears, targets, biased, carry_biases, r: int,
                    method: str, path: Path) -> tuple[dict[str, float], dict]:
    """Pass 2 of `export_task_adapters`: per task, its deltas truncated to rank `r` and written as a peft LoRA
    adapter; returns each task's worst relative weight error and its SVD iterations."""
    from peft import LoraConfig

    conv = any(isinstance(base_model.get_submodule(n), Conv1D) for n in linears)
    task_type = "SEQ_2_SEQ_LM" if base_model.config.is_encoder_decoder else "CAUSAL_LM"
    work = copy.deepcopy(base_model)  # peft injects its layers into this copy; the saved base stays plain
    errors, iterations = {}, {}
    for task in tasks:
        deltas = _task_deltas(backbone, layers, base_model, routes[task], carry_biases)
        flat = [(name, n, d) for name, delta in deltas for n, d in delta.weights.items()]
        factors, iterations[task] = truncated_svds([d for _, _, d in flat], r, method)  # batched by shape
        config = LoraConfig(
            r=r, lora_alpha=r, lora_dropout=0.0, target_modules=targets, fan_in_fan_out=conv,
            lora_bias=task in biased, task_type=task_type, bias="none",
        )
        peft_model, errors[task] = _write_task_adapter(work, config, task, deltas, flat, factors, path)
        del deltas, flat, factors
        work = peft_model.unload()
    del work
    return errors, iterations


def export_task_adapters(
    model,
    path: str | os.PathLike,
    rank: int | str = "full",
    tasks: list[str] | None = None,
    lossless: bool = False,
    base: str | PreTrainedModel = "mean",
    *,
    force_argmax: bool = False,
    carry_biases: bool = True,
    overwrite: bool = False,
    tokenizer=None,
    svd: str = "auto",
) -> AdapterExport:
    """Write a task-routed model as one dense base (`path/base`) plus one peft LoRA adapter per task (`path/<task>`);
    see the module's docstring for the layout and for what is folded, carried and dropped.

    Args:
        model: a task-routed model (`TaskRoutedForCausalLM`, `TaskRoutedForSeq2SeqLM`, `BartTaskRouted`) whose
            exported tasks have hard routes (`selection="gumbel_softmax_st"` or `"hard"`).
        path: an empty (or missing) folder; `overwrite=True` replaces a non-empty one.
        rank: the LoRA rank, or `"full"`: the largest `min(out, in)` of the routed linears (exact). A rank above it
            is capped there; every linear's factors are padded with zeros to the one rank (one `r` per adapter, as
            serving engines take).
        tasks: the tasks to export (default: all).
        lossless: refuse (before writing anything) an export that would drop something (a norm of a post-norm layer
            such as BART's, a relative-position table, a bias with `carry_biases=False`): the result is then exact up
            to the rank.
        base: `"mean"` (default), `"majority"`, `"expert0"` or a dense model of the routed model's class (the module
            says which when).
        force_argmax: export the arg-max experts of a soft route (refused otherwise).
        carry_biases: carry bias differences in peft's `lora_bias` (peft loads it; engines may not); False drops them.
        tokenizer: saved with the base when given.
        svd: how each `W_task - W_base` is truncated. `"auto"` (default): on an accelerator (the model not on the
            CPU) and where the rank is well below a matrix's own (`rank + max(rank, 16) < min(out, in)`), a subspace
            iteration batched over the matrices of one shape (float64 matmuls on the model's device, converged to
            1e-7 of the reconstruction or stopped after 64 iterations); elsewhere, on the CPU, and for every matrix
            under `lossless=True`, the exact float64 SVD (cuSOLVER's took about a minute for Llama 16 x 1024's 448
            matrices on a GPU). `"exact"`: the float64 SVD everywhere; `"subspace"`: the iteration on any device.
            At full rank every path is exact. docs/serving-adapters.md gives the iteration's measured error.

    A model with low-rank experts (`expert_rank`) exports exactly, with no SVD (`_export_low_rank_experts`): the base
    is the dense (shared) weights and task `t`'s adapter, on every linear holding deltas, is its route's expert's
    `lora_A` / `lora_B` at rank `expert_rank` with `lora_alpha = expert_alpha`; `rank` may then be `"full"` or that
    rank, `base` and `svd` their defaults.

    Returns an `AdapterExport` (also written to `path/hf_taskmoe_adapters.json`)."""
    if getattr(getattr(model, "config", None), "low_rank", False):
        return _export_low_rank_experts(model, path, rank, tasks, base, force_argmax=force_argmax,
                                        overwrite=overwrite, tokenizer=tokenizer, svd=svd)
    layers = routed_layer_experts(model)
    requested = _check_rank(rank)
    tasks = _check_tasks(model, tasks)
    _check_flags(svd, lossless=lossless, force_argmax=force_argmax, carry_biases=carry_biases, overwrite=overwrite)
    method = "exact" if lossless else svd  # lossless: the optimal truncation, as the float64 SVD gives it
    if not layers:
        raise ValueError(f"{type(model).__name__} has no routed layer: export_task(task) gives its dense model.")
    path = _check_path(path, overwrite)  # refuses before any work
    routes = _routes(model, tasks, force_argmax)
    backbone = model.config.backbone
    post_norm = backbone.post_norm
    base_model, label, chosen = _build_base(model, tasks, routes, layers, base, force_argmax)
    linears = [f"{name}.{n}" for name, _, _ in layers for n, m in base_model.get_submodule(name).named_modules()
               if _is_linear(m)]
    full = max(min(base_model.get_submodule(n).weight.shape) for n in linears)
    r = full if requested == "full" else min(requested, full)

    # pass 1: what each task's export drops (refused under lossless before anything is written). Outside the routed
    # layers every task's export is the base (export_task maps the same weights for every route: checked once, on the
    # task export_task(tasks[-1]) builds); inside them the task's layer is the expert its route takes.
    if len(tasks) > 1:
        _check_outside_layers(base_model, model.export_task(tasks[-1], force_argmax=force_argmax), layers, tasks[-1])
    dropped, folded, biased = _survey_tasks(backbone, layers, base_model, routes, tasks, carry_biases)
    if lossless and any(dropped.values()):
        _refuse_lossy(dropped, carry_biases, post_norm)

    path = _check_path(path, overwrite, clear=True)
    _write_base(path, base_model, tokenizer)

    targets = _target_modules(base_model, linears)
    errors, iterations = _write_adapters(base_model, backbone, layers, routes, tasks, linears, targets, biased,
                                         carry_biases, r, method, path)

    result = AdapterExport(
        path=str(path), base=label, rank=r, requested_rank=requested, tasks=tasks, routes=routes,
        base_experts=chosen, target_modules=targets, folded=folded, lora_bias=biased, dropped=dropped,
        weight_error=errors, force_argmax=force_argmax, svd=method,
        svd_iterations=iterations,
    )
    (path / MANIFEST).write_text(json.dumps(asdict(result), indent=2) + "\n")
    (path / "README.md").write_text(_readme(result, type(base_model).__name__))  # in place of peft's model card
    return result


def _export_low_rank_experts(model, path, rank, tasks, base, *, force_argmax: bool, overwrite: bool, tokenizer,
                             svd: str) -> AdapterExport:
    """`export_task_adapters` of a model with low-rank experts: the dense base, and per task its route's deltas as a
    peft LoRA adapter (built with peft's `get_peft_model` and `LoraConfig`, the factors copied into its
    `lora_A.<task>` / `lora_B.<task>`, written by its `save_pretrained`): exact."""
    from peft import LoraConfig, get_peft_model

    config = model.config
    r = config.expert_rank
    if rank not in ("full", r):
        raise ValueError(
            f"`rank` must be 'full' or {r} (the model's `expert_rank`) for a model with low-rank experts, whose "
            f"adapters are its deltas as they are, got {rank!r}."
        )
    if not (isinstance(base, str) and base == "mean") or svd != "auto":
        raise ValueError(
            "`base` and `svd` choose how whole experts are turned into adapters; a model with low-rank experts exports "
            f"its dense weights as the base and its deltas as the adapters: leave them unset, got base={base!r}, "
            f"svd={svd!r}."
        )
    for flag, value in (("force_argmax", force_argmax), ("overwrite", overwrite)):
        if not isinstance(value, bool):
            raise ValueError(f"`{flag}` must be a bool, got {value!r}.")
    tasks = _check_tasks(model, tasks)
    layers = routed_layer_experts(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no routed layer: export_task(task) gives its dense model.")
    path = _check_path(path, overwrite)
    routes = _routes(model, tasks, force_argmax)
    # each wrapped linear: (its name in the dense model, the router's layer index, the module holding the deltas)
    wrapped = [(f"{name}.{n}", index, m) for name, index, experts in layers
               for n, m in experts[0].named_modules() if isinstance(m, LowRankExperts)]
    base_model = model._dense_export(None, None)  # the dense weights, no delta merged
    path = _check_path(path, overwrite, clear=True)
    path.mkdir(parents=True, exist_ok=True)
    base_model.save_pretrained(path / BASE_FOLDER)
    if tokenizer is not None:
        tokenizer.save_pretrained(path / BASE_FOLDER)
    targets = [name for name, _, _ in wrapped]
    conv = any(m.fan_in_fan_out for _, _, m in wrapped)
    task_type = "SEQ_2_SEQ_LM" if base_model.config.is_encoder_decoder else "CAUSAL_LM"
    work = copy.deepcopy(base_model)  # peft injects its layers into this copy; the saved base stays plain
    for task in tasks:
        lora_config = LoraConfig(r=r, lora_alpha=config.lora_alpha, lora_dropout=config.expert_dropout,
                                 target_modules=targets, fan_in_fan_out=conv, task_type=task_type, bias="none")
        peft_model = get_peft_model(work, lora_config, adapter_name=task)
        with torch.no_grad():
            for name, index, module in wrapped:
                expert = routes[task][index]
                lora = peft_model.base_model.model.get_submodule(name)
                lora.lora_A[task].weight.copy_(module.lora_A[expert])  # (r, in)
                lora.lora_B[task].weight.copy_(module.lora_B[expert])  # (out, r)
        peft_model.save_pretrained(str(path), selected_adapters=[task])
        work = peft_model.unload()
    del work
    result = AdapterExport(
        path=str(path), base="dense", rank=r, requested_rank=rank, tasks=tasks, routes=routes,
        base_experts={}, target_modules=targets, force_argmax=force_argmax, svd="none",
        method="low_rank_experts",
    )
    manifest = {**asdict(result), "exact": True, "lora_alpha": config.lora_alpha}
    (path / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    (path / "README.md").write_text(_readme(result, type(base_model).__name__))
    return result


def _readme(result: AdapterExport, dense_class: str) -> str:
    first, rest = result.tasks[0], result.tasks[1:]
    loads = "".join(f'model.load_adapter("{t}", adapter_name="{t}")\n' for t in rest)
    exact = "exact up to the rank" if result.exact else "approximate beyond the rank: see `dropped`"
    if result.method == "low_rank_experts":
        exact = "exact: each adapter is its route's low-rank experts, copied (no SVD)"
    alpha = "`lora_alpha` = rank" if result.method == "svd" else "`lora_alpha` = the model's `expert_alpha`"
    return (
        f"# Task adapters (hf_taskmoe.export_task_adapters)\n\n"
        f"`base/`: a {dense_class} (base choice `{result.base}`); one peft LoRA adapter per task "
        f"({', '.join(result.tasks)}), rank {result.rank}, "
        f"{alpha}; "
        f"{exact}. "
        f"`{MANIFEST}` lists each task's route, what was folded, carried (`lora_bias`) or dropped.\n\n"
        "```python\n"
        "from peft import PeftModel\n"
        "from transformers import AutoModelForCausalLM  # AutoModelForSeq2SeqLM for an encoder-decoder\n\n"
        'base = AutoModelForCausalLM.from_pretrained("base")\n'
        f'model = PeftModel.from_pretrained(base, "{first}", adapter_name="{first}")\n'
        f"{loads}"
        "# a mixed batch: one adapter name per row\n"
        f'out = model.generate(input_ids=ids, attention_mask=mask, adapter_names=["{first}", ...])\n'
        "```\n"
    )
