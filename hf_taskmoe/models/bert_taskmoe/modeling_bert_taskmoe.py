"""BertForTaskMoE: BERT whose FFNs are mixtures of experts with task-aware gates (MT-TaG).

Embeddings, attention and pooler are transformers' own BERT modules (composed, not copied); only the
feed-forward block changes: `TaskMoE` (experts + router) followed by BERT's dropout/residual/LayerNorm.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.bert.modeling_bert import BertAttention, BertEmbeddings, BertPooler
from transformers.utils import ModelOutput

from ...contract import ParameterRoles
from ...layers.moe import EXPERT_BANK_WEIGHTS, ExpertBank, MoEOutput, SharedGate, TaskGate, TaskMoE
from ...modeling_utils import MultiTaskModelOutput, MultiTaskPreTrainedModel, heads_to_output_fields
from ...tasks import TaskSpec
from ..multitask_bert import (
    MultiTaskBertEncoderMixin,
    MultiTaskBertHeadsMixin,
    MultiTaskBertInitMixin,
    build_from_dense,
)
from .configuration_bert_taskmoe import BertTaskMoEConfig


@dataclass
class TaskMoEEncoderOutput(ModelOutput):
    """Output of `BertTaskMoEModel`.

    Args:
        last_hidden_state (`torch.FloatTensor` of shape `(batch, seq, hidden)`): last layer's output.
        pooler_output (`torch.FloatTensor` of shape `(batch, hidden)`): the sequence representation the heads
            read (`config.classifier_pooling`).
        hidden_states, attentions: as in transformers' `BertModel`, when asked.
        router_logits (`tuple(torch.FloatTensor)`, when `output_router_logits=True`): per MoE layer,
            `(batch, seq, num_experts)` fp32 gate logits.
        expert_indices (`tuple(torch.LongTensor)`, when `output_router_logits=True`): per MoE layer,
            `(batch, seq, top_k)` chosen experts.
        routing_counts (`torch.LongTensor` of shape `(num_moe_layers, num_tasks, num_experts)`, when
            `output_router_logits=True`): real (non-padding) tokens each expert received, per task and layer.
        aux_loss / z_loss (`torch.FloatTensor` of shape `()`): mean over MoE layers of the load-balancing /
            router z-loss, when the config's coefficient is set.
    """

    last_hidden_state: torch.FloatTensor | None = None
    pooler_output: torch.FloatTensor | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    attentions: tuple[torch.FloatTensor, ...] | None = None
    router_logits: tuple[torch.FloatTensor, ...] | None = None
    expert_indices: tuple[torch.LongTensor, ...] | None = None
    routing_counts: torch.LongTensor | None = None
    aux_loss: torch.FloatTensor | None = None
    z_loss: torch.FloatTensor | None = None


@dataclass
class TaskMoEOutput(MultiTaskModelOutput):
    """Output of `BertForTaskMoE`: `MultiTaskModelOutput` plus the routing fields of `TaskMoEEncoderOutput`."""

    router_logits: tuple[torch.FloatTensor, ...] | None = None
    expert_indices: tuple[torch.LongTensor, ...] | None = None
    routing_counts: torch.LongTensor | None = None
    aux_loss: torch.FloatTensor | None = None
    z_loss: torch.FloatTensor | None = None


def moe_encoder_fields(moe_outputs: list[MoEOutput], routed: bool) -> dict:
    """The routing fields of `TaskMoEEncoderOutput` from each layer's `MoEOutput` (dense layers route nothing):
    router logits, chosen experts and per-task counts when `routed`; the mean aux and z losses when computed."""
    moe_layers = [moe for moe in moe_outputs if moe.router_logits is not None]
    aux = [moe.aux_loss for moe in moe_layers if moe.aux_loss is not None]
    z = [moe.z_loss for moe in moe_layers if moe.z_loss is not None]
    return dict(
        router_logits=tuple(moe.router_logits for moe in moe_layers) if routed else None,
        expert_indices=tuple(moe.expert_index for moe in moe_layers) if routed else None,
        routing_counts=torch.stack([moe.routing_counts for moe in moe_layers]) if routed and moe_layers else None,
        aux_loss=torch.stack(aux).mean() if aux else None,
        z_loss=torch.stack(z).mean() if z else None,
    )


class TaskMoEBertLayer(GradientCheckpointingLayer):
    """BERT layer: self-attention, then `LayerNorm(dropout(MoE(a)) + a)`."""

    def __init__(self, config: BertTaskMoEConfig, layer_idx: int):
        super().__init__()
        self.attention = BertAttention(config, layer_idx=layer_idx)
        self.mlp = TaskMoE(config, layer_idx)
        self.ffn_dropout = nn.Dropout(config.hidden_dropout_prob)
        self.ffn_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask, task_ids, token_mask=None, output_routing=False, **kwargs):
        attention_output, attn_weights = self.attention(hidden_states, attention_mask, **kwargs)
        moe = self.mlp(attention_output, task_ids, token_mask, output_routing)
        layer_output = self.ffn_norm(self.ffn_dropout(moe.hidden_states) + attention_output)
        return layer_output, attn_weights, moe


class TaskMoEBertEncoder(nn.Module):
    def __init__(self, config: BertTaskMoEConfig):
        super().__init__()
        self.layer = nn.ModuleList([TaskMoEBertLayer(config, i) for i in range(config.num_hidden_layers)])


class BertTaskMoEPreTrainedModel(MultiTaskBertInitMixin, MultiTaskPreTrainedModel):
    config_class = BertTaskMoEConfig
    base_model_prefix = "bert"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _no_split_modules = ["BertEmbeddings", "TaskMoEBertLayer"]
    stacked_weights = EXPERT_BANK_WEIGHTS
    # The loss is a per-batch mean: the Trainer must not pass `num_items_in_batch` into forward.
    accepts_loss_kwargs = False
    # Output fields that are not predictions (the Trainer's default prediction step skips them).
    _keys_to_ignore_at_inference = [
        "task_losses", "task_logits", "task_ids", "hidden_states", "attentions", "router_logits", "expert_indices",
        "routing_counts", "aux_loss", "z_loss",
    ]
    # Trained alone by the PALs-style second stage (`freeze_shared_parameters`).
    # Only heads sit out a step (experts without tokens still run on an empty slice); the task gates are new.
    parameter_roles = ParameterRoles(
        roles={"expert": r"\.mlp\.experts\.", "gating": r"\.mlp\.router\."},
        task_specific=("gating",),
        new=("gating",),
    )

    @torch.no_grad()
    def _init_weights(self, module):
        # Linear/Embedding: N(0, initializer_range) (heads: N(0, 0.02) in the paper); LayerNorm: 1 and 0.
        super()._init_weights(module)
        if isinstance(module, (TaskGate, SharedGate)):
            init.normal_(module.weight, mean=0.0, std=self.config.router_init_std)  # paper 4.4: N(0, 0.001)
        elif isinstance(module, ExpertBank):  # BERT's Linear init, per expert
            module.init_weights(self.config.initializer_range)


class BertTaskMoEModel(MultiTaskBertEncoderMixin, BertTaskMoEPreTrainedModel):
    """The encoder of `BertForTaskMoE`: BERT embeddings, MoE layers, optional pooler."""

    def __init__(self, config: BertTaskMoEConfig):
        super().__init__(config)
        self.embeddings = BertEmbeddings(config)
        self.encoder = TaskMoEBertEncoder(config)
        self.pooler = BertPooler(config) if config.classifier_pooling == "pooler" else None
        self.post_init()

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
        output_router_logits: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> TaskMoEEncoderOutput | tuple:
        output = self._checked_encode(
            input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, task_ids,
            output_attentions, output_hidden_states, output_router_logits, **kwargs,
        )
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        return output if return_dict else output.to_tuple()

    def _encode(
        self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, task_ids,
        output_attentions=None, output_hidden_states=None, output_router_logits=None, task_rows=None, **kwargs,
    ) -> TaskMoEEncoderOutput:
        """Forward on inputs already checked by the caller (`task_rows`: for PALs' grouping; unused here)."""
        hidden = self._embed(input_ids, token_type_ids, position_ids, inputs_embeds)  # (batch, seq, hidden)
        mask = create_bidirectional_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask)
        # the MoE layers' routing statistics leave padding out; dense layers (MT-Dense) read no mask
        routes = bool(self.config.moe_layer_indices)
        token_mask = attention_mask.bool() if attention_mask is not None and routes else None
        routed = bool(output_router_logits)
        moe_outputs = []  # each layer's `MoEOutput`

        def step(index, layer, hidden):
            hidden, attention, moe = layer(hidden, mask, task_ids, token_mask, routed, **kwargs)
            moe_outputs.append(moe)
            return hidden, attention

        stack = self._run_layers(hidden, step, output_attentions, output_hidden_states)
        fields = moe_encoder_fields(moe_outputs, routed)
        return self._encoder_output(stack, attention_mask, TaskMoEEncoderOutput, **fields)


