"""Task-level routing (Ye et al. 2022): one implementation for every architecture. `core.py` holds what every routed
model shares (the router, its checks and decisions, the forked layers, the routing outputs, `export_task`);
`modeling_causal_lm.py` the decoder-only models (GPT-2, Llama, Qwen2, Mistral), `modeling_seq2seq.py` the
encoder-decoders (T5, mT5, BART), each adding only what its layers need. One family, `task_routing`, holds both,
and `BartTaskRouted`: the encoder-decoder class with a BART default (its config has the seq2seq model's
`model_type`), which also takes a BERT warm-started into a BART (`bart_from_bert`)."""

from dataclasses import replace

from ...backbones import DECODER_BACKBONE, ENCODER_DECODER_BACKBONE
from ...pipelines import TEXT2TEXT_PIPELINE_TASK
from ...problem_types import TEXT_TO_TEXT
from ...upcycling import UpcyclingRules
from ..registry import Family, register_family
from .bart_from_bert import bart_from_bert
from .configuration import BartTaskRoutedConfig, TaskRoutedLMConfig, TaskRoutedSeq2SeqConfig
from .core import TaskRoutedCausalLMOutput, TaskRoutedSeq2SeqOutput
from .modeling_causal_lm import TaskRoutedForCausalLM
from .modeling_seq2seq import BartTaskRouted, T5RoutedBlock, TaskRoutedForSeq2SeqLM


def _routing(c) -> str:
    """What every task-routed model's card says of its router (and of low-rank experts)."""
    frozen = " (frozen)" if c.freeze_task_embeddings else ""
    text = f"{c.router_type} router, selection `{c.selection}`, task representations of size {c.task_dim}{frozen}"
    if c.low_rank:
        targets = ", ".join(c.expert_targets) if c.expert_targets else "every linear of the layer"
        base = "trained" if c.train_base else "frozen"
        text += (f"; low-rank experts: one copy of each routed layer plus each expert's LoRA delta of rank "
                 f"{c.expert_rank} (`lora_alpha` {c.lora_alpha:g}) on {targets}, dense weights {base}")
    return text


def describe(c: TaskRoutedLMConfig) -> str:
    return (f"Task-level MoE over the layers of a {c.dense_config.model_type} causal LM: {c.num_experts} experts per "
            f"routed layer ({c.num_routed_layers} routed layers), {_routing(c)}")


def describe_seq2seq(c: TaskRoutedSeq2SeqConfig) -> str:
    return (f"Task-level MoE over the encoder and decoder blocks of a {c.dense_config.model_type}: {c.num_experts} "
            f"experts per routed block ({len(c.encoder_route_layers)} encoder, {len(c.decoder_route_layers)} decoder "
            f"blocks routed), {_routing(c)}")


def describe_bart(c: BartTaskRoutedConfig) -> str:
    return (f"Task-level MoE over BART layers: {c.num_experts} experts per routed layer ({c.num_routed_layers} routed "
            f"layers), {_routing(c)}")


def prepare_dense(dense, dense_config):
    """No BART weights offline: a BERT checkpoint is warm-started into a BART (BERT2BERT, `bart_from_bert`)."""
    return bart_from_bert(dense) if getattr(dense_config, "model_type", None) == "bert" else dense


# upcycling: each expert of layer i from layer i, the rest under its own name (`TaskRoutingMixin._dense_rules`); the
# router is new
_LM = Family(
    name="task_routing", config_class=TaskRoutedLMConfig, model_class=TaskRoutedForCausalLM,
    auto_classes=TaskRoutedForCausalLM.auto_classes, problem_types=TEXT_TO_TEXT,
    pipeline_task=TEXT2TEXT_PIPELINE_TASK, describe=describe,
    upcycling=UpcyclingRules(rename=(), new=TaskRoutedForCausalLM.parameter_roles.new_patterns),
    backbone_kind=DECODER_BACKBONE, method="task-routing", aliases=("task_routed_lm", "task_routed_t5", "bart_routed"),
)
_SEQ2SEQ = replace(
    _LM, config_class=TaskRoutedSeq2SeqConfig, model_class=TaskRoutedForSeq2SeqLM,
    auto_classes=TaskRoutedForSeq2SeqLM.auto_classes, describe=describe_seq2seq, backbone_kind=ENCODER_DECODER_BACKBONE,
    export_kind="encoder_decoder", prepare_dense=prepare_dense,  # also for a saved BART warm-started from a BERT
)
#: one family, three models: the causal LM, the seq2seq LM and `BartTaskRouted` (which `family_for` picks for a
#: BART or a BERT checkpoint, the BERT warm-started into a BART)
FAMILY = register_family(replace(_LM, variants=(
    _SEQ2SEQ,
    replace(_SEQ2SEQ, config_class=BartTaskRoutedConfig, model_class=BartTaskRouted, describe=describe_bart,
            backbone_kind=None, dense_model_types=("bart", "bert")),
)))

__all__ = [
    "FAMILY", "BartTaskRouted", "BartTaskRoutedConfig", "T5RoutedBlock", "TaskRoutedCausalLMOutput",
    "TaskRoutedForCausalLM", "TaskRoutedForSeq2SeqLM", "TaskRoutedLMConfig", "TaskRoutedSeq2SeqConfig",
    "TaskRoutedSeq2SeqOutput", "bart_from_bert",
]
