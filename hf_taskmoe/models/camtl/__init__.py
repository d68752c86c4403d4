"""CAMTLModel: CA-MTL, a BERT modulated by a learned task embedding (Conditionally Adaptive Multi-Task Learning)."""

from ...pipelines import PIPELINE_TASK
from ...problem_types import ENCODER
from ...upcycling import UpcyclingRules
from ..multitask_bert import BERT_BACKBONE_RULES
from ..registry import Family, register_family
from .configuration_camtl import CAMTLConfig
from .modeling_camtl import CAMTLBertModel, CAMTLModel, CAMTLPreTrainedModel


def describe(c: CAMTLConfig) -> str:
    attention = (
        f"on ({c.attention_blocks} blocks, L={c.conditional_attention_max_length})"
        if c.conditional_attention
        else "off"
    )
    return (f"CA-MTL: task embeddings of size {c.task_dim}; conditional attention {attention}, alignment "
            f"{'on' if c.conditional_alignment else 'off'}, CLN {'on' if c.conditional_layer_norm else 'off'}, "
            f"bottleneck {c.conditional_bottleneck}; conditional layers {c.conditional_layer_indices}; bottom "
            f"{c.frozen_layers} layers{' and the embeddings' if c.freeze_embeddings else ''} frozen")


FAMILY = register_family(
    Family(
        name="camtl",
        config_class=CAMTLConfig,
        model_class=CAMTLModel,
        problem_types=ENCODER,
        pipeline_task=PIPELINE_TASK,
        describe=describe,
        # the dense BERT is kept whole (its LayerNorms become the CLNs' gamma', beta'); the task embeddings,
        # conditional modules and heads are new
        upcycling=UpcyclingRules(
            rename=BERT_BACKBONE_RULES
            + ((r"encoder\.layer\.(\d+)\.(intermediate|output)\.(.+)", r"encoder.layer.\1.\2.\3"),),
            new=CAMTLModel.parameter_roles.new_patterns,
        ),
        dense_model_types=("bert",),
        method="ca-mtl",
        # conditional attention is built for a fixed length: by default the length the script truncates inputs to
        script_defaults=lambda values: {"conditional_attention_max_length": values["max_seq_length"]},
    )
)

__all__ = ["FAMILY", "CAMTLConfig", "CAMTLBertModel", "CAMTLModel", "CAMTLPreTrainedModel"]
