"""CAMTLModel: CA-MTL (Pilault et al. 2021), a BERT modulated by a learned task embedding.

Layers compose transformers' BERT attention, intermediate and output modules (weight names equal
`BertLayer`'s, so a dense BERT loads one to one). A conditional layer adds the task's block-diagonal
matrix `M(z)` to the attention scores (through the additive attention mask) and normalises with
Conditional Layer Norms; the embeddings pass through the conditional alignment; the bottleneck sits in
the top layer (BASE) or runs alongside all layers (LARGE). Every conditional module starts as its
unconditioned counterpart (see `hf_taskmoe.layers.conditional`), and the bottom half of the layers and
the embeddings are frozen (appendix A.8).
"""

from __future__ import annotations

import os

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.models.bert.modeling_bert import (
    BertAttention,
    BertEmbeddings,
    BertIntermediate,
    BertOutput,
    BertPooler,
)

from ...contract import ParameterRoles
from ...layers.conditional import (
    BottleneckUp,
    ConditionalAlignment,
    ConditionalAttentionBias,
    ConditionalBottleneck,
    ConditionalLayerNorm,
    Conditioning,
    FiLM,
    padded_key_mask,
)
from ...modeling_utils import MultiTaskPreTrainedModel, grow_embedding, resolve_task_ids
from ...tasks import TaskSpec
from ..multitask_bert import (
    MultiTaskBertEncoderMixin,
    MultiTaskBertHeadsMixin,
    MultiTaskBertInitMixin,
    build_from_dense,
)
from .configuration_camtl import CAMTLConfig


def _norm(norm: nn.LayerNorm, hidden: torch.Tensor, cond: Conditioning | None) -> torch.Tensor:
    return norm(hidden, cond) if isinstance(norm, ConditionalLayerNorm) else norm(hidden)


#: CA-MTL's parameter roles, on BERT (`CAMTLModel`) and on any encoder (`CAMTLForMultiTask`): the task embeddings,
#: the conditional modules (FiLMs, attention bias, alignment, bottlenecks, the skip's) and the heads are task-specific
#: and new on upcycling; the conditional modules run for every row's task embedding, so only heads may sit idle
CAMTL_PARAMETER_ROLES = ParameterRoles(
    roles={
        "task_embedding": r"(^|\.)task_embeddings\.",
        "conditional": r"(\.film\.|\.attention_bias\.|(^|\.)alignment\.|\.bottleneck\.|(^|\.)skip\.)",
    },
    task_specific=("task_embedding", "conditional"),
    new=("task_embedding", "conditional"),
)


class CAMTLLayer(GradientCheckpointingLayer):
    """A BERT layer; in a conditional layer its LayerNorms are CLNs, the attention mask carries `M(z)` and a
    BASE bottleneck may run in parallel with the FFN (its output summed into the second LayerNorm)."""

    def __init__(self, config: CAMTLConfig, layer_idx: int):
        super().__init__()
        self.attention = BertAttention(config, layer_idx=layer_idx)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)
        conditional = layer_idx in config.conditional_layer_indices
        if conditional and config.conditional_layer_norm:
            self.attention.output.LayerNorm = ConditionalLayerNorm(
                config.hidden_size, config.task_dim, config.layer_norm_eps
            )
            self.output.LayerNorm = ConditionalLayerNorm(config.hidden_size, config.task_dim, config.layer_norm_eps)
        self.attention_bias = (
            ConditionalAttentionBias(config.conditional_attention_max_length, config.attention_blocks, config.task_dim)
            if conditional and config.conditional_attention
            else None
        )
        base = config.conditional_bottleneck == "base" and layer_idx in config.bottleneck_layer_indices
        self.bottleneck = (
            ConditionalBottleneck(
                config.hidden_size, config.bottleneck_size or config.hidden_size // 3, config.task_dim
            )
            if base
            else None
        )

    def forward(self, hidden_states, attention_mask, cond: Conditioning | None = None, **kwargs):
        context, attn_weights = self.attention.self(hidden_states, attention_mask, **kwargs)
        out = self.attention.output
        attention_output = _norm(out.LayerNorm, out.dropout(out.dense(context)) + hidden_states, cond)  # MHN(x)
        ffn = self.output.dropout(self.output.dense(self.intermediate(attention_output)))
        residual = attention_output
        if self.bottleneck is not None:
            residual = residual + self.bottleneck(attention_output, cond)
        return _norm(self.output.LayerNorm, ffn + residual, cond), attn_weights


