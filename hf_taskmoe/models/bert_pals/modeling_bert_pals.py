"""BertWithPALs: BERT with task-specific Projected Attention Layers (PALs paper, section 3.2, eq. 6-7).

Each layer is transformers' BERT attention + intermediate + output, composed; the output's residual
input becomes `MultiHeadNorm(x) + GELU(PAL_{l,t}(x))`, so BERT's second LayerNorm sees
`MHN(x) + FFN(MHN(x)) + g(PAL_{l,t}(x))` exactly as in eq. 7. The PALs live in one module at the model
level because `E_t`/`D_t` are shared by all layers.
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
from ...layers.pals import (
    PAL_WEIGHTS,
    PALAttention,
    PALDecoder,
    ProjectedAttentionLayers,
    pal_key_mask,
)
from ...modeling_utils import MultiTaskPreTrainedModel
from ...tasks import TaskSpec
from ..multitask_bert import (
    MultiTaskBertEncoderMixin,
    MultiTaskBertHeadsMixin,
    MultiTaskBertInitMixin,
    build_from_dense,
)
from .configuration_bert_pals import BertPALsConfig


class PALBertLayer(GradientCheckpointingLayer):
    """A BERT layer whose second residual also receives `GELU(PAL(x))` (eq. 7). Weight names match
    transformers' `BertLayer`, so a dense BERT's layers load one to one."""

    def __init__(self, config: BertPALsConfig, layer_idx: int):
        super().__init__()
        self.attention = BertAttention(config, layer_idx=layer_idx)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(self, hidden_states, attention_mask, pal_output=None, **kwargs):
        attention_output, attn_weights = self.attention(hidden_states, attention_mask, **kwargs)  # MHN(x)
        residual = attention_output if pal_output is None else attention_output + pal_output
        # BertOutput: LN_2(dropout(FFN(MHN(x))) + residual)
        return self.output(self.intermediate(attention_output), residual), attn_weights


class PALBertEncoder(nn.Module):
    def __init__(self, config: BertPALsConfig):
        super().__init__()
        self.layer = nn.ModuleList([PALBertLayer(config, i) for i in range(config.num_hidden_layers)])


class BertPALsPreTrainedModel(MultiTaskBertInitMixin, MultiTaskPreTrainedModel):
    config_class = BertPALsConfig
    base_model_prefix = "bert"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _no_split_modules = ["BertEmbeddings", "PALBertLayer"]
    accepts_loss_kwargs = False  # the loss is a per-batch mean
    _keys_to_ignore_at_inference = ["task_losses", "task_logits", "task_ids", "hidden_states", "attentions"]
    # Trained alone by the paper's best extension (section 3.4: task-specific training after joint training).
    # absent tasks' heads and PALs sit out a step
    stacked_weights = PAL_WEIGHTS  # query / key / value of earlier checkpoints load into the fused `qkv`
    parameter_roles = ParameterRoles(
        roles={"pal": r"(^|\.)pals\."}, task_specific=("pal",), possibly_idle=("pal", "head"), new=("pal",)
    )

    @torch.no_grad()
    def _init_weights(self, module):
        # Linear/Embedding: N(0, initializer_range); LayerNorm: 1 and 0 (transformers' BERT init).
        super()._init_weights(module)
        if isinstance(module, PALDecoder) and self.config.pal_decoder_init == "zeros":
            init.zeros_(module.weight)  # GELU(D_t(...)) = 0: the fresh model is the dense one
        elif isinstance(module, BertPALsModel):
            init.copy_(module.task_to_group, torch.tensor(self.config.task_group_ids, dtype=torch.long))


class BertPALsModel(MultiTaskBertEncoderMixin, BertPALsPreTrainedModel):
    """The encoder of `BertWithPALs`: BERT embeddings, layers with PALs, optional pooler."""

    def __init__(self, config: BertPALsConfig):
        super().__init__(config)
        self.embeddings = BertEmbeddings(config)
        self.encoder = PALBertEncoder(config)
        self.pals = ProjectedAttentionLayers(
            config.hidden_size, config.pal_size, config.pal_num_heads, max(config.task_group_ids) + 1,
            config.pal_layer_indices, config.pal_attention_dropout_rate,
        )
        self.pooler = BertPooler(config) if config.classifier_pooling == "pooler" else None
        self.register_buffer("task_to_group", torch.tensor(config.task_group_ids, dtype=torch.long), persistent=False)
        self.post_init()

    def _encode(
        self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, task_ids,
        output_attentions=None, output_hidden_states=None, task_rows=None, **kwargs,
    ) -> BaseModelOutputWithPooling:
        """Forward on inputs already checked by the caller. Every row runs through its own group's PALs at once
        (batched across groups: no host sync and no shape that depends on the mix, as export needs). With
        `task_rows` (`{task id: batch rows}`, from the heads' `split_rows`) the groups present are known: only their
        PALs take part (an absent group's get no gradient), and a batch of one group runs its PALs unbatched."""
        hidden = self._embed(input_ids, token_type_ids, position_ids, inputs_embeds)  # (batch, seq, hidden)
        mask = create_bidirectional_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask)
        key_mask = pal_key_mask(attention_mask, mask, hidden.dtype)  # additive, made once for every layer
        group_rows = None
        if self.pals.layers:  # one group's PALs on the batch, batched across the groups present, or per group
            group_rows = self.pals.plan(self.task_to_group.index_select(0, task_ids), task_rows,
                                        self.config.task_group_ids, self.config.pal_dispatch)

        def step(index, layer, hidden):
            pal = self.pals(hidden, index, group_rows, key_mask) if self.pals.has_layer(index) else None
            return layer(hidden, mask, pal, **kwargs)

        stack = self._run_layers(hidden, step, output_attentions, output_hidden_states)
        return self._encoder_output(stack, attention_mask)


class BertWithPALs(MultiTaskBertHeadsMixin, BertPALsPreTrainedModel):
    """BERT + Projected Attention Layers (Stickland & Murray 2019) with one head per task.

    Build one from a dense BERT with `BertWithPALs.from_dense(...)`: with the default `pal_decoder_init="zeros"`
    the fresh model computes exactly what the dense BERT computes (every PAL adds `GELU(0) = 0`), and
    training grows the PALs from there.

    Example:

    ```python
    >>> from hf_taskmoe import BertWithPALs, TaskSpec
    >>> tasks = [TaskSpec(name="sst", num_labels=5), TaskSpec(name="qqp", num_labels=2),
    ...          TaskSpec(name="sts", problem_type="regression")]
    >>> model = BertWithPALs.from_dense("path/or/repo-of-a-bert", tasks=tasks, pal_size=204,
    ...                                 pal_task_groups=[["qqp", "sts"]])
    ```
    """

    def __init__(self, config: BertPALsConfig):
        super().__init__(config)
        self.bert = BertPALsModel(config)
        self._init_heads(config)
        self.post_init()

    # ------------------------------------------------------------------ tasks
    def _grow_for_task(self, new_id: int, source_task: int | None) -> None:
        """PALs of the new task's own (a new group): copies of task `source_task`'s group, or initialised like at
        construction (`D = 0` by default)."""
        pals, config = self.bert.pals, self.config
        source = config.task_group_ids[source_task] if source_task is not None else None
        new_modules = [
            nn.Linear(config.hidden_size, config.pal_size, bias=False),
            PALDecoder(config.pal_size, config.hidden_size),
        ]
        pals.encoders.append(new_modules[0])
        pals.decoders.append(new_modules[1])
        for layer in pals.layers:
            attention = PALAttention(config.pal_size, config.pal_num_heads, config.pal_attention_dropout_rate)
            pals.attention[str(layer)].append(attention)
            new_modules.append(attention)
        group = pals.num_groups - 1
        dtype = pals.encoders[0].weight.dtype
        with torch.no_grad():
            for module in new_modules:
                module.to(self.device, dtype).train(self.training)
                module.apply(self._init_weights)
            if source is not None:
                for modules in (pals.encoders, pals.decoders):
                    modules[group].load_state_dict(modules[source].state_dict())
                for layer in pals.layers:
                    pals.attention[str(layer)][group].load_state_dict(pals.attention[str(layer)][source].state_dict())
        self.bert.task_to_group = torch.tensor(config.task_group_ids, dtype=torch.long, device=self.device)

    # ------------------------------------------------------------------ from a dense BERT
    @classmethod
    def from_dense(
        cls,
        dense: str | os.PathLike | PreTrainedModel,
        tasks: list[TaskSpec | dict],
        pal_size: int = 204,
        output_loading_info: bool = False,
        strict: bool = True,
        hub_kwargs: dict | None = None,
        **config_kwargs,
    ):
        """Keep a dense BERT's embeddings, layers and pooler; add PALs and heads.

        With `pal_decoder_init="zeros"` (the default) the new model's encoder computes exactly the dense
        model's hidden states. Args as in `BertForTaskMoE.from_dense`; `pal_size` and `**config_kwargs` are
        fields of `BertPALsConfig` (`pal_num_heads`, `pal_layers`, `pal_task_groups`, ...).
        """
        return build_from_dense(
            cls, dense, tasks, output_loading_info, strict, hub_kwargs, pal_size=pal_size, **config_kwargs
        )