class TaskMoEHeadsMixin:
    """The task model's forward of MT-TaG on any encoder (`BertForTaskMoE`, `TaskMoEForMultiTask`): the heads' loss
    plus the weighted router losses, and the routing fields. Put before the heads mixin."""

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
        output_router_logits: bool | None = None,
        return_dict: bool | None = None,
        values_checked: bool = False,
        task_counts: tuple[int, ...] | None = None,
        **kwargs,
    ) -> TaskMoEOutput | tuple:
        r"""
        task_ids (`torch.LongTensor` of shape `(batch,)`):
            Index into `config.tasks` of each row; a batch may mix tasks. Optional for a one-task model.
        labels (`torch.Tensor` of shape `(batch,)` or `(batch, width)`):
            Per-row labels in the format of each row's task (see `hf_taskmoe.layers.heads`).
        span_positions (`torch.LongTensor` of shape `(batch, num_spans, 2)`):
            Token start/end (exclusive) of each word span, for span-classification tasks.
        output_router_logits (`bool`):
            Also return router logits, chosen experts and per-task routing counts.
        values_checked (`bool`, *optional*, defaults to `False`):
            The batch's values (task ids, labels, spans) were checked on the host where it was made (`BatchChecker`):
            the forward skips those checks and gives the same results; as in `MultiTaskBertHeadsMixin.forward`
            (`hf_taskmoe.models.multitask_bert`), which says what an eager and a captured forward then read back.
        task_counts (`tuple[int, ...]`, *optional*):
            The rows of each task in the batch, counted on the host where it was made (`BatchChecker.check`): with
            `values_checked` the heads split the batch by them and nothing is read back from the device; as in
            `MultiTaskBertHeadsMixin.forward`.
        """
        task_ids, encoded, heads_out = self._encode_and_score(
            input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, task_ids, labels, span_positions,
            output_attentions, output_hidden_states, output_router_logits, values_checked=values_checked,
            task_counts=task_counts, **kwargs,
        )
        loss = heads_out.loss
        if loss is not None:
            if encoded.aux_loss is not None:
                loss = loss + self.config.router_aux_loss_coef * encoded.aux_loss
            if encoded.z_loss is not None:
                loss = loss + self.config.router_z_loss_coef * encoded.z_loss
        output = TaskMoEOutput(
            loss=loss,
            task_ids=task_ids,
            hidden_states=encoded.hidden_states,
            attentions=encoded.attentions,
            router_logits=encoded.router_logits,
            expert_indices=encoded.expert_indices,
            routing_counts=encoded.routing_counts,
            aux_loss=encoded.aux_loss,
            z_loss=encoded.z_loss,
            **heads_to_output_fields(heads_out),
        )
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        return output if return_dict else output.to_tuple()

    # ------------------------------------------------------------------ tasks
    def _grow_for_task(self, new_id: int, source: int | None) -> None:
        """MT-TaG section 5.2: with task-aware gating, a gate per MoE layer copied from the related task `source`
        (or drawn from N(0, router_init_std)); the shared gate of MT-Switch serves the new task as it is."""
        for moe in self.moe_layers():
            moe.add_task(source, self.config.router_init_std)

    def moe_layers(self) -> list[TaskMoE]:
        """Every layer's `TaskMoE` (a dense layer's too: one expert, no gate), in layer order."""
        return [module for module in self.modules() if isinstance(module, TaskMoE)]



