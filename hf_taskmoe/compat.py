"""Everything hf_taskmoe knows about names that changed inside transformers 5.x, in one place.

The families wrap transformers through public seams (a model's `forward`, `prepare_inputs_for_generation`,
`Cache` objects, torch module hooks). Where those seams themselves were renamed between the releases the
package supports, the installed release is read here, from public signatures, once. Each name below has a
canary in `tests/test_compat.py` that fails naming the hook if an upstream release changes it.

Private transformers members this package still touches, each checked by a canary:
- `Trainer._prepare_inputs` (called, not overridden: moves a batch to the device as `Trainer` does);
- `Pipeline._load_tokenizer` / `_load_feature_extractor` / `_load_image_processor` / `_load_processor` and
  `_pipeline_calls_generate` (class flags a custom pipeline sets, as transformers' own pipelines do; the text-to-text
  pipeline sets the last to False and merges generation keywords through `_sanitize_parameters`);
- `Pipeline._sanitize_parameters` / `_forward` (the documented extension points of a custom pipeline);
- `PreTrainedModel._initialize_weights` (one module's step of `initialize_weights`: skip it when marked initialised,
  else `_init_weights` and mark it) and the mark it reads, `_is_hf_initialized` (`initialize_module_tree`,
  `is_initialized`).

- `PreTrainedModel._can_set_experts_implementation` (overridden by `experts_class_elsewhere`) and
  `PreTrainedConfig._experts_implementation` / `_experts_implementation_internal` (the property and its storage
  behind the public `experts_implementation` key, overridden by `own_experts_implementation`);
- `torch.ops.transformers.grouped_mm_fallback` (`GROUPED_MM_FALLBACK`: transformers' grouped product as a custom
  op with a fake kernel, registered by `transformers.integrations.moe`).

One private torch member, also with a canary: `torch.compiler._is_exporting_flag` (`is_exporting` below).
"""

from __future__ import annotations

import inspect

import torch
from transformers import GenerationMixin, PreTrainedModel

#: the keyword under which generation hands the key/value cache to a model's `forward` and reads it back from
#: the model's output: `cache` from transformers 5.24 on (`past_key_values` is deprecated there and goes in 5.40),
#: `past_key_values` before.
CACHE_ARG: str = (
    "cache" if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    else "past_key_values"
)

#: every name a cache may arrive under (a caller may use either)
CACHE_ARGS: tuple[str, ...] = ("cache", "past_key_values")


def pop_cache(kwargs: dict):
    """Remove the key/value cache from `kwargs`, under whichever name it came; None when there is none.
    Both names are accepted silently: transformers warns about its own deprecated name, this package adds nothing."""
    found = [kwargs.pop(name) for name in CACHE_ARGS if name in kwargs]
    found = [c for c in found if c is not None]
    if len(found) > 1:
        raise ValueError("Pass the key/value cache once, as `cache` or as `past_key_values`, not both.")
    return found[0] if found else None


def output_cache(output):
    """The key/value cache a transformers model output carries (`output.cache` or `output.past_key_values`)."""
    return getattr(output, CACHE_ARG, None)


#: the public method that turns activation checkpointing on: `activation_checkpointing_enable` from transformers 5.24
#: on (`gradient_checkpointing_enable` is its deprecated alias there, which calls it), `gradient_checkpointing_enable`
#: before. A model whose modules read a `TaskContext` overrides this one to pass the checkpoint a `context_fn`.
CHECKPOINTING_ENABLE: str = (
    "activation_checkpointing_enable" if hasattr(PreTrainedModel, "activation_checkpointing_enable")
    else "gradient_checkpointing_enable"
)


#: the name of `CHECKPOINTING_ENABLE`'s first parameter (the `torch.utils.checkpoint` keywords)
CHECKPOINTING_KWARGS: str = (
    "activation_checkpointing_kwargs" if CHECKPOINTING_ENABLE == "activation_checkpointing_enable"
    else "gradient_checkpointing_kwargs"
)


