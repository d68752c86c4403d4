"""MT-TaG, MT-Switch and MT-Dense (Sparsely Activated Mixture-of-Experts are Robust Multi-Task Learners) on any declared
encoder (BERT, RoBERTa, XLM-R, ELECTRA, DistilBERT, DeBERTa-v2/v3, ModernBERT): `TaskMoEForMultiTask`, wrapping the
dense model's own FFNs (`hf_taskmoe.backbones`). One family, `taskmoe`; `BertForTaskMoE` (`bert.py`) is its BERT
class, a variant."""

from dataclasses import replace

from ...backbones import ENCODER_BACKBONE
from ..encoder import encoder_family
from ..registry import register_family
from .bert import BertForTaskMoE, BertTaskMoEConfig
from .configuration_task_moe import TaskMoEConfig
from .modeling_task_moe import BackboneTaskMoE, TaskMoEEncoderOutput, TaskMoEForMultiTask, TaskMoEOutput


def describe(c: TaskMoEConfig) -> str:
    if c.num_experts == 1:
        return "MT-Dense (one FFN per layer)"
    kind = "MT-TaG (task-aware gates)" if c.gating == "task" else "MT-Switch (one shared gate)"
    text = (f"{kind}: {c.num_experts} experts per MoE layer, top-{c.top_k} routing, expert weighting "
            f"`{c.expert_weighting}`, MoE layers {c.moe_layer_indices}")
    if c.expert_rank is not None:
        targets = ", ".join(c.expert_targets) if c.expert_targets else "every linear of the FFN"
        base = "trained" if c.train_base else "frozen"
        text += (f"; low-rank experts: one copy of each FFN plus each expert's LoRA delta of rank {c.expert_rank} "
                 f"(`lora_alpha` {c.lora_alpha:g}) on {targets}, dense weights {base}")
    return text


# the rules depend on the backbone: each model gives its own (`TaskMoEForMultiTask.upcycling_rules`)
GENERIC = encoder_family(
    "taskmoe", TaskMoEConfig, TaskMoEForMultiTask, "mt-tag",
    lambda c: f"{describe(c)}, on a {c.dense_config.model_type} encoder", backbone_kind=ENCODER_BACKBONE,
    aliases=("bert_taskmoe",),
)
#: a BERT checkpoint builds a BertForTaskMoE (`family_for`)
FAMILY = register_family(replace(GENERIC, variants=(replace(
    GENERIC, config_class=BertTaskMoEConfig, model_class=BertForTaskMoE, describe=describe, backbone_kind=None,
    dense_model_types=("bert",),
),)))

__all__ = ["FAMILY", "BackboneTaskMoE", "BertForTaskMoE", "BertTaskMoEConfig", "TaskMoEConfig", "TaskMoEEncoderOutput",
           "TaskMoEForMultiTask", "TaskMoEOutput"]
