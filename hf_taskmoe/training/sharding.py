"""Sharded training (FSDP2, DeepSpeed ZeRO-3): what a family shards as one unit, derived from its declarations.

FSDP2 (`fully_shard`) all-gathers a unit's parameters before the unit runs and reduce-scatters its gradients after,
so a unit must run on every rank in every step. The units here are the transformer blocks: the layers of the
backbone a family declares (`config.backbone.layers`, `hf_taskmoe.backbones`), and inside a task-routed layer each
expert (a whole copy of the block: every expert runs in a training forward). A family without a backbone
declaration falls back to the `_no_split_modules` of the dense model it holds, then to its own. accelerate's FSDP2
path takes these as class names (`transformer_cls_names_to_wrap`, `fsdp_config["transformer_layer_cls_to_wrap"]`).

What may sit out a step -- an absent task's head, an expert no token chose -- is declared by the family
(`parameter_roles(...).possibly_idle`). Under FSDP2 those parameters live in units that do run (the root, a block), and
their missing gradients are reduce-scattered as zeros (`set_reduce_scatter_unused_params`). Under ZeRO-3 every
submodule gathers its own parameters when it is called, so a module that runs on one rank and not on the other would
desynchronise the collectives: the nearest called module holding the idle parameters (the task heads, an MoE layer,
a routed layer) becomes a ZeRO-3 *leaf*, gathered whole and reduced whole with zeros for the parameters that got no
gradient (`deepspeed.utils.set_z3_leaf_modules`, DeepSpeed's own answer for token-routed MoE layers).
"""

from __future__ import annotations

import re

from torch import nn

from ..contract import UNDECLARED, parameter_roles_of

__all__ = [
    "fsdp_config",
    "transformer_block_classes",
    "transformer_blocks",
    "zero3_leaf_modules",
]


def _declared_layer_lists(model: nn.Module) -> list[nn.ModuleList]:
    """The `ModuleList`s of transformer blocks the family's backbone declaration names (encoder and decoder)."""
    backbone = getattr(getattr(model, "config", None), "backbone", None)
    paths = [p for p in (getattr(backbone, "layers", None), getattr(backbone, "decoder_layers", None)) if p]
    found = []
    for path in paths:
        for name, module in model.named_modules():
            if isinstance(module, nn.ModuleList) and (name == path or name.endswith("." + path)):
                found.append(module)
    return found


def _experts_of(block: nn.Module) -> list[nn.Module]:
    """A task-routed layer's expert copies of the block (`RoutedLayer.experts`); the block itself otherwise."""
    experts = getattr(block, "experts", None)
    if isinstance(experts, nn.ModuleList) and len(experts) and not isinstance(block, nn.ModuleList):
        inner = [e for e in experts if not isinstance(e, (nn.Linear, nn.Embedding))]
        if len(inner) == len(experts):
            return list(experts)
    return [block]


def _no_split_fallback(model: nn.Module) -> list[str]:
    """`_no_split_modules` of the dense model the family holds (a nested `PreTrainedModel`), else of the family."""
    from transformers import PreTrainedModel

    for name, module in model.named_modules():
        if name and isinstance(module, PreTrainedModel) and getattr(module, "_no_split_modules", None):
            return list(module._no_split_modules)
    return list(getattr(model, "_no_split_modules", None) or [])


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards as one unit each: the declared backbone's blocks (a routed layer's experts, each), or
    every module whose class the fallback names. Empty when nothing is declared."""
    blocks = [expert for layers in _declared_layer_lists(model) for block in layers for expert in _experts_of(block)]
    if blocks:
        return blocks
    names = set(_no_split_fallback(model))
    return [m for m in model.modules() if type(m).__name__ in names and m is not model]


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


def zero3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules ZeRO-3 must gather and reduce whole: for every parameter the family declares possibly idle
    (`parameter_roles(...).possibly_idle`), the module its role's pattern names (`heads` for `^heads\\.`, a layer's
    `mlp.experts`), or the nearest called module above it when that one is a plain container. Outermost first, no
    module inside another. Raises when a possibly idle parameter would make the whole model one leaf (nothing would
    be sharded during the forward)."""
    roles = parameter_roles_of(model)
    if roles is UNDECLARED:
        return []
    patterns = [re.compile(p) for p in roles.possibly_idle_patterns]
    modules = dict(model.named_modules())
    chosen: dict[str, nn.Module] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
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
        if not path:
            raise ValueError(
                f"{type(model).__name__}: the possibly idle parameter {name} sits in no module below the model that "
                "is called on every rank; ZeRO-3 cannot shard its forward. Use ZeRO-2 or FSDP2."
            )
        chosen[path] = modules[path]
    outer = sorted(chosen, key=lambda p: (p.count("."), p))
    kept: list[str] = []
    for path in outer:
        if not any(path.startswith(k + ".") for k in kept):
            kept.append(path)
    return [chosen[p] for p in sorted(kept, key=list(modules).index)]


def mark_zero3_leaves(model: nn.Module) -> list[str]:
    """Flag `zero3_leaf_modules(model)` as ZeRO-3 leaves (before DeepSpeed wraps the model); their names."""
    from deepspeed.utils import set_z3_leaf_module

    leaves = zero3_leaf_modules(model)
    for module in leaves:
        set_z3_leaf_module(module, True)
    index = {id(m): n for n, m in model.named_modules()}
    return [index[id(m)] for m in leaves]


def prepare_sharding(model: nn.Module, args) -> None:
    """What `MultiTaskTrainer` does before accelerate wraps the model: FSDP with a transformer-based wrap and no class
    list gets the family's blocks (`transformer_block_classes`; accelerate would take the family's
    `_no_split_modules`, which names the routed layer, not its experts); ZeRO-3 gets the family's leaves
    (`mark_zero3_leaves`)."""
    plugin_args = getattr(args, "fsdp_plugin_args", None)
    if plugin_args is not None and plugin_args.get("fsdp_version", 1) == 2:
        policy = str(plugin_args.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP"))
        if policy == "TRANSFORMER_BASED_WRAP" and not plugin_args.get("transformer_cls_names_to_wrap"):
            classes = transformer_block_classes(model)
            if classes:
                plugin_args["transformer_cls_names_to_wrap"] = ",".join(classes)
    ds_config = getattr(args, "hf_deepspeed_config", None)
    if ds_config is not None and ds_config.is_zero3():
        mark_zero3_leaves(model)


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
        model.set_reduce_scatter_unused_params(True)
        model._hf_taskmoe_unused_zeroed = True
