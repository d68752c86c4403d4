"""PALs: Projected Attention Layers on any declared encoder (RoBERTa, XLM-R, ELECTRA, DistilBERT, DeBERTa-v2/v3,
ModernBERT, BERT), hooked onto the dense model's own layers (`hf_taskmoe.backbones`): `PALsForMultiTask`, and under
the names of earlier releases `BertWithPALs` (`PALsForMultiTask` with a BERT default; its checkpoints load)."""

from dataclasses import replace

from ...backbones import ENCODER_BACKBONE
from ..encoder import encoder_family
from ..registry import register_family
from .configuration_pals import PAL_SITES, PALsConfig
from .legacy import BertPALsConfig, BertPALsModel, BertWithPALs
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
FAMILY = register_family(encoder_family(
    "pals", PALsConfig, PALsForMultiTask, "pals", describe,
    backbone_kind=ENCODER_BACKBONE,  # every declared encoder, one declared later included
))

#: the name and `model_type` of earlier releases' BERT class: `--model_family bert_pals` on a BERT, old configs
#: (`family_of`) and checkpoints (`AutoModel`); the same method, the same implementation
BERT_FAMILY = register_family(replace(
    FAMILY, name="bert_pals", config_class=BertPALsConfig, model_class=BertWithPALs, describe=describe_bert,
    backbone_kind=None, dense_model_types=("bert",),
))

__all__ = ["BERT_FAMILY", "FAMILY", "PAL_SITES", "BackbonePALs", "BertPALsConfig", "BertPALsModel", "BertWithPALs",
           "PALSite", "PALsConfig", "PALsForMultiTask"]
