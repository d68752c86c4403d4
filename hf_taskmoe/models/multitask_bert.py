"""What every BERT-backbone family shares: the config fields for tasks and pooling, pooling itself, and the one
loop over the layers that collects hidden states and attentions (`run_layer_stack`).

`MultiTaskBertConfig` is not registered with the Auto classes; each family subclasses it with its own
`model_type` and fields (MT-TaG, PALs, ...), and extends `_validate`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import BertConfig
from transformers import initialization as init
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.models.bert.modeling_bert import BertEmbeddings

from ..layers.heads import MultiTaskHeads
from ..modeling_utils import (
    check_input_shapes,
    check_kwargs,
    resolve_task_ids,
)
from ..problem_types import ENCODER
from ..tasks import TaskConfigMixin
from ..utils import check_choice, check_int, check_layer_list
from .encoder import CLASSIFIER_POOLINGS, TRACING_REFUSED, TaskHeadsMixin, pool_sequence  # noqa: F401

# upcycling rules every BERT family shares: embeddings, attention and pooler come from the same names
BERT_BACKBONE_RULES = (
    (r"embeddings\.(.+)", r"embeddings.\1"),
    (r"encoder\.layer\.(\d+)\.attention\.(.+)", r"encoder.layer.\1.attention.\2"),
    (r"pooler\.(.+)", r"pooler.\1"),
)
# BertConfig fields a family copies from the dense checkpoint it starts from
DENSE_ARCHITECTURE_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act",
    "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings", "type_vocab_size",
    "initializer_range", "layer_norm_eps", "pad_token_id", "classifier_dropout",
)


class MultiTaskBertConfig(TaskConfigMixin, BertConfig):
    r"""
    Base of the BERT-backbone families' configs. Every field of `BertConfig` is accepted. The others:

    Args:
        tasks (`list[dict]`):
            The tasks, as `TaskSpec` dicts (a `TaskSpec` is accepted and stored as its dict). Task id `i`
            in `forward` is `tasks[i]`. Saved with the config, so heads come back with `from_pretrained`.
        scale_loss_by_num_classes (`bool`, *optional*, defaults to `False`):
            Divide each classification task's cross-entropy by `log(num_classes)` (MT-TaG section 3.3).
        classifier_pooling (`str`, *optional*, defaults to `"pooler"`):
            Sequence representation the heads read: `"pooler"` (BERT's tanh pooler on [CLS]), `"cls"` (the
            [CLS] hidden state) or `"mean"` (mean over real tokens).
        upcycled_from (`str`, *optional*):
            Set by `from_dense`: the dense checkpoint the model was built from (model cards).
    """

    tasks: list | None = None
    scale_loss_by_num_classes: bool = False
    classifier_pooling: str = "pooler"
    upcycled_from: str | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self._validate()

    def _validate(self) -> None:
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
            check_int(getattr(self, name), name, minimum=1)
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"`hidden_size` ({self.hidden_size}) must be a multiple of `num_attention_heads` "
                f"({self.num_attention_heads})."
            )
        self._validate_tasks(
            ENCODER, "has no encoder head (it needs a decoder or another model); an encoder model supports"
        )
        check_choice(self.classifier_pooling, CLASSIFIER_POOLINGS, "classifier_pooling")
        if not isinstance(self.scale_loss_by_num_classes, bool):
            raise ValueError(f"`scale_loss_by_num_classes` must be a bool, got {self.scale_loss_by_num_classes!r}.")

    def _check_layer_list(self, name: str) -> list[int] | None:
        """Validate an optional list of layer indices (field `name`); return it sorted."""
        return check_layer_list(getattr(self, name), name, self.num_hidden_layers)

    @classmethod
    def from_dense_config(cls, dense_config: BertConfig, tasks, **kwargs: Any):
        """Copy the architecture of a dense BERT config and add tasks and the family's settings."""
        return cls._from_dense_fields(
            dense_config, tasks, "bert", DENSE_ARCHITECTURE_FIELDS, ", MiniLM included", **kwargs
        )


@dataclasses.dataclass(frozen=True)
class LayerStackOutput:
    """What `run_layer_stack` returns.

    Args:
        last_hidden_state (`torch.FloatTensor` of shape `(batch, seq, hidden)`): the last layer's output.
        hidden_states (`tuple(torch.FloatTensor)`, when asked): the stack's input then every layer's output,
            `len(layers) + 1` tensors of shape `(batch, seq, hidden)`, as transformers' `hidden_states`.
        attentions (`tuple(torch.FloatTensor)`, when asked): what each layer reported as its attention
            probabilities, `len(layers)` entries (`(batch, heads, seq, seq)` on the eager path, `None` where the
            attention kernel gives none).
    """

    last_hidden_state: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor | None, ...] | None = None

    def with_last_hidden_state(self, hidden: torch.Tensor) -> LayerStackOutput:
        """The same output ending in `hidden` (a module after the last layer changed it, e.g. CA-MTL's LARGE skip):
        the last entry of `hidden_states` becomes `hidden` too, so it always equals `last_hidden_state`."""
        hidden_states = self.hidden_states[:-1] + (hidden,) if self.hidden_states is not None else None
        return dataclasses.replace(self, last_hidden_state=hidden, hidden_states=hidden_states)


