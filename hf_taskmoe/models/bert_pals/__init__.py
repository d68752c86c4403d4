"""BertWithPALs: BERT + Projected Attention Layers (BERT and PALs)."""

from ...pipelines import PIPELINE_TASK
from ...problem_types import ENCODER
from ...upcycling import UpcyclingRules
from ..multitask_bert import BERT_BACKBONE_RULES
from ..registry import Family, register_family
from .configuration_bert_pals import BertPALsConfig
from .modeling_bert_pals import BertPALsModel, BertPALsPreTrainedModel, BertWithPALs


def describe(c: BertPALsConfig) -> str:
    return (f"BERT + Projected Attention Layers: PAL size s={c.pal_size}, {c.pal_num_heads} PAL heads, PAL layers "
            f"{c.pal_layer_indices}, PAL groups {c.pal_groups}")


FAMILY = register_family(
    Family(
        name="bert_pals",
        config_class=BertPALsConfig,
        model_class=BertWithPALs,
        problem_types=ENCODER,
        pipeline_task=PIPELINE_TASK,
        describe=describe,
        # the dense BERT is kept whole (same layer names); PALs and heads are new
        upcycling=UpcyclingRules(
            rename=BERT_BACKBONE_RULES
            + ((r"encoder\.layer\.(\d+)\.(intermediate|output)\.(.+)", r"encoder.layer.\1.\2.\3"),),
            new=BertWithPALs.parameter_roles.new_patterns,
        ),
        dense_model_types=("bert",),
        method="pals",
    )
)

__all__ = ["FAMILY", "BertPALsConfig", "BertPALsModel", "BertPALsPreTrainedModel", "BertWithPALs"]
