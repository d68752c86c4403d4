"""Sharded training (FSDP2, DeepSpeed ZeRO-3): what a family shards as one unit, derived from its declarations.

FSDP2 (`fully_shard`) all-gathers a unit's parameters before the unit runs and reduce-scatters its gradients after,
so a unit must run on every rank in every step. The units here are the transformer blocks: the layers of the
backbone a family declares (`config.backbone.layers`, `hf_taskmoe.backbones`). A task-routed layer is one unit with its
experts (whole copies of the block): a unit per expert would be gathered only on the ranks whose rows use that expert,
which hangs the other ranks wherever experts are skipped (`BartTaskRouted` with hard routes, `generate` under a hard
route). With low-rank experts (`expert_rank`) the unit holds the frozen dense weights and the trainable deltas
together: FSDP2 shards each parameter apart, so that needs nothing more (tests/test_distributed.py). A family
without a backbone declaration falls back to its own `_no_split_modules` (its layer classes), then to the dense
model's. accelerate's FSDP2 path takes these as class names (`transformer_cls_names_to_wrap`,
`fsdp_config["transformer_layer_cls_to_wrap"]`).

What may sit out a step -- an absent task's head, an expert no token chose -- is declared by the family
(`parameter_roles(...).possibly_idle`). Under FSDP2 those parameters live in units that do run (the root, a block), and
their missing gradients are reduce-scattered as zeros (`FSDPModule.set_reduce_scatter_unused_params`).

DeepSpeed ZeRO-3 gathers every submodule's parameters when that submodule is called and reduces each parameter's
gradient when it arrives, so a module that runs on one rank and not on the other desynchronises the collectives. A
task-routed LM has no such module in training (every expert of a routed layer runs on every row; the task embedding
is one lookup for the whole batch), and ZeRO-3 trains it as it is. The encoder families' task heads do sit out (a
head runs on its task's rows, and a batch without that task has none): under ZeRO-3 `run_every_task` makes them run
in every forward, each on its rows -- none for an absent task --, in task order (`MultiTaskHeads.runs_every_task`),
so every rank calls the same modules in the same order and every head gets a gradient (zero for a task absent from
every rank's batch, as under DDP's static graph). ZeRO-2 needs it too (`prepare_sharding` applies it under every
DeepSpeed stage): it packs gradients into its buckets in the order they arrive, so ranks whose task mixes differ
(heads stacked on one rank, run alone on the other, touched with zero elsewhere) would sum one parameter's gradient
with another's. DeepSpeed's own
answer for modules that may sit out (a *leaf*, `deepspeed.utils.set_z3_leaf_modules`) is not used: its backward hooks
attach to the leaf's output, which must be tensors, and the heads return a `HeadsOutput`. A module that may sit out
and cannot run for every task (`zero3_idle_modules` less those with `runs_every_task`: PALs' per-task layers) is
refused under ZeRO-3 (`check_zero3`), naming it.
"""

from __future__ import annotations

import re

from torch import nn

from ..contract import UNDECLARED, parameter_roles_of

__all__ = [
    "fsdp_config",
    "transformer_block_classes",
    "transformer_blocks",
    "check_zero3",
    "run_every_task",
    "zero3_idle_modules",
]


def _declared_layer_lists(model: nn.Module) -> list[nn.ModuleList]:
    """The `ModuleList`s of transformer blocks the family's backbone declaration names (encoder and decoder)."""
    backbone = getattr(getattr(model, "config", None), "backbone", None)
    paths = [p for p in (getattr(backbone, "layers", None), getattr(backbone, "decoder_layers", None)) if p]
    return [module for path in paths for name, module in model.named_modules()
            if isinstance(module, nn.ModuleList) and (name == path or name.endswith("." + path))]


