"""Backbone declarations: where each architecture keeps the modules the methods wrap (`base.py`); the encoders
(`encoders.py`) and decoders (`decoders.py`) declared by the package."""

from .base import (
    BACKBONES,
    DECODER_BACKBONE,
    ENCODER_BACKBONE,
    ENCODER_DECODER_BACKBONE,
    METHODS,
    Backbone,
    FFNSite,
    TaskContext,
    backbone_names,
    get_backbone,
    layer_hidden_input,
    method_key,
    register_backbone,
    replace_module,
)

# importing the declarations registers them (named imports: the remote-code bundler takes no `from . import x`)
from .decoders import GPT2, LLAMA, MISTRAL, MT5, QWEN2, T5  # noqa: F401
from .encoders import (  # noqa: F401
    ALBERT,
    BERT,
    CAMEMBERT,
    DATA2VEC_TEXT,
    DEBERTA_V2,
    DISTILBERT,
    ELECTRA,
    ERNIE,
    MODERNBERT,
    MPNET,
    REMBERT,
    ROBERTA,
    XLM_ROBERTA,
    XLM_ROBERTA_XL,
)

__all__ = [
    "BACKBONES",
    "DECODER_BACKBONE",
    "ENCODER_BACKBONE",
    "ENCODER_DECODER_BACKBONE",
    "METHODS",
    "Backbone",
    "FFNSite",
    "TaskContext",
    "backbone_names",
    "get_backbone",
    "layer_hidden_input",
    "method_key",
    "register_backbone",
    "replace_module",
]
