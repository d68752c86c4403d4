"""CAMTLModel: CA-MTL, a BERT modulated by a learned task embedding (CA-MTL paper)."""

from .configuration_camtl import CAMTLConfig
from .modeling_camtl import CAMTLBertModel, CAMTLModel, CAMTLPreTrainedModel

__all__ = ["CAMTLConfig", "CAMTLBertModel", "CAMTLModel", "CAMTLPreTrainedModel"]
