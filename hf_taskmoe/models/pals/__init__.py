"""PALsForMultiTask: Projected Attention Layers on any declared encoder (RoBERTa, XLM-R, ELECTRA, DistilBERT,
DeBERTa-v2/v3, ModernBERT, BERT), hooked onto the dense model's own layers (`hf_taskmoe.backbones`)."""

from ...backbones import ENCODER_BACKBONE
from ...pipelines import PIPELINE_TASK
from ...problem_types import ENCODER
from ...upcycling import UpcyclingRules
from ..registry import Family, register_family
from .configuration_pals import PAL_SITES, PALsConfig
from .modeling_pals import BackbonePALs, PALsForMultiTask, PALSite


def describe(c: PALsConfig) -> str:
    return (f"Projected Attention Layers on a {c.dense_config.model_type} encoder: PAL size s={c.pal_size}, "
            f"{c.pal_num_heads} PAL heads, PAL layers {c.pal_layer_indices}, PAL groups {c.pal_groups}, "
            f"joining at the {c.pal_site}")


FAMILY = register_family(
    Family(
        name="pals",
        config_class=PALsConfig,
        model_class=PALsForMultiTask,
        problem_types=ENCODER,
        pipeline_task=PIPELINE_TASK,
        describe=describe,
        # every dense weight keeps its name (the PALs hook onto the layers); PALs and heads are new
        upcycling=UpcyclingRules(rename=(), new=PALsForMultiTask.parameter_roles.new_patterns),
        backbone_kind=ENCODER_BACKBONE,  # every declared encoder, one declared later included
        method="pals",
    )
)

__all__ = ["FAMILY", "PAL_SITES", "BackbonePALs", "PALSite", "PALsConfig", "PALsForMultiTask"]
