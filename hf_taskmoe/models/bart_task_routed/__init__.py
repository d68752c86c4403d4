"""BartTaskRouted: task-level mixture of experts over BART layers (Eliciting and Understanding Cross-task Skills
with Task-level Mixture-of-Experts)."""

from ...pipelines import TEXT2TEXT_PIPELINE_TASK
from ...problem_types import TEXT_TO_TEXT
from ...upcycling import UpcyclingRules
from ..registry import Family, register_family
from .bart_from_bert import bart_from_bert
from .configuration_bart_task_routed import BartTaskRoutedConfig
from .modeling_bart_task_routed import BartTaskRouted, TaskRoutedSeq2SeqOutput


def describe(c: BartTaskRoutedConfig) -> str:
    frozen = " (frozen)" if c.freeze_task_embeddings else ""
    return (
        f"Task-level MoE over BART layers: {c.num_experts} experts per routed layer ({c.num_routed_layers} routed "
        f"layers), {c.router_type} router, selection `{c.selection}`, task representations of size {c.task_dim}{frozen}"
    )


def prepare_dense(dense, dense_config):
    """No BART weights offline: a BERT checkpoint is warm-started into a BART (BERT2BERT, `bart_from_bert`)."""
    return bart_from_bert(dense) if getattr(dense_config, "model_type", None) == "bert" else dense


FAMILY = register_family(Family(
    name="bart_routed",
    config_class=BartTaskRoutedConfig,
    model_class=BartTaskRouted,
    auto_classes=BartTaskRouted.auto_classes,
    problem_types=TEXT_TO_TEXT,
    pipeline_task=TEXT2TEXT_PIPELINE_TASK,
    describe=describe,
    # Ye et al. section 5.2: every expert of layer i starts as layer i (a plain layer is `experts.0`); embeddings
    # and LM head are kept; the router is new. `from_dense` adds the paper's N(0, 1e-8) noise after the copy.
    upcycling=UpcyclingRules(
        rename=(
            (r"(encoder|decoder)\.layers\.(\d+)\.experts\.\d+\.(.+)", r"\1.layers.\2.\3"),
            (r"(shared\..+|encoder\.(?!layers\.).+|decoder\.(?!layers\.).+)", r"\1"),
            (r"lm_head\.weight", r"shared.weight"),
        ),
        new=BartTaskRouted.parameter_roles.new_patterns,
    ),
    dense_model_types=("bart", "bert"),
    method="task-routing",
    prepare_dense=prepare_dense,
    export_kind="encoder_decoder",
))

__all__ = ["FAMILY", "BartTaskRoutedConfig", "BartTaskRouted", "TaskRoutedSeq2SeqOutput", "bart_from_bert"]
