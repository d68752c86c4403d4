"""Backbone declarations: where each architecture keeps the modules the methods wrap (`base.py`); the encoders
(`encoders.py`) and decoders (`decoders.py`) declared by the package."""

from . import decoders, encoders  # noqa: F401  (register the declared architectures)
from .base import (
    BACKBONES,
    DECODER_BACKBONE,
    ENCODER_BACKBONE,
    ENCODER_DECODER_BACKBONE,
    Backbone,
    FFNSite,
    TaskContext,
    backbone_names,
    get_backbone,
    layer_hidden_input,
    register_backbone,
    replace_module,
)

__all__ = [
    "BACKBONES",
    "DECODER_BACKBONE",
    "ENCODER_BACKBONE",
    "ENCODER_DECODER_BACKBONE",
    "Backbone",
    "FFNSite",
    "TaskContext",
    "backbone_names",
    "get_backbone",
    "layer_hidden_input",
    "register_backbone",
    "replace_module",
]
