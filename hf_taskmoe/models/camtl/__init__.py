"""CA-MTL (Conditionally Adaptive Multi-Task Learning, Pilault et al. 2021): an encoder modulated by a learned task
embedding, on any declared encoder (`CAMTLForMultiTask`, family `camtl_any`), conditioning the dense model's own
modules (`hf_taskmoe.backbones`). `CAMTLModel` / `CAMTLConfig` (family `camtl`) are the same model under its first
names, a BERT by default, and load the checkpoints the earlier BERT-only implementation saved."""

from dataclasses import replace

from ...backbones import ENCODER_BACKBONE
from ..encoder import encoder_family
from ..registry import register_family
from .configuration_camtl import CAMTLBackboneConfig, CAMTLConfig
from .modeling_camtl import CAMTLBertModel, CAMTLForMultiTask, CAMTLModel


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
FAMILY = register_family(encoder_family(
    "camtl", CAMTLConfig, CAMTLModel, "ca-mtl", describe, dense_model_types=("bert",), script_defaults=_script_defaults,
))

ANY_FAMILY = register_family(replace(
    FAMILY, name="camtl_any", config_class=CAMTLBackboneConfig, model_class=CAMTLForMultiTask,
    describe=lambda c: f"{describe(c)}, on a {c.dense_config.model_type} encoder", dense_model_types=(),
    backbone_kind=ENCODER_BACKBONE,
))

__all__ = ["ANY_FAMILY", "FAMILY", "CAMTLBackboneConfig", "CAMTLBertModel", "CAMTLConfig", "CAMTLForMultiTask",
           "CAMTLModel"]