def _no_split_fallback(model: nn.Module) -> list[str]:
    """The family's own `_no_split_modules` (its layer classes: a routed layer keeps its experts whole), else those of
    the dense model it holds (a nested `PreTrainedModel`)."""
    from transformers import PreTrainedModel

    if getattr(model, "_no_split_modules", None):
        return list(model._no_split_modules)
    for name, module in model.named_modules():
        if name and isinstance(module, PreTrainedModel) and getattr(module, "_no_split_modules", None):
            return list(module._no_split_modules)
    return []


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards as one unit each: the entries of the declared backbone's layer lists (a task-routed
    layer whole, with its experts: it runs on every rank whichever experts its rows use), or every module whose class
    the fallback names. Empty when nothing is declared."""
    blocks = [block for layers in _declared_layer_lists(model) for block in layers]
    if blocks:
        return blocks
    names = set(_no_split_fallback(model))
    found = [(n, m) for n, m in model.named_modules() if n and type(m).__name__ in names]
    # the outermost only: a class named for a routed layer's experts (BART's layers) stays inside its routed layer
    return [m for n, m in found if not any(n.startswith(o + ".") for o, _ in found)]


def transformer_block_classes(model: nn.Module) -> list[str]:
    """Class names of `transformer_blocks(model)`, in model order, each once: what accelerate's FSDP2 auto-wrap takes
    (`FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=...)`, or the training arguments'
    `fsdp_config={"transformer_layer_cls_to_wrap": ...}`). accelerate finds a class by its name, so a name must mean
    one class in the model."""
    names = list(dict.fromkeys(type(m).__name__ for m in transformer_blocks(model)))
    for name in names:
        classes = {type(m) for m in model.modules() if type(m).__name__ == name}
        if len(classes) > 1:
            raise ValueError(f"Two classes are named {name!r} in {type(model).__name__}; FSDP wraps by class name.")
    return names


def fsdp_config(model: nn.Module, **overrides) -> dict:
    """`TrainingArguments(fsdp=True, fsdp_config=fsdp_config(model))`: FSDP2, one unit per transformer block
    of the family (`transformer_block_classes`), sharded checkpoints (each rank saves its shards: torch's distributed
    checkpoint). `overrides` replace or add keys (`cpu_offload`, `activation_checkpointing`, ...)."""
    return {
        "version": 2,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "transformer_layer_cls_to_wrap": transformer_block_classes(model),
        "state_dict_type": "SHARDED_STATE_DICT",
        "reshard_after_forward": True,
        **overrides,
    }


def _called(module: nn.Module) -> bool:
    """Whether the module has a forward of its own (a bare `ModuleList` / `ModuleDict` is never called)."""
    containers = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
    return type(module).forward is not nn.Module.forward and type(module) not in containers


def zero3_idle_modules(model: nn.Module) -> list[nn.Module]:
    """The modules that may not run in a training step on some rank, which ZeRO-3 would have to gather and reduce
    whole: for every parameter the family declares possibly idle (`parameter_roles(...).possibly_idle`) outside an
    embedding and outside a task-routed LM's routed layers (both run whole in every training step), the module its
    role's pattern names (`heads` for `^heads\\.`), or the nearest called module above it when that one is a plain
    container. Outermost first, no module inside another."""
    roles = parameter_roles_of(model)
    if roles is UNDECLARED:
        return []
    patterns = [re.compile(p) for p in roles.possibly_idle_patterns]
    modules = dict(model.named_modules())
    # what runs whenever the model does: an embedding (one lookup per batch, whichever rows it reads) and the experts
    # of a layer that runs every expert on every row in a training forward (`ContextRoutedLayer`, the task-routed LMs)
    always_run = [name for name, m in modules.items() if isinstance(m, nn.Embedding) or _every_expert_runs(m)]
    chosen: dict[str, nn.Module] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad or any(name.startswith(p + ".") for p in always_run):
            continue
        match = next((m for p in patterns if (m := p.search(name))), None)
        if match is None:
            continue
        # the module path the matched text ends in: `heads.a.w` matched by `^heads\.` -> `heads`
        path = name[: match.end()].rstrip(".")
        if path not in modules:  # the pattern ended inside a name: up to the last whole component
            path = path.rsplit(".", 1)[0] if "." in path else ""
        while path and not _called(modules[path]):
            path = path.rsplit(".", 1)[0] if "." in path else ""
        chosen[path] = modules[path]
    kept: list[str] = []
    for path in sorted(chosen, key=lambda p: (p.count("."), p)):
        if not any(path.startswith(k + ".") or k == "" for k in kept):
            kept.append(path)
    return [chosen[p] for p in sorted(kept, key=list(modules).index)]


def _every_expert_runs(module: nn.Module) -> bool:
    """A task-routed layer whose training forward runs every expert on every row (mixed by the route): the
    `ContextRoutedLayer` of the task-routed LMs (named, not imported: the class may move between modules)."""
    return any(c.__name__ == "ContextRoutedLayer" for c in type(module).__mro__)


def run_every_task(model: nn.Module) -> list[nn.Module]:
    """Make every module that may sit out a step and can run for every task (`zero3_idle_modules` with a
    `runs_every_task` flag: the task heads, PALs) run in every forward, so DeepSpeed gathers (ZeRO-3) and reduces
    (ZeRO-2 and 3: buckets packed in the order the gradients arrive) the same parameters in the same order on every
    rank; returns them. `MultiTaskTrainer` does it under DeepSpeed; call it before `deepspeed.initialize` in a loop
    of your own."""
    able = [m for m in zero3_idle_modules(model) if hasattr(m, "runs_every_task")]
    for module in able:
        module.runs_every_task = True
    return able


def check_zero3(model: nn.Module) -> None:
    """Refuse a model ZeRO-3 cannot train: one with modules that may sit out a step on some rank and do not run for
    every task (`zero3_idle_modules` less those with `runs_every_task` set). Their parameters would be gathered on the
    ranks that call them only, and their gradients reduced in buckets that differ between ranks; DeepSpeed's leaf
    modules, the way out for token-routed MoE layers, hook the leaf's output, which must be tensors."""
    idle = [m for m in zero3_idle_modules(model) if not getattr(m, "runs_every_task", False)]
    if not idle:
        return
    index = {id(m): n or "(the model itself)" for n, m in model.named_modules()}
    names = ", ".join(f"{index[id(m)]} ({type(m).__name__})" for m in idle)
    raise ValueError(
        f"DeepSpeed ZeRO-3 cannot train {type(model).__name__}: {names} may not run on every rank in a step (the "
        "modules of a task absent from a rank's batch), and ZeRO-3 gathers a module's shards only on the ranks that "
        "call it. Use FSDP2 (`fsdp=True, fsdp_config=hf_taskmoe.training.sharding.fsdp_config(model)`), which "
        "reduces zeros for what sat out, or ZeRO-2 (`deepspeed=examples/deepspeed/zero2.json`)."
    )