class CAMTLEncoder(nn.Module):
    def __init__(self, config: CAMTLConfig):
        super().__init__()
        self.layer = nn.ModuleList([CAMTLLayer(config, i) for i in range(config.num_hidden_layers)])
        size = config.bottleneck_size or config.hidden_size // 3
        # LARGE: the skip connection alongside every layer (Figure 3b)
        self.skip = (
            nn.ModuleList(
                [
                    ConditionalBottleneck(config.hidden_size, size, config.task_dim)
                    for _ in range(config.num_hidden_layers)
                ]
            )
            if config.conditional_bottleneck == "large"
            else None
        )


class CAMTLPreTrainedModel(MultiTaskBertInitMixin, MultiTaskPreTrainedModel):
    config_class = CAMTLConfig
    base_model_prefix = "bert"
    supports_gradient_checkpointing = True
    _supports_sdpa = True  # M(z) travels as a float attention mask: eager and sdpa take it, flash attention cannot
    _supports_attention_backend = False
    _no_split_modules = ["BertEmbeddings", "CAMTLLayer"]
    accepts_loss_kwargs = False  # the loss is a per-batch mean
    _keys_to_ignore_at_inference = ["task_losses", "task_logits", "task_ids", "hidden_states", "attentions"]
    parameter_roles = CAMTL_PARAMETER_ROLES

    def _after_load(self) -> None:
        # loading creates the parameters anew: freeze again what the config says is frozen
        (self.bert if hasattr(self, "bert") else self).apply_freezing()

    @torch.no_grad()
    def _init_weights(self, module):
        # Linear/Embedding: N(0, initializer_range); LayerNorm: 1 and 0 (transformers' BERT init).
        super()._init_weights(module)
        config = self.config
        if isinstance(module, (FiLM, BottleneckUp)):
            init.zeros_(module.weight)  # gamma = 1, beta = 0; bottleneck adds 0: every module starts neutral
            init.zeros_(module.bias)
        elif isinstance(module, ConditionalAttentionBias):
            std = config.conditional_attention_init_std
            init.normal_(module.blocks, mean=0.0, std=config.initializer_range if std is None else std)
        elif isinstance(module, ConditionalAlignment):
            init.copy_(module.weight, torch.eye(module.weight.shape[0]))


class CAMTLBertModel(MultiTaskBertEncoderMixin, CAMTLPreTrainedModel):
    """The encoder of `CAMTLModel`: task embeddings, BERT embeddings, conditional alignment, layers, pooler."""

    def __init__(self, config: CAMTLConfig):
        super().__init__(config)
        self.task_embeddings = nn.Embedding(config.num_tasks, config.task_dim) if config.uses_task_embedding else None
        self.embeddings = BertEmbeddings(config)
        self.alignment = (
            ConditionalAlignment(config.hidden_size, config.task_dim) if config.conditional_alignment else None
        )
        self.encoder = CAMTLEncoder(config)
        self.pooler = BertPooler(config) if config.classifier_pooling == "pooler" else None
        self.post_init()
        self.apply_freezing()

    def first_layer_inputs(self, input_ids, attention_mask=None, token_type_ids=None, task_ids=None) -> torch.Tensor:
        """What the first transformer layer reads (embeddings after the conditional alignment): `(batch, seq, d)`.
        The inputs of the covariance similarity (eq. 7)."""
        hidden = self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids)
        if self.alignment is not None:
            task_ids = resolve_task_ids(task_ids, hidden.shape[0], self.config.task_names, self.device)
            # the conditioning `_encode` makes (rows gathered once): the same numbers as the forward, to the bit
            hidden = self.alignment(hidden, Conditioning.gathered(self.task_embeddings.weight, task_ids))
        return hidden

    def _encode(
        self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, task_ids,
        output_attentions=None, output_hidden_states=None, task_rows=None, **kwargs,
    ) -> BaseModelOutputWithPooling:
        """Forward on inputs already checked by the caller (`task_rows`: for PALs' grouping; unused here)."""
        hidden = self._embed(input_ids, token_type_ids, position_ids, inputs_embeds)  # (batch, seq, hidden)
        length = hidden.shape[1]
        table = self.task_embeddings.weight if self.task_embeddings is not None else None
        cond = Conditioning.gathered(table, task_ids) if table is not None else None  # rows gathered once
        if self.alignment is not None:
            hidden = self.alignment(hidden, cond)  # E(x) R^(z)
        mask = create_bidirectional_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask)
        skip = None  # LARGE bottleneck: s_j = CFF_j(h_j + s_{j-1}), alongside the layers
        # the padded keys of every conditional layer's mask, made once
        padded_keys = padded_key_mask(attention_mask) if attention_mask is not None else None

        def step(index, layer, hidden):
            nonlocal skip
            if layer.attention_bias is not None:  # softmax(M(z) + QK^T/sqrt(d) + padding mask)
                layer_mask = layer.attention_bias(cond, attention_mask, length, hidden.dtype, padded_keys)
            else:
                layer_mask = mask
            hidden, attention = layer(hidden, layer_mask, cond, **kwargs)
            if self.encoder.skip is not None:
                skip = self.encoder.skip[index](hidden if skip is None else hidden + skip, cond)
            return hidden, attention

        stack = self._run_layers(hidden, step, output_attentions, output_hidden_states)
        if skip is not None:  # the encoder's output is h_L + s_L
            stack = stack.with_last_hidden_state(stack.last_hidden_state + skip)
        return self._encoder_output(stack, attention_mask)

    def apply_freezing(self) -> None:
        """Freeze the embeddings (`freeze_embeddings`) and the BERT weights of the bottom `num_frozen_layers`
        layers (their conditional modules, if any, stay trainable)."""
        config = self.config
        if config.freeze_embeddings:
            self.embeddings.requires_grad_(False)
        for i in range(config.frozen_layers):
            layer = self.encoder.layer[i]
            for name, param in layer.named_parameters():
                if not any(part in name for part in (".film.", "attention_bias.", "bottleneck.")):
                    param.requires_grad_(False)


