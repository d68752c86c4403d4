"""TaskRoutedForCausalLM: task-level mixture of experts (Ye et al. 2022) over the layers of a decoder-only causal LM
(GPT-2, Llama, Qwen2, Mistral), wrapping the dense model's own layers (`hf_taskmoe.backbones.decoders`)."""

from ...backbones import DECODER_BACKBONE, backbone_names
from ...pipelines import TEXT2TEXT_PIPELINE_TASK
from ...problem_types import TEXT_TO_TEXT
from ...upcycling import UpcyclingRules
from ..registry import Family, register_family
from .configuration_task_routed_lm import TaskRoutedLMConfig
from .modeling_task_routed_lm import TaskRoutedCausalLMOutput, TaskRoutedForCausalLM


def describe(c: TaskRoutedLMConfig) -> str:
    frozen = " (frozen)" if c.freeze_task_embeddings else ""
    return (
        f"Task-level MoE over the layers of a {c.dense_config.model_type} causal LM: {c.num_experts} experts per "
        f"routed layer ({c.num_routed_layers} routed layers), {c.router_type} router, selection `{c.selection}`, task "
        f"representations of size {c.task_dim}{frozen}"
    )


FAMILY = register_family(Family(
    name="task_routed_lm",
    config_class=TaskRoutedLMConfig,
    model_class=TaskRoutedForCausalLM,
    auto_classes=TaskRoutedForCausalLM.auto_classes,
    problem_types=TEXT_TO_TEXT,
    pipeline_task=TEXT2TEXT_PIPELINE_TASK,
    describe=describe,
    # Ye et al. section 5.2: every expert of layer i starts as layer i (a plain layer is `experts.0`); every other
    # weight of the dense causal LM (embeddings, positions, final norm, LM head) under its own name; the router is new.
    # Names are relative to `backbone.` (the dense causal LM), whatever the architecture calls its layers.
    upcycling=UpcyclingRules(
        rename=((r"(.+)\.experts\.\d+\.(.+)", r"\1.\2"), (r"(.+)", r"\1")),
        new=TaskRoutedForCausalLM.parameter_roles.new_patterns,
    ),
    dense_model_types=tuple(backbone_names(DECODER_BACKBONE)),
    method="task-routing",
))

__all__ = ["FAMILY", "TaskRoutedCausalLMOutput", "TaskRoutedForCausalLM", "TaskRoutedLMConfig"]
