"""PALs: Projected Attention Layers on any declared encoder (RoBERTa, XLM-R, ELECTRA, DistilBERT, DeBERTa-v2/v3,
ModernBERT, BERT), hooked onto the dense model's own layers (`hf_taskmoe.backbones`): `PALsForMultiTask`, one family,
`pals`; `BertWithPALs` (`bert.py`) is its BERT class, a variant."""

from dataclasses import replace

from ...backbones import ENCODER_BACKBONE
from ..encoder import encoder_family
from ..registry import register_family
from .bert import BertPALsConfig, BertWithPALs
from .configuration_pals import PAL_SITES, PALsConfig
from .modeling_pals import BackbonePALs, PALsForMultiTask, PALSite


def _pals(c: PALsConfig) -> str:
    return (f"PAL size s={c.pal_size}, {c.pal_num_heads} PAL heads, PAL layers {c.pal_layer_indices}, PAL groups "
            f"{c.pal_groups}")


def describe(c: PALsConfig) -> str:
    return (f"Projected Attention Layers on a {c.dense_config.model_type} encoder: {_pals(c)}, "
            f"joining at the {c.pal_site}")


def describe_bert(c: BertPALsConfig) -> str:
    return f"BERT + Projected Attention Layers: {_pals(c)}"


#: every dense weight keeps its name (the PALs hook onto the layers); PALs and heads are new
GENERIC = encoder_family(
    "pals", PALsConfig, PALsForMultiTask, "pals", describe,
    backbone_kind=ENCODER_BACKBONE,  # every declared encoder, one declared later included
    aliases=("bert_pals",),
)
#: a BERT checkpoint builds a BertWithPALs (`family_for`)
FAMILY = register_family(replace(GENERIC, variants=(replace(
    GENERIC, config_class=BertPALsConfig, model_class=BertWithPALs, describe=describe_bert, backbone_kind=None,
    dense_model_types=("bert",),
),)))

__all__ = ["FAMILY", "PAL_SITES", "BackbonePALs", "BertPALsConfig", "BertWithPALs", "PALSite", "PALsConfig",
           "PALsForMultiTask"]