def checkpointing_enable_with(method_owner: type, kwargs_of) -> None:
    """Give `method_owner` (a mixin put before `PreTrainedModel`) the override of `CHECKPOINTING_ENABLE` that passes
    its checkpoint keywords through `kwargs_of(model, kwargs)`, whether they come by position or by name
    (`CHECKPOINTING_KWARGS`: transformers' deprecated `gradient_checkpointing_enable` passes them by name)."""

    def enable(self, *args, **kwargs):
        if CHECKPOINTING_KWARGS in kwargs:
            checkpoint_kwargs = kwargs.pop(CHECKPOINTING_KWARGS)
        else:
            checkpoint_kwargs, args = (args[0], args[1:]) if args else (None, args)
        return getattr(super(method_owner, self), CHECKPOINTING_ENABLE)(kwargs_of(self, checkpoint_kwargs), *args,
                                                                         **kwargs)

    enable.__name__ = CHECKPOINTING_ENABLE
    enable.__doc__ = ("transformers' activation checkpointing, with the task ids of each checkpointed layer restored "
                      "while it is recomputed (`TaskContext.checkpoint_kwargs`).")
    setattr(method_owner, CHECKPOINTING_ENABLE, enable)


def dense_sub_config(value, default_model_type: str):
    """The dense model's config a composite config holds (`dense_config`), built from what it was given: a config as it
    is, a dict (a saved config.json) or None (a default config of `default_model_type`) through `AutoConfig.for_model`.
    Done by the config itself because transformers 5.24 builds sub-configs from `sub_configs_defaults` /
    `SubConfigSpec`, which earlier 5.x releases lack (they have only the `sub_configs` class dict, which both read)."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(value, PretrainedConfig):
        return value
    fields = dict(value or {})
    return AutoConfig.for_model(fields.pop("model_type", default_model_type), **fields)


def _t5_block_returns_biases() -> bool:
    from transformers.models.t5.modeling_t5 import T5Block

    return "output_attentions" not in inspect.signature(T5Block.forward).parameters


#: whether transformers' `T5Block` returns exactly `(hidden states, position bias, cross-attention bias)`, as 5.24's
#: does; the floor release (5.10.4) returns a tuple whose length depends on `output_attentions` and `use_cache`.
#: `TaskRoutedForSeq2SeqLM` mixes its experts' blocks through the former and refuses the latter by name.
T5_BLOCK_RETURNS_BIASES: bool = _t5_block_returns_biases()


def is_exporting() -> bool:
    """Whether `torch.export` (or ONNX export through it) is capturing the forward, and not `torch.compile`.

    `torch.compiler.is_exporting()` is not that before torch 2.12: dynamo folds it to a constant True while it traces
    *any* function, so under `torch.compile` a forward took its export paths (refused `labels` in a training step, ran
    every MoE expert on every token; pytorch/pytorch#176347). The flag it is meant to return is the module attribute
    that `torch.export` sets; dynamo reads a module attribute at trace time, so this is right in eager code, under
    `torch.compile` and under `torch.export` on every release. Where the attribute is gone, the public function is
    trusted (the releases that drop it have the fix)."""
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    return torch.compiler.is_exporting() if flag is None else bool(flag)


def enable_fsdp_on_cpu(accelerator, fsdp_plugin) -> bool:
    """Turn on accelerate's FSDP path for a multi-process CPU run (gloo), which accelerate leaves off: its
    `AcceleratorState` takes an FSDP plugin only for accelerator devices (`MULTI_GPU`, `MULTI_XPU`, ...) and on the CPU
    runs DDP instead without a word. torch's FSDP2 (`fully_shard`) itself runs on the CPU over gloo; this sets the two
    attributes accelerate's `prepare`, `save_state` and `load_state` read (`state.distributed_type`,
    `state.fsdp_plugin`), as accelerate sets them on a GPU. Returns whether it did (only `MULTI_CPU` with no plugin
    taken). Canary: `tests/test_compat.py::test_accelerate_fsdp_state_attributes`."""
    from accelerate.utils import DistributedType

    state = accelerator.state
    if fsdp_plugin is None or state.distributed_type != DistributedType.MULTI_CPU:
        return False
    if getattr(state, "fsdp_plugin", None) is not None:
        return False
    if accelerator.mixed_precision != "no":
        fsdp_plugin.set_mixed_precision(accelerator.mixed_precision)
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = fsdp_plugin
    return True


def initialize_module_tree(model: PreTrainedModel, root: torch.nn.Module, again: bool = False) -> None:
    """`model.initialize_weights()` on the subtree `root` only, with `model`'s `_init_weights` for every module of it
    (a sub-model's own is not dispatched to), children before their parent as transformers orders it: each module not
    yet marked initialised is initialised and marked, so that the model's own `initialize_weights` (its `post_init`)
    passes over it later. `again`: first clear the marks in `root` (a sub-model's pass marks modules its
    `_init_weights` does not know; weights loaded from a checkpoint stay skipped, weight by weight). Under
    `transformers.initialization.guard_torch_init_functions`, as transformers' pass is.
    Canary: `tests/test_compat.py::test_canary_initialize_weights_step_marks_the_module`."""
    from transformers import initialization

    def visit(module):
        for child in module.children():
            visit(child)
        if again:
            module._is_hf_initialized = False
        model._initialize_weights(module)

    with torch.no_grad(), initialization.guard_torch_init_functions():
        visit(root)


def is_initialized(module: torch.nn.Module) -> bool:
    """Whether transformers marked `module` initialised (by its init pass, or as loaded whole from a checkpoint)."""
    return bool(getattr(module, "_is_hf_initialized", False))


def grouped_mm_fallback_op():
    """transformers' grouped product `(slots, in) x (groups, in, out) -> (slots, out)` over slices ending at `offs`
    (`torch.ops.transformers.grouped_mm_fallback`): a loop of products behind a custom op whose fake kernel lets
    torch.compile trace it in every dtype (torch's own `grouped_mm` traces in bf16 only: torch 2.13's meta kernel).
    Registered when `transformers.integrations.moe` is imported. Canary:
    `tests/test_compat.py::test_canary_transformers_grouped_mm_fallback_op`."""
    import transformers.integrations.moe  # noqa: F401  (registers the op)

    return torch.ops.transformers.grouped_mm_fallback


def experts_class_elsewhere() -> classmethod:
    """The `_can_set_experts_implementation` of a model whose experts class (declared with transformers'
    `use_experts_implementation`) lives in another module than the model's: transformers decides whether
    `experts_implementation` may be set (`from_pretrained`, `set_experts_implementation`, the `grouped_mm` check)
    by looking for the decorator's text in the source of the model class's own module. Canary:
    `tests/test_compat.py::test_canary_experts_implementation_settable_by_class`."""
    return classmethod(lambda cls: True)


def own_experts_implementation(default: str) -> property:
    """A config property for transformers' `_experts_implementation` (the public `experts_implementation` key: the
    config's argument, `from_pretrained(..., experts_implementation=...)`, `set_experts_implementation`) that keeps the
    choice to this config: transformers' setter copies it into every sub-config too, and a composite config's dense
    model (`dense_config`: a BERT has no experts) then refuses `"grouped_mm"` when it is built. Unset, it reads
    `default`. Stored where transformers keeps it (`_experts_implementation_internal`, left out of config.json).
    Canary: `tests/test_compat.py::test_canary_experts_implementation_settable_by_class`."""

    def get(self):
        return getattr(self, "_experts_implementation_internal", None) or default

    def set(self, value):
        if isinstance(value, dict):
            value = value.get("", getattr(self, "_experts_implementation_internal", None))
        self._experts_implementation_internal = value

    return property(get, set)
