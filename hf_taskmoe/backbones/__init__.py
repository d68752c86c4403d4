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
from .decoders import (  # noqa: F401
    COHERE,
    FALCON,
    GEMMA2,
    GEMMA3_TEXT,
    GPT2,
    GPT_NEOX,
    GRANITE,
    LLAMA,
    MISTRAL,
    MT5,
    OLMO2,
    PHI3,
    QWEN2,
    QWEN3,
    SMOLLM3,
    STABLELM,
    STARCODER2,
    T5,
)
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
