"""TaskMoEForMultiTask: MT-TaG on any declared encoder, by wrapping the dense model's own FFNs.

The dense model (`AutoModel.from_config(config.dense_config)`) keeps every module but the feed-forward block of each
MoE layer, which becomes a `BackboneTaskMoE`: `num_experts` copies of that very FFN behind a task-aware or shared
gate. A split FFN (BERT, RoBERTa, XLM-R, ELECTRA, DeBERTa-v2) becomes an `ExpertBank` (transformers' experts layout
and interface: `up_proj`, `down_proj` and their biases, `config.experts_implementation` picks the implementation)
whose stacked projections are copies of `intermediate.dense` and `output.dense` (the latter then an identity inside
`output`, which still adds the residual and normalises; one expert: an `ExpertFFN` in `experts.0`); a whole FFN
module (DistilBERT's `ffn`, ModernBERT's gated `mlp`) is copied whole into each expert, and its experts run MT-TaG's
loop over the sorted tokens.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import initialization as init
from transformers.utils import ModelOutput

from ...backbones import Backbone, TaskContext, replace_module
from ...compat import experts_class_elsewhere
from ...contract import ParameterRoles
from ...layers.moe import (
    AUTO,
    EXPERT_BANK_WEIGHTS,
    SORTED,
    SORTED_IMPLEMENTATIONS,
    ExpertBank,
    ExpertFFN,
    MoEOutput,
    SharedGate,
    TaskGate,
    TaskMoE,
)
from ...modeling_utils import MultiTaskModelOutput, MultiTaskPreTrainedModel, heads_to_output_fields
from ..encoder import TaskEncoderMixin, layer_rule
from .configuration_task_moe import TaskMoEConfig


@dataclass
class TaskMoEEncoderOutput(ModelOutput):
    """What the encoder of `TaskMoEForMultiTask` gives its heads (`_run_encoder`).

    Args:
        last_hidden_state (`torch.FloatTensor` of shape `(batch, seq, hidden)`): last layer's output.
        pooler_output (`torch.FloatTensor` of shape `(batch, hidden)`): the sequence representation the heads
            read (`config.classifier_pooling`).
        hidden_states, attentions: the dense model's, when asked.
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
    """Output of `TaskMoEForMultiTask`: `MultiTaskModelOutput` plus the routing fields of `TaskMoEEncoderOutput`."""

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


class BackboneTaskMoE(TaskMoE):
    """A `TaskMoE` in the place of a dense model's FFN: called as the FFN was (hidden states in, hidden states out),
    it reads the batch's task ids from the model's `TaskContext` and reports its `MoEOutput` there."""

    task_conditioned = True  # initialised by the task model, not by the dense model's `_init_weights`

    def __init__(self, config, layer_idx: int, experts: ExpertBank | list[torch.nn.Module], context: TaskContext):
        super().__init__(config, layer_idx, experts)
        self.context = context

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        context = self.context
        out = super().forward(
            hidden_states, context.require_task_ids(), context.token_mask, context.flags.get("output_routing", False)
        )
        context.reports.append(out)
        return out.hidden_states

    def shared_tensor(self, key, make) -> torch.Tensor:
        """Made once per forward, by the first MoE layer that asks, and kept in the forward's context flags
        (`moe_shared`, emptied with the forward, restored with the flags when a checkpointed layer is recomputed)."""
        memo = self.context.flags.get("moe_shared")
        if memo is None:  # a context filled by other code than `TaskMoEForMultiTask`
            return make()
        value = memo.get(key)
        if value is None:
            value = memo[key] = make()
        return value


