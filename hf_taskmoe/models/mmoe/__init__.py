"""MMoEModel: tabular Multi-gate Mixture-of-Experts, OMoE and Shared-Bottom (Modeling Task Relationships in
Multi-task Learning with Multi-gate Mixture-of-Experts)."""

from ...problem_types import TABULAR
from ..registry import Family, register_family
from .configuration_mmoe import ARCHITECTURES, MMoEConfig
from .modeling_mmoe import MMoEModel, MMoEOutput, MMoEPreTrainedModel


def describe(c: MMoEConfig) -> str:
    kind = {"mmoe": "MMoE (one softmax gate per task)", "omoe": "OMoE (one gate shared by the tasks)"}.get(
        c.architecture, "Shared-Bottom"
    )
    shape = (
        f": {c.num_experts} experts of {c.expert_hidden_sizes}"
        if c.architecture != "shared_bottom"
        else f": bottom {c.bottom_hidden_sizes}"
    )
    return f"{kind}{shape}, towers {c.tower_hidden_sizes}"


FAMILY = register_family(Family(
    name="mmoe",
    config_class=MMoEConfig,
    model_class=MMoEModel,
    problem_types=TABULAR,
    describe=describe,
    export_kind="tabular",
))

__all__ = ["FAMILY", "ARCHITECTURES", "MMoEConfig", "MMoEModel", "MMoEOutput", "MMoEPreTrainedModel"]
