"""The shared base of the encoder families (MT-TaG, PALs, CA-MTL on any declared encoder architecture).

- `TaskEncoderConfig`: a config holding the dense model's own config (`dense_config`, any architecture declared in
  `hf_taskmoe.backbones` with kind `"encoder"`), the tasks and the pooling; the dense config's sizes read through it
  under one set of names.
- `TaskHeadsMixin`: the task-level forward -- check the batch, run the encoder, run each row's head (`self.heads`),
  read nothing back from the device once the batch was checked on the host; the capture (export, compile) path.
- `TaskEncoderMixin(TaskHeadsMixin, DenseWrapperMixin)`: the encoder of a family -- the dense model built by
  `AutoModel.from_config`, in which the family wraps a few modules in place, run through its own forward with the
  batch's task ids in a `TaskContext`, and the pooled sequence the heads read; `from_dense` (upcycling), the
  initialisation of the family's modules and activation checkpointing are `DenseWrapperMixin`'s
  (`models.dense_wrapper`, shared with the task-routed LMs).

A family on this base (`TaskMoEForMultiTask`, `PALsForMultiTask`, `CAMTLForMultiTask`) implements `_wrap_backbone`
(the surgery), `_dense_rules` (where each new weight comes from in the dense checkpoint) and, when its wrapped
modules report something back (MoE routing), `_encoder_fields` (with `family_flags` and `_task_output`);
`encoder_family` registers it.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from huggingface_hub.errors import StrictDataclassFieldValidationError
from transformers import AutoConfig, PreTrainedConfig
from transformers import initialization as init
from transformers.integrations import is_deepspeed_zero3_enabled
from transformers.utils import ModelOutput

from ..backbones import ENCODER_BACKBONE, Backbone, get_backbone, layer_hidden_input
from ..compat import dense_sub_config, initialize_module_tree, is_exporting
from ..input_checks import (
    check_batch_dim,
    check_input_shapes,
    check_kwargs,
    check_token_ids,
    resolve_task_ids,
    token_table_sizes,
)
from ..modeling_utils import MultiTaskModelOutput, heads_to_output_fields
from ..pipelines import PIPELINE_TASK
from ..problem_types import ENCODER
from ..tasks import TaskSpec
from ..upcycling import UpcyclingRules
from ..utils import check_choice, check_int, check_layer_list
from .configuration import TaskConfigMixin
from .dense_wrapper import DenseWrapperMixin
from .registry import Family

CLASSIFIER_POOLINGS = ("pooler", "cls", "mean")

#: why `torch.jit.trace` of a task model is refused: it would record the example batch's per-task row counts
TRACING_REFUSED = (
    "torch.jit.trace would record the example batch's task mix (its per-task row counts) and answer other mixes "
    "wrongly; export with torch.export instead: hf_taskmoe.onnx_export.export_program(model), or "
    "hf_taskmoe.export_onnx(model, path) for ONNX (docs/deployment.md, 'Export to ONNX')."
)


def pool_sequence(hidden: torch.Tensor, attention_mask: torch.Tensor | None, mode: str, pooler=None) -> torch.Tensor:
    """The sequence representation the heads read (`classifier_pooling`): `(batch, seq, hidden)` ->
    `(batch, hidden)`."""
    if mode == "pooler":
        return pooler(hidden)
    if mode == "cls":
        return hidden[:, 0]
    if attention_mask is None:
        return hidden.mean(1)
    weights = attention_mask.to(hidden.dtype).unsqueeze(-1)  # (batch, seq, 1)
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)


class TaskHeadsMixin:
    """The task-level forward of every encoder family: check the batch, run the encoder (`_run_encoder`, the family's),
    then each row's head in `self.heads` (a `MultiTaskHeads`). Put before the family's `MultiTaskPreTrainedModel`
    base; `TaskEncoderMixin` is the one the backbone-generic families use."""

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        task_ids: torch.LongTensor | None = None,
        labels: torch.Tensor | None = None,
        span_positions: torch.LongTensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        values_checked: bool = False,
        task_counts: tuple[int, ...] | None = None,
        **kwargs,
    ) -> MultiTaskModelOutput | tuple:
        r"""
        task_ids (`torch.LongTensor` of shape `(batch,)`):
            Index into `config.tasks` of each row; selects the row's task-specific modules and head. A batch
            may mix tasks.
        labels (`torch.Tensor` of shape `(batch,)` or `(batch, width)`):
            Per-row labels in the format of each row's task (see `hf_taskmoe.layers.heads`).
        span_positions (`torch.LongTensor` of shape `(batch, num_spans, 2)`):
            Token start/end (exclusive) of each word span, for span-classification tasks.
        values_checked (`bool`, *optional*, defaults to `False`):
            The batch's values (task ids, labels, spans) were checked on the host where it was made (`BatchChecker`;
            `MultiTaskCollator` batches checked by `HostCheckedCollator` carry `values_checked=True`): the forward
            then skips the value checks (each a read back from the device) and gives the same loss, per-task
            losses, logits and gradients. An eager forward splits the batch among the heads by `task_counts` (an
            absent task's head gets no gradient); without them it reads the per-task row counts back once. Under
            capture (torch.export, ONNX, torch.compile) every head runs on every row
            (`MultiTaskHeads.forward_every_row`) and nothing is read back; there `task_logits` / `task_losses`
            read back which tasks are present when first looked at, and `logits` is None when the tasks' logit
            shapes differ. Models with a multiple-choice or extractive-QA task
            split the batch. Export the forward with `values_checked=True` (`hf_taskmoe.export_onnx`).
        task_counts (`tuple[int, ...]`, *optional*):
            The rows of each task in the batch, in `config.tasks` order, counted on the host where the batch was made
            (`BatchChecker.check`; `HostCheckedCollator` adds them beside `values_checked`). With `values_checked`
            the eager forward splits the batch by them and reads nothing back from the device; otherwise they must
            agree with `task_ids`. A captured forward that runs every head on every row splits nothing and does
            not read them (they may change from batch to batch without a recompile).
        """
        family_flags = [kwargs.pop(name, None) for name in self.family_flags]
        task_ids, encoded, heads_out = self._encode_and_score(
            input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, task_ids, labels, span_positions,
            output_attentions, output_hidden_states, *family_flags, values_checked=values_checked,
            task_counts=task_counts, **kwargs,
        )
        output = self._task_output(task_ids, encoded, heads_out)
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        return output if return_dict else output.to_tuple()

    #: the keywords of `forward` beyond its signature that the family's encoder takes, after the output flags
    #: (MT-TaG: `output_router_logits`)
    family_flags: tuple[str, ...] = ()

    def _task_output(self, task_ids, encoded, heads_out) -> ModelOutput:
        """The forward's output from the encoder's (`_run_encoder`) and the heads' (a family reporting more from its
        encoder returns more)."""
        return MultiTaskModelOutput(loss=heads_out.loss, task_ids=task_ids, hidden_states=encoded.hidden_states,
                                    attentions=encoded.attentions, **heads_to_output_fields(heads_out))

    def _run_encoder(self, *args, **kwargs):
        """The encoder on checked inputs (`input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
        task_ids, *flags, task_rows=`) -> an output with `last_hidden_state`, `pooler_output`, `hidden_states` and
        `attentions`: the family's."""
        raise NotImplementedError

    def _encode_and_score(
        self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, task_ids, labels, span_positions,
        *flags, values_checked: bool = False, task_counts=None, **kwargs,
    ):
        """Check the batch (labels before the encoder runs), encode, run each row's head.
        Returns `(task_ids, encoder output, HeadsOutput)`; `flags` go to the encoder's `_encode`.

        A batch checked on the host (`values_checked`) that is being captured (torch.export, ONNX, torch.compile)
        runs every head on every row when the heads allow it (`MultiTaskHeads.forward_every_row`): nothing is read
        back from the device and no shape depends on the task mix. An eager forward splits the batch by task (by the
        host's `task_counts`, else one read of the per-task row counts): there the heads of tasks absent from the
        batch get no gradient at all,
        where the every-row path gives them zeros, which AdamW's momentum and weight decay would still act on --
        training would then depend on whether the batch was checked on the host."""
        check_kwargs(kwargs, self.forward)
        if torch.jit.is_tracing():
            raise ValueError(TRACING_REFUSED)
        batch, seq = check_input_shapes(
            input_ids, inputs_embeds, self.max_input_length(), self._input_limit_name, attention_mask=attention_mask,
            token_type_ids=token_type_ids, position_ids=position_ids,
        )
        exporting = is_exporting()
        if exporting:
            if not values_checked:
                raise ValueError(
                    "An exported program cannot check values: export the forward with `values_checked=True` and check "
                    "each batch on the host before it runs (hf_taskmoe.training.batches.BatchChecker)."
                )
            if labels is not None:
                raise ValueError("Export the forward for inference: leave `labels` out (a loss needs labels).")
            self.heads.check_exportable()
        if values_checked and torch.compiler.is_compiling() and self.heads.every_row_ready():
            check_batch_dim(batch, labels=labels, span_positions=span_positions)
            task_ids = resolve_task_ids(task_ids, batch, self.config.task_names, self.device, check_values=False)
            encoded = self._run_encoder(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                                        task_ids, *flags, task_rows=None)
            heads_out = self.heads.forward_every_row(encoded.last_hidden_state, encoded.pooler_output, task_ids,
                                                     labels, span_positions, padded=exporting)
            if exporting:  # a program returns tensors: `logits`, each row's own task's, zero-padded (`logit_widths`)
                heads_out.task_logits = None
            return task_ids, encoded, heads_out
        if not values_checked:  # else `BatchChecker` checked them on the host
            check_token_ids(token_table_sizes(self), input_ids=input_ids, token_type_ids=token_type_ids,
                            position_ids=position_ids)
        task_ids, task_rows, prepared = self._prepare_task_batch(
            task_ids, batch, seq, labels, span_positions, check_values=not values_checked, task_counts=task_counts
        )
        encoded = self._run_encoder(
            input_ids,
            attention_mask,
            token_type_ids,
            position_ids,
            inputs_embeds,
            task_ids,
            *flags,
            task_rows=task_rows,
        )
        heads_out = self.heads(
            encoded.last_hidden_state, encoded.pooler_output, task_rows, prepared, span_positions
        )
        return task_ids, encoded, heads_out