LayerStep = Callable[[int, torch.nn.Module, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


def run_layer_stack(
    layers: Sequence[torch.nn.Module],
    hidden: torch.Tensor,
    step: LayerStep,
    output_hidden_states: bool = False,
    output_attentions: bool = False,
) -> LayerStackOutput:
    """The one loop of every encoder family: `hidden = step(i, layers[i], hidden)[0]` for each layer in order,
    collecting the hidden states and attentions when asked.

    `step(index, layer, hidden) -> (hidden, attention)` is the family's call of one layer: it passes the layer
    whatever else it needs (attention mask, task ids, a PAL's output, the task conditioning, ...) and may keep
    per-layer results of its own (MoE routing, a skip connection) in its closure. Nothing here assumes BERT: any
    list of layers whose family can say how to call one works.

    Why not transformers' output hooks (`capture_outputs`, `_can_record_outputs`): they live in the private
    `transformers.utils.output_capturing`, read the flags only from keyword arguments (an explicit `None` turns
    them off instead of deferring to the config), and a family's `_encode` is also called by its task-level model,
    not only through a decorated `forward`.
    """
    all_hidden = (hidden,) if output_hidden_states else None
    all_attentions = () if output_attentions else None
    for index, layer in enumerate(layers):
        hidden, attention = step(index, layer, hidden)
        if output_hidden_states:
            all_hidden += (hidden,)
        if output_attentions:
            all_attentions += (attention,)
    return LayerStackOutput(last_hidden_state=hidden, hidden_states=all_hidden, attentions=all_attentions)


def build_from_dense(model_cls, dense, tasks, output_loading_info=False, strict=True, hub_kwargs=None, **config_kwargs):
    """Shared body of the families' `from_dense`: load the dense BERT, derive the config, build, upcycle."""
    from ..upcycling import load_dense_model, upcycle

    dense_model = load_dense_model(dense, **(hub_kwargs or {}))
    config = model_cls.config_class.from_dense_config(dense_model.config, tasks, **config_kwargs)
    model = model_cls(config)
    report = upcycle(dense_model, model, strict=strict)
    return (model, report) if output_loading_info else model


class MultiTaskBertInitMixin:
    """Put before `PreTrainedModel` in a BERT family's pre-trained base: transformers' init (Linear/Embedding
    N(0, initializer_range), LayerNorm 1 and 0), then BertEmbeddings' position-id and token-type buffers."""

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, BertEmbeddings):
            init.copy_(module.position_ids, torch.arange(module.position_ids.shape[-1]).expand((1, -1)))
            init.zeros_(module.token_type_ids)


class MultiTaskBertEncoderMixin:
    """The encoder models of the BERT families (`self.embeddings`, and `_encode` on checked inputs)."""

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        task_ids: torch.LongTensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPooling | tuple:
        """Encode a batch whose rows may belong to different tasks (`task_ids`, shape `(batch,)`)."""
        output = self._checked_encode(
            input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, task_ids,
            output_attentions, output_hidden_states, **kwargs,
        )
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        return output if return_dict else output.to_tuple()

    def get_input_embeddings(self):
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value):
        self.embeddings.word_embeddings = value

    def _embed(self, input_ids, token_type_ids, position_ids, inputs_embeds) -> torch.Tensor:
        """The start of every family's `_encode`: the BERT embeddings `(batch, seq, hidden)`."""
        return self.embeddings(
            input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids, inputs_embeds=inputs_embeds
        )

    def _run_layers(
        self, hidden, step: LayerStep, output_attentions=None, output_hidden_states=None
    ) -> LayerStackOutput:
        """`run_layer_stack` over `self.encoder.layer`, the output flags (`None`: the config's) resolved here."""
        config = self.config
        return run_layer_stack(
            self.encoder.layer,
            hidden,
            step,
            output_hidden_states=output_hidden_states
            if output_hidden_states is not None
            else config.output_hidden_states,
            output_attentions=output_attentions if output_attentions is not None else config.output_attentions,
        )

    def _encoder_output(
        self, stack: LayerStackOutput, attention_mask, output_class=BaseModelOutputWithPooling, **fields
    ):
        """The end of every family's `_encode`: `output_class` with the stack's states, the pooled sequence and the
        family's own `fields` (e.g. MoE routing)."""
        hidden = stack.last_hidden_state
        return output_class(
            last_hidden_state=hidden,
            pooler_output=pool_sequence(hidden, attention_mask, self.config.classifier_pooling, self.pooler),
            hidden_states=stack.hidden_states,
            attentions=stack.attentions,
            **fields,
        )

    def _checked_encode(
        self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, task_ids, *flags, **kwargs
    ):
        """`forward` of the encoder: check the input shapes and task ids, then `_encode`."""
        check_kwargs(kwargs, self.forward)
        batch, _ = check_input_shapes(
            input_ids, inputs_embeds, self.config.max_position_embeddings, attention_mask=attention_mask,
            token_type_ids=token_type_ids, position_ids=position_ids,
        )
        task_ids = resolve_task_ids(task_ids, batch, self.config.task_names, self.device)
        return self._encode(
            input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, task_ids, *flags, **kwargs
        )


class MultiTaskBertHeadsMixin(TaskHeadsMixin):
    """The task-level models of the BERT families: an encoder `self.bert` and `self.heads` (put before the family's
    `MultiTaskPreTrainedModel` base); the forward is `TaskHeadsMixin`'s."""

    def _init_heads(self, config) -> None:
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.heads = MultiTaskHeads(config.task_specs, config.hidden_size, dropout, config.scale_loss_by_num_classes)

    def get_input_embeddings(self):
        return self.bert.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.bert.set_input_embeddings(value)

    def _run_encoder(self, *args, **kwargs):
        """The BERT families' encoder on checked inputs: `self.bert._encode`."""
        return self.bert._encode(*args, **kwargs)
