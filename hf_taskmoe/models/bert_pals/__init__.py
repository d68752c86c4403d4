"""BertWithPALs: BERT + Projected Attention Layers (PALs paper)."""

from .configuration_bert_pals import BertPALsConfig
from .modeling_bert_pals import BertPALsModel, BertPALsPreTrainedModel, BertWithPALs

__all__ = ["BertPALsConfig", "BertPALsModel", "BertPALsPreTrainedModel", "BertWithPALs"]
