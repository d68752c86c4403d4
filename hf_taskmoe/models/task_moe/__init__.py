"""TaskMoEForMultiTask: MT-TaG, MT-Switch and MT-Dense on any declared encoder (RoBERTa, XLM-R, ELECTRA, DistilBERT,
DeBERTa-v2/v3, ModernBERT, BERT), wrapping the dense model's own FFNs (`hf_taskmoe.backbones`)."""

from ...backbones import ENCODER_BACKBONE
from ...pipelines import PIPELINE_TASK
from ...problem_types import ENCODER
from ...upcycling import UpcyclingRules
from ..bert_taskmoe import describe
from ..registry import Family, register_family
from .configuration_task_moe import TaskMoEConfig
from .modeling_task_moe import BackboneTaskMoE, TaskMoEForMultiTask

FAMILY = register_family(
    Family(
        name="taskmoe",
        config_class=TaskMoEConfig,
        model_class=TaskMoEForMultiTask,
        problem_types=ENCODER,
        pipeline_task=PIPELINE_TASK,
        describe=lambda c: f"{describe(c)}, on a {c.dense_config.model_type} encoder",
        # the rules depend on the backbone: each model gives its own (`TaskMoEForMultiTask.upcycling_rules`)
        upcycling=UpcyclingRules(rename=(), new=TaskMoEForMultiTask.parameter_roles.new_patterns),
        backbone_kind=ENCODER_BACKBONE,
        method="mt-tag",
    )
)

__all__ = ["FAMILY", "BackboneTaskMoE", "TaskMoEConfig", "TaskMoEForMultiTask"]