# names a family reads from the dense config, whatever the architecture calls them (`Backbone.config_fields`)
_DENSE_VIEWS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act",
    "max_position_embeddings", "vocab_size", "initializer_range", "layer_norm_eps", "hidden_dropout_prob",
)


class TaskEncoderConfig(TaskConfigMixin, PreTrainedConfig):
    r"""
    Base of the backbone-generic families' configs: the dense model's config, the tasks and the pooling.

    Args:
        dense_config (`dict` or `PreTrainedConfig`):
            The config of the dense encoder the model wraps (its `model_type` must be a declared encoder backbone:
            `hf_taskmoe.backbones.backbone_names("encoder")`). `from_dense` fills it from the checkpoint.
        tasks (`list[dict]`):
            The tasks, as `TaskSpec` dicts; task id `i` in `forward` is `tasks[i]`.
        classifier_pooling (`str`, *optional*, defaults to `"cls"`):
            What the heads read: `"cls"` (the first token's last hidden state), `"mean"` (mean over real tokens) or
            `"pooler"` (the dense model's own pooler, where the architecture has one: BERT, RoBERTa, XLM-R).
        classifier_dropout (`float`, *optional*):
            Dropout before the heads (defaults to the dense model's hidden dropout).
        scale_loss_by_num_classes (`bool`, *optional*, defaults to `False`):
            Divide each classification task's cross-entropy by `log(num_classes)` (MT-TaG section 3.3).
        upcycled_from (`str`, *optional*):
            Set by `from_dense`: the dense checkpoint the model was built from (model cards).

    The dense config's sizes read through this config under one set of names whatever the architecture calls them
    (`hidden_size`, `num_hidden_layers`, `num_attention_heads`, `max_position_embeddings`, `vocab_size`, ...).
    """

    sub_configs: ClassVar = {"dense_config": AutoConfig}
    #: the dense model type of a config built without `dense_config` (transformers builds default configs)
    dense_config_default: ClassVar[str] = "bert"
    #: the method's name in messages (`"MT-TaG"`, ...)
    method_name: ClassVar[str] = "This method"

    dense_config: dict | PreTrainedConfig | None = None
    tasks: list | None = None
    classifier_pooling: str = "cls"
    classifier_dropout: float | None = None
    scale_loss_by_num_classes: bool = False
    upcycled_from: str | None = None

    def __post_init__(self, **kwargs):
        self.dense_config = dense_sub_config(self.dense_config, self.dense_config_default)
        super().__post_init__(**kwargs)
        self._validate()

    def _validate(self) -> None:
        backbone = self.backbone  # refuses an undeclared model_type, listing the declared ones
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads"):
            check_int(getattr(self, name), name, minimum=1)
        if self.hidden_size % self.num_attention_heads:  # the dense model's attention would refuse it when built
            raise ValueError(
                f"`hidden_size` ({self.hidden_size}) must be a multiple of `num_attention_heads` "
                f"({self.num_attention_heads})."
            )
        self._validate_tasks(
            ENCODER, "has no encoder head (it needs a decoder or another model); an encoder model supports"
        )
        check_choice(self.classifier_pooling, CLASSIFIER_POOLINGS, "classifier_pooling")
        if self.classifier_pooling == "pooler" and backbone.pooler is None:
            raise ValueError(
                f"`classifier_pooling='pooler'`: a {backbone.model_type} model has no pooler; use 'cls' or 'mean'."
            )
        if not isinstance(self.scale_loss_by_num_classes, bool):
            raise ValueError(f"`scale_loss_by_num_classes` must be a bool, got {self.scale_loss_by_num_classes!r}.")

    @property
    def backbone(self) -> Backbone:
        """The declaration of the dense model's architecture."""
        return get_backbone(self.dense_config.model_type, ENCODER_BACKBONE, self.method_name)

    def _check_layer_list(self, name: str) -> list[int] | None:
        return check_layer_list(getattr(self, name), name, self.num_hidden_layers)

    @classmethod
    def from_dense_config(cls, dense_config: PreTrainedConfig, tasks, **kwargs: Any):
        """A config wrapping `dense_config` (copied) with the tasks and the family's settings."""
        get_backbone(getattr(dense_config, "model_type", None), ENCODER_BACKBONE, cls.method_name)
        dense = dense_config.__class__.from_dict(dense_config.to_dict())
        return cls(dense_config=dense, tasks=[TaskSpec.from_dict(t).to_dict() for t in tasks], **kwargs)


