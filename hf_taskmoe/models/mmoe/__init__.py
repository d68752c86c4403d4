"""MMoEModel: tabular Multi-gate Mixture-of-Experts, OMoE and Shared-Bottom (MMoE paper)."""

from .configuration_mmoe import ARCHITECTURES, MMoEConfig
from .modeling_mmoe import MMoEModel, MMoEOutput, MMoEPreTrainedModel

__all__ = ["ARCHITECTURES", "MMoEConfig", "MMoEModel", "MMoEOutput", "MMoEPreTrainedModel"]
