"""TaskMoEForMultiTask: MT-TaG on any declared encoder, by wrapping the dense model's own FFNs.

The dense model (`AutoModel.from_config(config.dense_config)`) keeps every module but the feed-forward block of each
MoE layer, which becomes a `BackboneTaskMoE`: `num_experts` copies of that very FFN behind a task-aware or shared
gate. A split FFN (BERT, RoBERTa, XLM-R, ELECTRA, DeBERTa-v2) becomes an `ExpertBank` whose stacked projections are
copies of `intermediate.dense` and `output.dense` (the latter then an identity inside `output`, which still adds the
residual and normalises; one expert: an `ExpertFFN` in `experts.0`); a whole FFN module (DistilBERT's `ffn`,
ModernBERT's gated `mlp`) is copied whole into each expert.
"""

from __future__ import annotations

import torch
from transformers import initialization as init

from ...backbones import Backbone, TaskContext, replace_module
from ...contract import ParameterRoles
from ...layers.moe import EXPERT_BANK_WEIGHTS, ExpertBank, ExpertFFN, SharedGate, TaskGate, TaskMoE
from ...modeling_utils import MultiTaskPreTrainedModel
from ..backbone_encoder import BackboneTaskMixin, layer_rule
from ..bert_taskmoe.modeling_bert_taskmoe import TaskMoEEncoderOutput, TaskMoEHeadsMixin, moe_encoder_fields
from .configuration_task_moe import TaskMoEConfig


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


def ffn_experts(layer: torch.nn.Module, backbone: Backbone, num_experts: int) -> ExpertBank | list[torch.nn.Module]:
    """`num_experts` copies of a layer's FFN; a split FFN's output projection becomes an identity in place, its
    experts an `ExpertBank` (one expert: an `ExpertFFN`)."""
    site = backbone.ffn
    if site.split:
        w_in, act, w_out = (layer.get_submodule(p) for p in (site.w_in, site.act, site.w_out))
        replace_module(layer, site.w_out, torch.nn.Identity())
        if num_experts == 1:
            return [ExpertFFN.copy_of(w_in, act, w_out)]
        return ExpertBank.copy_of(w_in, act, w_out, num_experts)
    import copy

    ffn = layer.get_submodule(site.module)
    return [copy.deepcopy(ffn) for _ in range(num_experts)]


class TaskMoEForMultiTask(TaskMoEHeadsMixin, BackboneTaskMixin, MultiTaskPreTrainedModel):
    """MT-TaG (task-aware gates), MT-Switch (`gating="shared"`) or MT-Dense (`num_experts=1`) on a dense encoder of
    any declared architecture, with one head per task. Build one with `TaskMoEForMultiTask.from_dense(checkpoint,
    tasks, num_experts=4)`; it loads with `AutoModel` after `import hf_taskmoe`.

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

    def __init__(self, config: TaskMoEConfig):
        super().__init__(config)
        self._build_backbone(config)
        self.post_init()

    def _wrap_backbone(self, config: TaskMoEConfig, backbone: Backbone, layers) -> None:
        for index in config.moe_layer_indices:
            layer = layers[index]
            experts = ffn_experts(layer, backbone, config.num_experts)
            replace_module(layer, backbone.ffn.module, BackboneTaskMoE(config, index, experts, self.task_context))

    def _dense_rules(self):
        backbone = self.config.backbone
        site = backbone.ffn
        if site.split:
            return (
                # stacked experts (`experts.w_in`, `experts.w_in_bias`: every slice a copy) or one (`experts.0.w_in.*`)
                *(
                    layer_rule(backbone, rf"{site.module}\.experts\.{proj}{suffix}", f"{path}.{kind}")
                    for proj, path in (("w_in", site.w_in), ("w_out", site.w_out))
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
        return {"output_routing": bool(output_router_logits)}

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