def prepare_sharding(model: nn.Module, args) -> None:
    """What `MultiTaskTrainer` does before accelerate wraps the model: FSDP with a transformer-based wrap and no class
    list gets the family's blocks (`transformer_block_classes`; accelerate would take the family's
    `_no_split_modules`, and BART's names its experts' classes too); under DeepSpeed the task heads (and PALs) run for
    every task (`run_every_task`): ZeRO-3 gathers the modules a rank calls, and ZeRO-2 packs gradients into its
    buckets in the order they arrive, so the ranks must run the same modules in the same order; under ZeRO-3 a family
    with other modules that may sit out a step is refused (`check_zero3`)."""
    plugin_args = getattr(args, "fsdp_plugin_args", None)
    if plugin_args is not None and plugin_args.get("fsdp_version", 1) == 2:
        policy = str(plugin_args.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP"))
        if policy == "TRANSFORMER_BASED_WRAP" and not plugin_args.get("transformer_cls_names_to_wrap"):
            classes = transformer_block_classes(model)
            if classes:
                plugin_args["transformer_cls_names_to_wrap"] = ",".join(classes)
    ds_config = getattr(args, "hf_deepspeed_config", None)
    if ds_config is not None:
        run_every_task(model)
        if ds_config.is_zero3():
            check_zero3(model)


def enable_fsdp_on_cpu(accelerator, args) -> bool:
    """FSDP2 on a multi-process CPU run (gloo), which accelerate would silently replace by DDP
    (`hf_taskmoe.compat.enable_fsdp_on_cpu`): what the 2-process CPU tests run. Returns whether it was turned on."""
    plugin_args = getattr(args, "fsdp_plugin_args", None)
    if plugin_args is None or getattr(accelerator.state, "fsdp_plugin", None) is not None:
        return False
    from accelerate.utils import FullyShardedDataParallelPlugin

    from ..compat import enable_fsdp_on_cpu as enable

    return enable(accelerator, FullyShardedDataParallelPlugin(**plugin_args))


def is_sharded(trainer, model: nn.Module) -> bool:
    """Whether the trainer's model is sharded (FSDP or DeepSpeed ZeRO-3): its parameters are shards between
    forwards, so nothing may touch them outside one."""
    if getattr(trainer, "is_fsdp_enabled", False):
        return True
    if getattr(trainer, "is_deepspeed_enabled", False):
        plugin = trainer.accelerator.state.deepspeed_plugin
        return plugin is not None and plugin.zero_stage == 3
    return False


def zero_unused_gradients_under_fsdp(model: nn.Module) -> None:
    """Under FSDP2: reduce-scatter a zero gradient for every parameter of a unit that got none on this rank (an
    absent task's head), so the ranks' collectives match (DDP's `find_unused_parameters` for FSDP2). Set once."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return
    if isinstance(model, FSDPModule) and not getattr(model, "_hf_taskmoe_unused_zeroed", False):
        if not hasattr(model, "set_reduce_scatter_unused_params"):
            raise RuntimeError(
                "This torch's FSDP2 cannot reduce-scatter zeros for parameters without a gradient "
                "(`FSDPModule.set_reduce_scatter_unused_params`, in torch 2.13): a task head idle on one rank would "
                "desynchronise the ranks. Upgrade torch, or train with DDP or ZeRO-2."
            )
        model.set_reduce_scatter_unused_params(True)
        model._hf_taskmoe_unused_zeroed = True
