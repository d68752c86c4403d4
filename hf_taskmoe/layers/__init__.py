"""Family-agnostic building blocks."""

from .heads import HEAD_TYPES, MultiTaskHeads, TaskHead, build_head
from .pals import PALAttention, ProjectedAttentionLayers
from .moe import ROUTER_TYPES, ExpertFFN, MoEOutput, SharedRouter, TaskMoE, TaskRouter

__all__ = [
    "HEAD_TYPES",
    "MultiTaskHeads",
    "TaskHead",
    "build_head",
    "ROUTER_TYPES",
    "ExpertFFN",
    "MoEOutput",
    "SharedRouter",
    "TaskMoE",
    "TaskRouter",
    "PALAttention",
    "ProjectedAttentionLayers",
]
