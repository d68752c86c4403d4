"""CA-MTL (Conditionally Adaptive Multi-Task Learning, Pilault et al. 2021): an encoder modulated by a learned task
embedding, on any declared encoder (`CAMTLForMultiTask`), conditioning the dense model's own modules
(`hf_taskmoe.backbones`). One family, `camtl`; `CAMTLModel` (`bert.py`) is its BERT class, a variant."""

from dataclasses import replace

from ...backbones import ENCODER_BACKBONE
from ..encoder import encoder_family
from ..registry import register_family
from .bert import CAMTLConfig, CAMTLModel
from .configuration_camtl import CAMTLBackboneConfig
from .modeling_camtl import CAMTLForMultiTask


def describe(c: CAMTLBackboneConfig) -> str:
    attention = (
        f"on ({c.attention_blocks} blocks, L={c.conditional_attention_max_length})"
        if c.conditional_attention
        else "off"
    )
    return (f"CA-MTL: task embeddings of size {c.task_dim}; conditional attention {attention}, alignment "
            f"{'on' if c.conditional_alignment else 'off'}, CLN {'on' if c.conditional_layer_norm else 'off'}, "
            f"bottleneck {c.conditional_bottleneck}; conditional layers {c.conditional_layer_indices}; bottom "
            f"{c.frozen_layers} layers{' and the embeddings' if c.freeze_embeddings else ''} frozen")


def _script_defaults(values: dict) -> dict:
    # conditional attention is built for a fixed length: by default the length the script truncates inputs to
    return {"conditional_attention_max_length": values["max_seq_length"]}


#: the dense weights keep their names (CLNs hold the dense norms' weight/bias); the model gives its rules
GENERIC = encoder_family(
    "camtl", CAMTLBackboneConfig, CAMTLForMultiTask, "ca-mtl",
    lambda c: f"{describe(c)}, on a {c.dense_config.model_type} encoder", backbone_kind=ENCODER_BACKBONE,
    script_defaults=_script_defaults, aliases=("camtl_any",),
)
#: a BERT checkpoint builds a CAMTLModel (`family_for`)
FAMILY = register_family(replace(GENERIC, variants=(replace(
    GENERIC, config_class=CAMTLConfig, model_class=CAMTLModel, describe=describe, backbone_kind=None,
    dense_model_types=("bert",),
),)))

__all__ = ["FAMILY", "CAMTLBackboneConfig", "CAMTLConfig", "CAMTLForMultiTask", "CAMTLModel"]
