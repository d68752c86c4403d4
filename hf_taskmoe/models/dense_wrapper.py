"""`DenseWrapperMixin`: the base of the models that hold a dense transformers model as `self.backbone`, a method's
modules inside it -- the encoder methods (`models.encoder.TaskEncoderMixin`: MT-TaG, PALs, CA-MTL) and the task-routed
LMs (`models.task_routing.core.TaskRoutingMixin`, the dense LM's layers forked)."""

from __future__ import annotations

import inspect
import os

from transformers import AutoModel, PreTrainedModel

from ..backbones import TaskContext
from ..compat import checkpointing_enable_with, initialize_module_tree, is_initialized
from ..tasks import TaskSpec
from ..upcycling import DenseCheckpoint, UpcyclingRules, load_dense_model, upcycle
from .configuration import check_config_options


class DenseWrapperMixin:
    """Put (through a method's mixin) before `MultiTaskPreTrainedModel`: `self.backbone` is the dense model of
    `dense_auto_class`, built from `config.dense_config` (`_build_dense`), with the method's modules inside;
    `self.task_context` carries the batch's task ids (and the method's flags) to them during a forward. What the two
    kinds do differently are hooks: `_initialises_itself`, `_initialize_again`, `_checkpoint_kwargs`, `_dense_rules`,
    `_load_dense`."""

    base_model_prefix = "backbone"
    records_task_order = True
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flex_attn = True
    #: the Auto class the dense model is built (`from_config`) and loaded (`from_dense`: `from_pretrained`) with
    dense_auto_class: type = AutoModel

    def _build_dense(self, config, **kwargs) -> None:
        """The dense model (`dense_auto_class` from `config.dense_config`, `kwargs` to its `from_config`) and the
        task context the method's modules inside it read."""
        self.backbone = self.dense_auto_class.from_config(config.dense_config, **kwargs)
        self.task_context = TaskContext()

    def get_input_embeddings(self):
        return self.backbone.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.backbone.set_input_embeddings(value)

    def initialize_weights(self):
        """transformers' pass, then the method's modules inside the dense model (`_initialises_itself`) again:
        transformers hands a sub-model's subtree to the sub-model's own `_init_weights`, which does not know them (a
        gate would keep `torch.empty`'s values). Those initialised at construction are passed over, and loaded
        weights are skipped (`transformers.initialization`), so a loaded model keeps its own."""
        pending = [module for module in self.backbone.modules()
                   if self._initialises_itself(module) and not is_initialized(module)]
        super().initialize_weights()
        for module in pending:  # transformers' pass marked them, by the dense model's `_init_weights`
            self._initialize_again(module)

    def _initialises_itself(self, module) -> bool:
        """Whether `module`, inside the dense model, is initialised by this model (marked `task_conditioned`)."""
        return getattr(module, "task_conditioned", False)

    def _initialize_again(self, module) -> None:
        """`module`'s subtree initialised again by this model's `_init_weights`, children first."""
        initialize_module_tree(self, module, again=True)

    def apply_freezing(self) -> None:
        """Freeze what the method's config keeps frozen (nothing by default)."""

    def _after_load(self) -> None:
        self.apply_freezing()  # loading creates the parameters anew

    def _checkpoint_kwargs(self, kwargs: dict | None) -> dict | None:
        """The activation checkpoint's keywords: a checkpointed layer is recomputed in the backward pass, after the
        forward emptied the task context, so the checkpoint restores the context then."""
        return self.task_context.checkpoint_kwargs(kwargs)

    def _dense_rules(self) -> tuple[tuple[str, str], ...]:
        """`(target regex, source template)` pairs for the weights whose names differ from the dense model's
        (relative to `backbone.`); every other backbone weight comes from the dense weight of the same name."""
        return ()

    def upcycling_rules(self) -> UpcyclingRules:
        """The `UpcyclingRules` of this model (`hf_taskmoe.upcycling.upcycle`): `_dense_rules`, then every other
        weight from its own name; new: the new roles of its `parameter_roles`."""
        return UpcyclingRules(rename=self._dense_rules() + ((r"(.+)", r"\1"),), new=self.parameter_roles.new_patterns)

    @classmethod
    def _load_dense(cls, dense, hub_kwargs: dict) -> DenseCheckpoint:
        """The dense checkpoint `from_dense` builds on (`load_dense_model` with `dense_auto_class`)."""
        return load_dense_model(dense, cls.dense_auto_class, **hub_kwargs)

    @classmethod
    def _upcycled(cls, dense, tasks, strict: bool, hub_kwargs: dict | None, config_kwargs: dict):
        """`from_dense`'s work: `(model, UpcyclingReport, DenseCheckpoint)`."""
        # a misspelt option is refused before the checkpoint loads (`num_expert=8` must not build 4 experts)
        check_config_options(cls.config_class, config_kwargs, inspect.signature(cls.from_dense).parameters,
                             where=f"{cls.__name__}.from_dense")
        checkpoint = cls._load_dense(dense, hub_kwargs or {})
        model = cls(cls.config_class.from_dense_config(checkpoint.config, tasks, **config_kwargs))
        return model, upcycle(checkpoint, model, strict=strict), checkpoint

    @classmethod
    def from_dense(cls, dense: str | os.PathLike | PreTrainedModel, tasks: list[TaskSpec | dict],
                   output_loading_info: bool = False, strict: bool = True, hub_kwargs: dict | None = None,
                   **config_kwargs):
        """Build the family on a dense checkpoint (a path, a Hub repo id or a loaded model of an architecture the
        family declares: `hf_taskmoe.backbones.backbone_names(kind)`), copying its weights (`UpcyclingReport` with
        `output_loading_info=True`). `**config_kwargs` are fields of the family's config."""
        model, report, _ = cls._upcycled(dense, tasks, strict, hub_kwargs, config_kwargs)
        return (model, report) if output_loading_info else model


checkpointing_enable_with(DenseWrapperMixin, lambda model, kwargs: model._checkpoint_kwargs(kwargs))