class CAMTLModel(MultiTaskBertHeadsMixin, CAMTLPreTrainedModel):
    """CA-MTL (Pilault et al. 2021): a BERT modulated by a learned task embedding, with one head per task.

    Build one from a dense BERT with `CAMTLModel.from_dense(...)`. Every conditional module starts as its
    unconditioned counterpart, so the fresh model computes the dense BERT up to the random conditional
    attention blocks (`conditional_attention_init_std=0` makes it exact). The embeddings and the bottom half
    of the layers are frozen at construction (`num_frozen_layers`, `freeze_embeddings`). Train it with
    `MultiTaskTrainer(..., args=MultiTaskTrainingArguments(task_sampling="uncertainty"))` for the paper's
    MT-Uncertainty sampling.

    Example:

    ```python
    >>> from hf_taskmoe import CAMTLModel, TaskSpec
    >>> tasks = [TaskSpec(name="sst2", num_labels=2), TaskSpec(name="stsb", problem_type="regression")]
    >>> model = CAMTLModel.from_dense("path/or/repo-of-a-bert", tasks=tasks)
    ```
    """

    def __init__(self, config: CAMTLConfig):
        super().__init__(config)
        self.bert = CAMTLBertModel(config)
        self._init_heads(config)
        self.post_init()

    # ------------------------------------------------------------------ tasks
    def max_input_length(self) -> int:
        """Conditional attention is built for `conditional_attention_max_length` tokens: longer inputs are refused."""
        limit = self.config.max_position_embeddings
        if self.config.conditional_attention:
            limit = min(limit, self.config.conditional_attention_max_length)
        return limit

    def _input_limit_name(self) -> str:
        c = self.config
        short = c.conditional_attention and c.conditional_attention_max_length < c.max_position_embeddings
        return "conditional_attention_max_length" if short else "max_position_embeddings"

    def _grow_for_task(self, new_id: int, source: int | None) -> None:
        """One more row in the task-embedding table (appendix A.4): task `source`'s, or drawn like at construction
        (`N(0, initializer_range)`). The conditional modules are shared, so nothing else grows."""
        if self.bert.task_embeddings is not None:
            self.bert.task_embeddings = grow_embedding(
                self.bert.task_embeddings, new_id, source, self.config.initializer_range
            )

    # ------------------------------------------------------------------ from a dense BERT
    @classmethod
    def from_dense(
        cls,
        dense: str | os.PathLike | PreTrainedModel,
        tasks: list[TaskSpec | dict],
        output_loading_info: bool = False,
        strict: bool = True,
        hub_kwargs: dict | None = None,
        **config_kwargs,
    ):
        """Keep a dense BERT's embeddings, layers (LayerNorms become the CLNs' `gamma'`, `beta'`) and pooler; add
        task embeddings, conditional modules and heads; freeze the bottom half. Args as in
        `BertForTaskMoE.from_dense`; `**config_kwargs` are fields of `CAMTLConfig`."""
        # the constructor froze the bottom layers; upcycling copies weights in place and keeps that
        return build_from_dense(cls, dense, tasks, output_loading_info, strict, hub_kwargs, **config_kwargs)
