"""CAMTLForMultiTask: CA-MTL on any declared encoder (RoBERTa, XLM-R, ELECTRA, DistilBERT, DeBERTa-v2/v3 without
conditional attention, ModernBERT, BERT), conditioning the dense model's own modules (`hf_taskmoe.backbones`)."""

from ...backbones import ENCODER_BACKBONE
from ...pipelines import PIPELINE_TASK
from ...problem_types import ENCODER
from ...upcycling import UpcyclingRules
from ..camtl import describe
from ..registry import Family, register_family
from .configuration_camtl_any import CAMTLBackboneConfig
from .modeling_camtl_any import CAMTLForMultiTask

FAMILY = register_family(
    Family(
        name="camtl_any",
        config_class=CAMTLBackboneConfig,
        model_class=CAMTLForMultiTask,
        problem_types=ENCODER,
        pipeline_task=PIPELINE_TASK,
        describe=lambda c: f"{describe(c)}, on a {c.dense_config.model_type} encoder",
        # the dense weights keep their names (CLNs hold the dense norms' weight/bias); each model gives its rules
        upcycling=UpcyclingRules(rename=(), new=CAMTLForMultiTask.parameter_roles.new_patterns),
        backbone_kind=ENCODER_BACKBONE,
        method="ca-mtl",
        # conditional attention is built for a fixed length: by default the length the script truncates inputs to
        script_defaults=lambda values: {"conditional_attention_max_length": values["max_seq_length"]},
    )
)

__all__ = ["FAMILY", "CAMTLBackboneConfig", "CAMTLForMultiTask"]
