"""BertForTaskMoE: MT-TaG, MT-Switch and MT-Dense (Sparsely Activated Mixture-of-Experts are Robust Multi-Task
Learners): BERT/MiniLM feed-forward blocks upcycled into experts behind task-aware or shared top-k gates."""

from ...pipelines import PIPELINE_TASK
from ...problem_types import ENCODER
from ...upcycling import UpcyclingRules
from ..multitask_bert import BERT_BACKBONE_RULES
from ..registry import Family, register_family
from .configuration_bert_taskmoe import BertTaskMoEConfig
from .modeling_bert_taskmoe import (
    BertForTaskMoE,
    BertTaskMoEModel,
    BertTaskMoEPreTrainedModel,
    TaskMoEEncoderOutput,
    TaskMoEOutput,
)


def describe(c: BertTaskMoEConfig) -> str:
    if c.num_experts == 1:
        return "MT-Dense (one FFN per layer)"
    kind = "MT-TaG (task-aware gates)" if c.gating == "task" else "MT-Switch (one shared gate)"
    return (f"{kind}: {c.num_experts} experts per MoE layer, top-{c.top_k} routing, expert weighting "
            f"`{c.expert_weighting}`, MoE layers {c.moe_layer_indices}")


FAMILY = register_family(
    Family(
        name="bert_taskmoe",
        config_class=BertTaskMoEConfig,
        model_class=BertForTaskMoE,
        problem_types=ENCODER,
        pipeline_task=PIPELINE_TASK,
        describe=describe,
        # MT-TaG section 4.3: every expert of layer i starts as a copy of layer i's FFN
        upcycling=UpcyclingRules(
            rename=BERT_BACKBONE_RULES
            + (
                # stacked experts (`experts.w_in`: every slice a copy of the FFN) or a dense layer's `experts.0`
                (r"encoder\.layer\.(\d+)\.mlp\.experts\.w_in", r"encoder.layer.\1.intermediate.dense.weight"),
                (r"encoder\.layer\.(\d+)\.mlp\.experts\.w_in_bias", r"encoder.layer.\1.intermediate.dense.bias"),
                (r"encoder\.layer\.(\d+)\.mlp\.experts\.w_out", r"encoder.layer.\1.output.dense.weight"),
                (r"encoder\.layer\.(\d+)\.mlp\.experts\.w_out_bias", r"encoder.layer.\1.output.dense.bias"),
                (
                    r"encoder\.layer\.(\d+)\.mlp\.experts\.0\.w_in\.(weight|bias)",
                    r"encoder.layer.\1.intermediate.dense.\2",
                ),
                (r"encoder\.layer\.(\d+)\.mlp\.experts\.0\.w_out\.(weight|bias)", r"encoder.layer.\1.output.dense.\2"),
                (r"encoder\.layer\.(\d+)\.ffn_norm\.(weight|bias)", r"encoder.layer.\1.output.LayerNorm.\2"),
            ),
            new=BertForTaskMoE.parameter_roles.new_patterns,
        ),
        dense_model_types=("bert",),
        method="mt-tag",
    )
)

__all__ = [
    "FAMILY",
    "BertTaskMoEConfig",
    "BertForTaskMoE",
    "BertTaskMoEModel",
    "BertTaskMoEPreTrainedModel",
    "TaskMoEEncoderOutput",
    "TaskMoEOutput",
]