class BertForTaskMoE(TaskMoEHeadsMixin, MultiTaskBertHeadsMixin, BertTaskMoEPreTrainedModel):
    """MT-TaG: a BERT/MiniLM encoder with task-aware mixture-of-experts FFNs and one head per task.

    `config.gating="shared"` gives MT-Switch, `config.num_experts=1` MT-Dense. Build one from a dense
    checkpoint with `BertForTaskMoE.from_dense(...)`, or load a saved one with `from_pretrained`.

    Example:

    ```python
    >>> from hf_taskmoe import BertForTaskMoE, TaskSpec
    >>> tasks = [TaskSpec(name="sst2", num_labels=2), TaskSpec(name="stsb", problem_type="regression")]
    >>> model = BertForTaskMoE.from_dense("path/or/repo-of-a-bert", tasks=tasks, num_experts=4)
    >>> out = model(**tokenizer(["a fine film", "a bad one"], return_tensors="pt"),
    ...             task_ids=model.task_ids_for(["sst2", "stsb"]))
    ```
    """

    def __init__(self, config: BertTaskMoEConfig):
        super().__init__(config)
        self.bert = BertTaskMoEModel(config)
        self._init_heads(config)
        self.post_init()

    # ------------------------------------------------------------------ upcycling
    @classmethod
    def from_dense(
        cls,
        dense: str | os.PathLike | PreTrainedModel,
        tasks: list[TaskSpec | dict],
        num_experts: int = 4,
        gating: str = "task",
        expert_weighting: str = "straight_through",
        output_loading_info: bool = False,
        strict: bool = True,
        hub_kwargs: dict | None = None,
        **config_kwargs,
    ):
        """Upcycle a dense BERT checkpoint (MT-TaG section 4.3).

        Embeddings, attention, layer norms and pooler are copied; every FFN is copied into each of its
        layer's `num_experts` experts; gates are drawn from N(0, router_init_std) and heads from
        N(0, initializer_range). `expert_weighting="straight_through"` (the default here) makes the new model
        compute exactly what the dense model computed; `"gate"` is the paper's `g* E*(x)`, which scales every
        FFN output by about 1/N at the start. On the demo mixture straight-through upcycling scored 80.2 vs
        75.1 average (docs/mt-tag.md, "Upcycling").

        Args:
            dense: a path or Hub repo id of a BERT checkpoint (any BERT head model works: its encoder is
                used), or a loaded `BertModel`/`Bert*For*` model.
            tasks: the tasks (`TaskSpec`s or dicts).
            num_experts, gating, expert_weighting, **config_kwargs: fields of `BertTaskMoEConfig`.
            output_loading_info: also return the `UpcyclingReport` (copied / new / unused weights).
            strict: raise when a weight of the new model that should come from the checkpoint is missing.
            hub_kwargs: passed to `AutoModel.from_pretrained` when `dense` is a path or repo id
                (`revision`, `cache_dir`, `local_files_only`, `token`, ...).
        """
        return build_from_dense(
            cls, dense, tasks, output_loading_info, strict, hub_kwargs, num_experts=num_experts, gating=gating,
            expert_weighting=expert_weighting, **config_kwargs,
        )