def ffn_experts(layer: torch.nn.Module, backbone: Backbone,
                config: TaskMoEConfig) -> ExpertBank | list[torch.nn.Module]:
    """`config.num_experts` copies of a layer's FFN; a split FFN's output projection becomes an identity in place,
    its experts an `ExpertBank` (one expert: an `ExpertFFN`)."""
    site, num_experts = backbone.ffn, config.num_experts
    if site.split:
        w_in, act, w_out = (layer.get_submodule(p) for p in (site.w_in, site.act, site.w_out))
        replace_module(layer, site.w_out, torch.nn.Identity())
        if num_experts == 1:
            return [ExpertFFN.copy_of(w_in, act, w_out)]
        return ExpertBank.copy_of(config, w_in, act, w_out, num_experts)
    ffn = layer.get_submodule(site.module)
    return [copy.deepcopy(ffn) for _ in range(num_experts)]


class TaskMoEForMultiTask(TaskEncoderMixin, MultiTaskPreTrainedModel):
    """MT-TaG (task-aware gates), MT-Switch (`gating="shared"`) or MT-Dense (`num_experts=1`) on a dense encoder of
    any declared architecture, with one head per task. Build one with `TaskMoEForMultiTask.from_dense(checkpoint,
    tasks, num_experts=4)`; it loads with `AutoModel` after `import hf_taskmoe`. Its `forward` is the heads' forward
    (`TaskHeadsMixin.forward`, `hf_taskmoe.models.encoder`) plus `output_router_logits=True`: also return the router
    logits, chosen experts and per-task routing counts.

    Example:

    ```python
    >>> from hf_taskmoe import TaskMoEForMultiTask, TaskSpec
    >>> tasks = [TaskSpec(name="sst2", num_labels=2), TaskSpec(name="stsb", problem_type="regression")]
    >>> model = TaskMoEForMultiTask.from_dense("path/to/a-roberta", tasks=tasks, num_experts=4)
    ```
    """

    config_class = TaskMoEConfig
    records_task_order = True
    encoder_output_class = TaskMoEEncoderOutput
    _keys_to_ignore_at_inference = [
        "task_losses", "task_logits", "task_ids", "hidden_states", "attentions", "router_logits", "expert_indices",
        "routing_counts", "aux_loss", "z_loss",
    ]
    parameter_roles = ParameterRoles(
        roles={"expert": r"\.experts\.", "gating": r"\.router\."}, task_specific=("gating",), new=("gating",)
    )
    stacked_weights = EXPERT_BANK_WEIGHTS
    # `config.experts_implementation` is settable (`from_pretrained`, `set_experts_implementation`): the experts class
    # declared with `use_experts_implementation` is `hf_taskmoe.layers.moe.ExpertBank`
    _can_set_experts_implementation = experts_class_elsewhere()

    def __init__(self, config: TaskMoEConfig):
        super().__init__(config)
        self._build_backbone(config)
        self.post_init()

    family_flags = ("output_router_logits",)

    def _task_output(self, task_ids, encoded: TaskMoEEncoderOutput, heads_out) -> TaskMoEOutput:
        """The heads' output, the routing fields and, with a loss, the router's auxiliary losses weighted into it."""
        loss = heads_out.loss
        if loss is not None:
            if encoded.aux_loss is not None:
                loss = loss + self.config.router_aux_loss_coef * encoded.aux_loss
            if encoded.z_loss is not None:
                loss = loss + self.config.router_z_loss_coef * encoded.z_loss
        routing = ("router_logits", "expert_indices", "routing_counts", "aux_loss", "z_loss")
        return TaskMoEOutput(loss=loss, task_ids=task_ids, hidden_states=encoded.hidden_states,
                             attentions=encoded.attentions, **{name: getattr(encoded, name) for name in routing},
                             **heads_to_output_fields(heads_out))

    # ------------------------------------------------------------------ tasks
    def _grow_for_task(self, new_id: int, source: int | None) -> None:
        """MT-TaG section 5.2: with task-aware gating, a gate per MoE layer copied from the related task `source`
        (or drawn from N(0, router_init_std)); the shared gate of MT-Switch serves the new task as it is."""
        for moe in self.moe_layers():
            moe.add_task(source, self.config.router_init_std)

    def moe_layers(self) -> list[TaskMoE]:
        """Every layer's `TaskMoE` (a dense layer's too: one expert, no gate), in layer order."""
        return [module for module in self.modules() if isinstance(module, TaskMoE)]

    def _wrap_backbone(self, config: TaskMoEConfig, backbone: Backbone, layers) -> None:
        for index in config.moe_layer_indices:
            layer = layers[index]
            experts = ffn_experts(layer, backbone, config)
            replace_module(layer, backbone.ffn.module, BackboneTaskMoE(config, index, experts, self.task_context))

    def get_correct_experts_implementation(self, requested_experts: str | None) -> str:
        """transformers' check of `experts_implementation`, and MT-TaG's: experts that are whole FFN modules
        (DistilBERT, ModernBERT) run MT-TaG's own loop only."""
        if (requested_experts not in (None, AUTO, *SORTED_IMPLEMENTATIONS) and self.config.num_experts > 1
                and not self.config.backbone.ffn.split):
            raise ValueError(
                f"`experts_implementation={requested_experts!r}` runs stacked two-projection experts; a "
                f"{self.config.backbone.model_type} FFN is a whole module, whose experts are copies of it and run "
                f"MT-TaG's loop over the sorted tokens: use '{AUTO}' (the default) or '{SORTED}'."
            )
        return super().get_correct_experts_implementation(requested_experts)

    def _dense_rules(self):
        backbone = self.config.backbone
        site = backbone.ffn
        if site.split:
            return (
                # stacked experts (`experts.up_proj`, `experts.up_proj_bias`: every slice a copy) or one
                # (`experts.0.w_in.*`)
                *(
                    layer_rule(backbone, rf"{site.module}\.experts\.{proj}{suffix}", f"{path}.{kind}")
                    for proj, path in (("up_proj", site.w_in), ("down_proj", site.w_out))
                    for suffix, kind in (("", "weight"), ("_bias", "bias"))
                ),
                layer_rule(backbone, rf"{site.module}\.experts\.0\.w_in\.(.+)", rf"{site.w_in}.\2"),
                layer_rule(backbone, rf"{site.module}\.experts\.0\.w_out\.(.+)", rf"{site.w_out}.\2"),
            )
        return (layer_rule(backbone, rf"{site.module}\.experts\.\d+\.(.+)", rf"{site.module}.\2"),)

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, (TaskGate, SharedGate)):
            init.normal_(module.weight, mean=0.0, std=self.config.router_init_std)  # MT-TaG 4.4: N(0, 0.001)
        elif isinstance(module, ExpertBank):  # the dense model's Linear init, per expert
            module.init_weights(getattr(self.config.dense_config, "initializer_range", 0.02))

    def _context_flags(self, output_router_logits=None) -> dict:
        # `moe_shared`: what every MoE layer of the forward would derive alike (`BackboneTaskMoE.shared_tensor`)
        return {"output_routing": bool(output_router_logits), "moe_shared": {}}

    def _encoder_fields(self, reports, output_router_logits=None) -> dict:
        return moe_encoder_fields(reports, bool(output_router_logits))

    @classmethod
    def from_dense(cls, dense, tasks, num_experts: int = 4, gating: str = "task",
                   expert_weighting: str = "straight_through", output_loading_info: bool = False, strict: bool = True,
                   hub_kwargs: dict | None = None, **config_kwargs):
        """Upcycle a dense encoder checkpoint (MT-TaG section 4.3) of any declared architecture: every FFN of an MoE
        layer is copied into each of its `num_experts` experts, everything else is the dense model's own weights;
        gates N(0, router_init_std), heads the architecture's initialisation. With straight-through weighting (the
        default) the new model computes exactly what the dense model computed."""
        return super().from_dense(
            dense, tasks, output_loading_info=output_loading_info, strict=strict, hub_kwargs=hub_kwargs,
            num_experts=num_experts, gating=gating, expert_weighting=expert_weighting, **config_kwargs,
        )
