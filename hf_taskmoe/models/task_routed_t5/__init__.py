"""TaskRoutedForSeq2SeqLM: task-level mixture of experts (Ye et al. 2022) over the encoder and decoder blocks of a T5
or mT5, wrapping the dense model's own blocks (`hf_taskmoe.backbones.decoders`)."""

from ...backbones import ENCODER_DECODER_BACKBONE, backbone_names
from ...pipelines import TEXT2TEXT_PIPELINE_TASK
from ...problem_types import TEXT_TO_TEXT
from ...upcycling import UpcyclingRules
from ..registry import Family, register_family
from .configuration_task_routed_t5 import TaskRoutedSeq2SeqConfig
from .modeling_task_routed_t5 import T5RoutedBlock, TaskRoutedForSeq2SeqLM, TaskRoutedSeq2SeqOutput


def describe(c: TaskRoutedSeq2SeqConfig) -> str:
    frozen = " (frozen)" if c.freeze_task_embeddings else ""
    return (
        f"Task-level MoE over the encoder and decoder blocks of a {c.dense_config.model_type}: {c.num_experts} experts "
        f"per routed block ({len(c.encoder_route_layers)} encoder, {len(c.decoder_route_layers)} decoder blocks "
        f"routed), {c.router_type} router, selection `{c.selection}`, task representations of size {c.task_dim}{frozen}"
    )


FAMILY = register_family(Family(
    name="task_routed_t5",
    config_class=TaskRoutedSeq2SeqConfig,
    model_class=TaskRoutedForSeq2SeqLM,
    auto_classes=TaskRoutedForSeq2SeqLM.auto_classes,
    problem_types=TEXT_TO_TEXT,
    pipeline_task=TEXT2TEXT_PIPELINE_TASK,
    describe=describe,
    # Ye et al. section 5.2: every expert of block i starts as block i (a plain block is `experts.0`); every other
    # weight of the dense model (shared embeddings, final norms, LM head) under its own name; the router is new.
    # Names are relative to `backbone.` (the dense T5ForConditionalGeneration).
    upcycling=UpcyclingRules(
        rename=((r"(.+)\.experts\.\d+\.(.+)", r"\1.\2"), (r"(.+)", r"\1")),
        new=TaskRoutedForSeq2SeqLM.parameter_roles.new_patterns,
    ),
    dense_model_types=tuple(backbone_names(ENCODER_DECODER_BACKBONE)),
    method="task-routing",
))

__all__ = ["FAMILY", "T5RoutedBlock", "TaskRoutedForSeq2SeqLM", "TaskRoutedSeq2SeqConfig", "TaskRoutedSeq2SeqOutput"]