def _dense_view(name: str):
    def read(self):
        return self.backbone.config_value(self.dense_config, name)

    read.__doc__ = f"The dense config's `{name}` (under the architecture's own name)."
    return property(read)


for _name in _DENSE_VIEWS:
    setattr(TaskEncoderConfig, _name, _dense_view(_name))


@property
def _type_vocab_size(self) -> int | None:
    """The segment table's size, None for an architecture without segment ids or a config without the table
    (DeBERTa-v3: `type_vocab_size=0`); BatchChecker checks segment ids against it."""
    size = getattr(self.dense_config, "type_vocab_size", None) if self.backbone.segment_ids else None
    return size or None


TaskEncoderConfig.type_vocab_size = _type_vocab_size


class FlatDenseFields:
    """For the configs of the papers' BERT classes (`BertTaskMoEConfig`, `BertPALsConfig`, `CAMTLConfig`): the dense
    config's own fields taken flat, as in a `BertConfig` (`BertPALsConfig(hidden_size=384, ..., tasks=...)`). Given
    alone they make `dense_config` (a `flat_dense_class`);
    beside an explicit `dense_config` (`from_pretrained(path, use_cache=False)`) they set its fields; read and set
    later, flat, they are the dense config's (saved inside it). Put it before the config class in the bases."""

    #: the dense config class whose fields are taken flat
    flat_dense_class: ClassVar[type] = None

    @classmethod
    def flat_dense_fields(cls) -> frozenset[str]:
        """The dense config class's fields the config does not have itself (its own, `classifier_dropout` included,
        stay its own)."""
        cached = cls.__dict__.get("_flat_dense_fields")
        if cached is None:
            own = {f.name for f in dataclasses.fields(cls)}
            cached = frozenset(f.name for f in dataclasses.fields(cls.flat_dense_class) if f.name not in own)
            cls._flat_dense_fields = cached
        return cached

    @classmethod
    def accepted_options(cls) -> frozenset[str]:
        return super().accepted_options() | cls.flat_dense_fields()

    def __post_init__(self, **kwargs):
        flat = {name: kwargs.pop(name) for name in list(kwargs) if name in self.flat_dense_fields()}
        try:
            if flat and self.dense_config is None:
                self.dense_config = self.flat_dense_class(**flat)
            elif flat:
                self.dense_config = dense_sub_config(self.dense_config, self.dense_config_default)
                for name, value in flat.items():
                    setattr(self.dense_config, name, value)
        except (TypeError, ValueError, StrictDataclassFieldValidationError) as err:  # transformers' strict fields
            raise ValueError(
                f"{type(self).__name__}: invalid dense-config field among {sorted(flat)}: {err}"
            ) from err
        super().__post_init__(**kwargs)

    def __getattr__(self, name: str):
        # called only when the usual lookup fails: a flat field reads through to `dense_config`
        dense = self.__dict__.get("dense_config")
        if dense is not None and not isinstance(dense, dict) and name in type(self).flat_dense_fields():
            return getattr(dense, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value) -> None:
        dense = self.__dict__.get("dense_config")
        if dense is not None and not isinstance(dense, dict) and name in type(self).flat_dense_fields():
            try:
                setattr(dense, name, value)
            except (TypeError, ValueError, StrictDataclassFieldValidationError) as err:
                raise ValueError(f"{type(self).__name__}: invalid `{name}`: {err}") from err
        else:
            super().__setattr__(name, value)


