"""Family-agnostic building blocks."""

from .heads import MultiTaskHeads, TaskHead, build_head
from .low_rank import LowRankExperts
from .moe import GATING_TYPES, ExpertBank, ExpertFFN, MoEOutput, SharedGate, TaskGate, TaskMoE
from .pals import PALAttention, ProjectedAttentionLayers
from .routing import ROUTER_TYPES, SELECTION_FUNCTIONS, RoutedLayer, TaskRouter

__all__ = [
    "MultiTaskHeads",
    "TaskHead",
    "build_head",
    "GATING_TYPES",
    "ExpertBank",
    "ExpertFFN",
    "LowRankExperts",
    "MoEOutput",
    "SharedGate",
    "TaskGate",
    "TaskMoE",
    "PALAttention",
    "ProjectedAttentionLayers",
    "ROUTER_TYPES",
    "SELECTION_FUNCTIONS",
    "RoutedLayer",
    "TaskRouter",
]