@dataclass
class TaskEncoderOutput(ModelOutput):
    """The dense model's states after the family's modules ran: `last_hidden_state` `(batch, seq, hidden)`,
    `pooler_output` `(batch, hidden)` (what the heads read), and `hidden_states` / `attentions` when asked."""

    last_hidden_state: torch.FloatTensor | None = None
    pooler_output: torch.FloatTensor | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    attentions: tuple[torch.FloatTensor, ...] | None = None


class _FirstLayerReached(Exception):
    """Stops a forward at the first layer (`TaskEncoderMixin.first_layer_inputs`)."""


class TaskEncoderMixin(TaskHeadsMixin, DenseWrapperMixin):
    """Put before `MultiTaskPreTrainedModel` in a backbone-generic family's task model: `self.backbone` (the dense
    architecture's own base model, with the family's modules in place: `DenseWrapperMixin`), `self.heads` and
    `self.task_context`. The family's `__init__` calls `_build_backbone(config)` then `post_init()`."""

    _supports_flash_attn = True
    _supports_attention_backend = True
    #: output class of `_run_encoder` (a family's with its own fields)
    encoder_output_class = TaskEncoderOutput

    def _build_backbone(self, config: TaskEncoderConfig) -> None:
        """The dense model (its own modules, initialisation and forward), then the family's surgery, then the
        backbone's initial values (`_draw_backbone`), then the heads."""
        backbone = config.backbone
        extra = {}
        if backbone.pooler is not None:  # BertModel & co. build a pooler only where it is read
            extra["add_pooling_layer"] = config.classifier_pooling == "pooler"
        with init.no_init_weights():  # nothing drawn yet: `_draw_backbone` draws what the surgery leaves
            self._build_dense(config, **extra)
        self._no_split_modules = list(getattr(self.backbone, "_no_split_modules", None) or [])
        accepted = inspect.signature(self.backbone.forward).parameters
        self._backbone_takes = {name for name in ("token_type_ids", "position_ids") if name in accepted}
        if config.type_vocab_size is None:  # no segment table: a tokenizer's segment ids have nowhere to go
            self._backbone_takes.discard("token_type_ids")
        self._wrap_backbone(config, backbone, backbone.layer_list(self.backbone))
        self._draw_backbone()
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        from ..layers.heads import MultiTaskHeads

        self.heads = MultiTaskHeads(config.task_specs, config.hidden_size, dropout or 0.0,
                                    config.scale_loss_by_num_classes)

    def _draw_backbone(self) -> None:
        """The backbone's initial values, drawn as if its modules had been built where they are, before the heads:
        first what torch draws when it builds its own modules (`reset_parameters` of `nn.Embedding`, `nn.Linear`,
        ...), in module order, then the init pass (this model's `_init_weights`, the family's modules included),
        children first. The dense model was built drawing nothing (`no_init_weights`), so the random stream -- the
        values of the family's new modules (gates, PALs, conditional modules), the heads' and the generator's state
        after the build -- depends on the model's final module tree and the seed, not on the dense modules the surgery
        replaced: at a seed it is the stream of the BERT-layer classes these replaced (`BertForTaskMoE` upcycled
        from MiniLM draws the same gates and heads as before the unification). Skipped where transformers skips its
        own pass (the meta device of `from_pretrained`, DeepSpeed ZeRO-3), which initialises the backbone there."""
        if is_deepspeed_zero3_enabled() or any(p.device.type == "meta" for p in self.backbone.parameters()):
            return
        with torch.no_grad():
            for module in self.backbone.modules():
                reset = getattr(type(module), "reset_parameters", None)
                if reset is not None and reset.__module__.startswith("torch.nn."):  # what torch's __init__ calls
                    module.reset_parameters()
        initialize_module_tree(self, self.backbone)

    def _wrap_backbone(self, config, backbone: Backbone, layers: torch.nn.ModuleList) -> None:
        """The family's surgery on the dense model's layers (replace or wrap modules found through `backbone`)."""
        raise NotImplementedError

    @torch.no_grad()
    def _init_weights(self, module):
        # the dense architecture's own initialisation (its buffers, its scaled inits), then the task order
        self.backbone._init_weights(module)
        self._init_task_order(module)

    def position_table_size(self) -> int | None:
        """The rows `position_ids` index (`max_position_embeddings`) where the dense model adds an absolute position
        table to its embeddings (BERT, RoBERTa, XLM-R, ELECTRA, DistilBERT); None where positions are rotary
        (ModernBERT) or relative (DeBERTa-v3), which have no table for an id to fall outside."""
        embeddings = self.backbone.get_submodule(self.config.backbone.embeddings)
        table = getattr(embeddings, "position_embeddings", None)
        return self.config.max_position_embeddings if isinstance(table, torch.nn.Embedding) else None

    def _run_encoder(
        self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, task_ids,
        output_attentions=None, output_hidden_states=None, *family_flags, task_rows=None, **kwargs,
    ):
        """The dense model's own forward with the task ids in `task_context`; the heads' input pooled from it."""
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "inputs_embeds": inputs_embeds}
        if "token_type_ids" in self._backbone_takes:
            inputs["token_type_ids"] = token_type_ids
        if "position_ids" in self._backbone_takes and position_ids is not None:
            inputs["position_ids"] = position_ids
        # the flags default to this model's config (the dense model would read its own `dense_config`)
        config = self.config
        inputs["output_attentions"] = output_attentions if output_attentions is not None else config.output_attentions
        inputs["output_hidden_states"] = (
            output_hidden_states if output_hidden_states is not None else config.output_hidden_states
        )
        self.task_context.begin(task_ids, attention_mask, task_rows=task_rows,
                                **self._context_flags(*family_flags))
        try:
            out = self.backbone(**inputs, **kwargs, return_dict=True)
            reports = list(self.task_context.reports)
        finally:
            self.task_context.end()
        hidden = out.last_hidden_state
        mode = self.config.classifier_pooling
        pooled = out.pooler_output if mode == "pooler" else pool_sequence(hidden, attention_mask, mode)
        return self.encoder_output_class(
            last_hidden_state=hidden,
            pooler_output=pooled,
            hidden_states=getattr(out, "hidden_states", None),
            attentions=getattr(out, "attentions", None),
            **self._encoder_fields(reports, *family_flags),
        )

    def encode(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
               task_ids=None, *flags, return_dict=None, **kwargs):
        """The encoder's output (`_run_encoder`: `last_hidden_state`, `pooler_output` as the heads read it, the
        states asked for by `flags` -- `output_attentions, output_hidden_states` and the family's) for rows of any
        task (`task_ids`), the heads not run. `kwargs` go to the dense model's forward."""
        batch, _ = check_input_shapes(
            input_ids, inputs_embeds, self.max_input_length(), self._input_limit_name(), attention_mask=attention_mask,
            token_type_ids=token_type_ids, position_ids=position_ids,
        )
        task_ids = resolve_task_ids(task_ids, batch, self.config.task_names, self.device)
        check_token_ids(token_table_sizes(self), input_ids=input_ids, token_type_ids=token_type_ids,
                        position_ids=position_ids)
        output = self._run_encoder(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, task_ids,
                                   *flags, **kwargs)
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        return output if return_dict else output.to_tuple()

    def first_layer_inputs(self, input_ids, attention_mask=None, token_type_ids=None, task_ids=None) -> torch.Tensor:
        """What the dense model's first layer reads for these rows, after what the family puts before it (CA-MTL's
        conditional alignment): `(batch, seq, d)`, the inputs of the covariance similarity (CA-MTL eq. 7). Runs the
        model's own forward up to that layer (a pre-hook registered after the family's records the input and stops
        the forward), so it is what training sees."""
        first = self.config.backbone.layer_list(self.backbone)[0]
        seen = []

        def record(module, args, kwargs):
            seen.append(layer_hidden_input(args, kwargs))
            raise _FirstLayerReached

        handle = first.register_forward_pre_hook(record, with_kwargs=True)
        try:
            self(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, task_ids=task_ids)
        except _FirstLayerReached:
            pass
        finally:
            handle.remove()
        return seen[0]

    def _context_flags(self, *family_flags) -> dict:
        """What the family's wrapped modules read besides the task ids (e.g. whether to report routing)."""
        return {}

    def _encoder_fields(self, reports: list, *family_flags) -> dict:
        """The family's own encoder-output fields from what its modules reported during the forward."""
        return {}


def layer_rule(backbone: Backbone, inner: str, source: str) -> tuple[str, str]:
    """A rename for a weight inside every layer: `<layers>.<i>.<inner>` from `<layers>.<i>.<source>` (`inner` a
    regex; `source` a template that may use `inner`'s groups, numbered from 2)."""
    return (rf"{re.escape(backbone.layers)}\.(\d+)\.{inner}", rf"{backbone.layers}.\1.{source}")


def encoder_family(name: str, config_class: type, model_class: type, method: str, describe, **fields):
    """The `Family` of an encoder method's model class: every encoder problem type, served by the text pipeline,
    built from a dense checkpoint whose weights keep their names (the model's new weights: its parameter roles'
    `new`; a model renaming some gives its own `upcycling_rules`). `fields`: the `Family`'s others."""
    return Family(name=name, config_class=config_class, model_class=model_class, problem_types=ENCODER,
                  pipeline_task=PIPELINE_TASK, describe=describe, method=method,
                  upcycling=UpcyclingRules(rename=(), new=model_class.parameter_roles.new_patterns), **fields)
