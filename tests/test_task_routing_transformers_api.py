"""The task-routed models under transformers' generic model API, as transformers' own `ModelTesterMixin` exercises it
(tests/transformers_suite.py runs that mixin when its sdist is at hand; these run offline, always): resizing the
vocabulary through the dense model, the dense config's `tie_word_embeddings`, the tensor-parallel plan of the forked
layers, the initialisation of a model built on the meta device, and `output_hidden_states` as a list of indices."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    BartConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    T5Config,
    T5ForConditionalGeneration,
)

from hf_taskmoe import TaskSpec
from hf_taskmoe.layers.routing import RouteRecorder
from hf_taskmoe.models.task_routing import (
    BartTaskRouted,
    BartTaskRoutedConfig,
    TaskRoutedForCausalLM,
    TaskRoutedForSeq2SeqLM,
    TaskRoutedLMConfig,
    TaskRoutedSeq2SeqConfig,
)

VOCAB = 40
TASKS = [TaskSpec(name=n, problem_type="seq2seq") for n in ("x", "y")]
SPECIAL = dict(bos_token_id=2, eos_token_id=3, pad_token_id=0)


def llama(**kwargs):
    return LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=32, **SPECIAL, **kwargs)


def gpt2():
    return GPT2Config(n_embd=16, n_layer=2, n_head=2, n_positions=32, vocab_size=VOCAB, **SPECIAL)


def t5():
    return T5Config(d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2, vocab_size=VOCAB,
                    decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)


def bart():
    return BartConfig(vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=32,
                      decoder_ffn_dim=32, encoder_attention_heads=2, decoder_attention_heads=2,
                      max_position_embeddings=32, decoder_start_token_id=2, forced_eos_token_id=None, **SPECIAL)


def causal(dense=None) -> TaskRoutedForCausalLM:
    torch.manual_seed(0)
    return TaskRoutedForCausalLM(TaskRoutedLMConfig(dense_config=dense or llama(), tasks=TASKS)).eval()


def batch(seq: int = 6, vocab: int = VOCAB):
    g = torch.Generator().manual_seed(0)
    return dict(input_ids=torch.randint(4, vocab, (2, seq), generator=g), task_ids=torch.tensor([0, 1]))


# ---------------------------------------------------------------------------------------------------- resizing
def test_resizing_an_untied_causal_lm_resizes_its_lm_head_through_the_dense_model():
    model = causal(llama(tie_word_embeddings=False))
    assert model.get_output_embeddings() is model.backbone.lm_head
    model.resize_token_embeddings(VOCAB + 10)
    assert model.config.vocab_size == model.config.dense_config.vocab_size == model.vocab_size == VOCAB + 10
    assert model.get_input_embeddings().weight.shape[0] == VOCAB + 10
    assert model.get_output_embeddings().weight.shape[0] == VOCAB + 10
    assert model.get_output_embeddings() is model.backbone.lm_head  # replaced in the dense model, not beside it
    inputs = batch()
    inputs["input_ids"][0, -1] = VOCAB + 9  # a new token
    assert model(**inputs).logits.shape[-1] == VOCAB + 10


def test_set_output_embeddings_replaces_the_dense_models_lm_head():
    model = causal(llama(tie_word_embeddings=False))
    head = torch.nn.Linear(16, VOCAB, bias=False)
    model.set_output_embeddings(head)
    assert model.backbone.lm_head is head and model.get_output_embeddings() is head
    assert not hasattr(model, "lm_head")


def test_resizing_bart_routed_resizes_its_final_logits_bias():
    torch.manual_seed(0)
    model = BartTaskRouted(BartTaskRoutedConfig(dense_config=bart(), tasks=TASKS)).eval()
    model.resize_token_embeddings(VOCAB + 6)
    assert model.backbone.final_logits_bias.shape == (1, VOCAB + 6)
    assert model.config.vocab_size == VOCAB + 6
    out = model(**batch(), decoder_input_ids=torch.tensor([[2, VOCAB + 5], [2, 7]]))
    assert out.logits.shape == (2, 2, VOCAB + 6)
    model.resize_token_embeddings(VOCAB - 4)
    assert model.backbone.final_logits_bias.shape == (1, VOCAB - 4)


# ---------------------------------------------------------------------------------------------------- tying
@pytest.mark.parametrize("tie", [False, True])
def test_tie_word_embeddings_is_the_dense_configs(tie):
    config = TaskRoutedLMConfig(dense_config=llama(tie_word_embeddings=tie), tasks=TASKS)
    assert config.tie_word_embeddings is tie
    config.tie_word_embeddings = not tie  # set through to the dense model's config, which builds the LM head
    assert config.dense_config.tie_word_embeddings is (not tie)
    model = TaskRoutedForCausalLM(config)
    shared = model.backbone.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert shared is (not tie)
    # given at construction (a config.json carrying it at the top level)
    flat = TaskRoutedLMConfig(dense_config=llama(tie_word_embeddings=tie).to_dict(), tasks=TASKS,
                              tie_word_embeddings=not tie)
    assert flat.dense_config.tie_word_embeddings is (not tie) and flat.tie_word_embeddings is (not tie)


# ---------------------------------------------------------------------------------------------------- TP plan
def _plan_matches(pattern: str, names: set[str]) -> bool:
    regex = re.compile(re.escape(pattern).replace(r"\*", r"\d+") + r"(\.|$)")
    return any(regex.match(name) for name in names)


def test_the_tensor_parallel_plan_names_the_experts_of_the_forked_layers():
    model = causal()
    names = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_modules()}
    dense_plan = AutoModelForCausalLM.from_config(llama()).tp_plan
    assert model.tp_plan and len(model.tp_plan) == len(dense_plan)
    unmatched = [p for p in model.tp_plan if not _plan_matches(p, names)]
    assert not unmatched, unmatched
    assert model.tp_plan["backbone.model.layers.*.experts.*.self_attn.q_proj"] == dense_plan[
        "model.layers.*.self_attn.q_proj"]
    assert "backbone.lm_head" in model.tp_plan  # entries outside the layer stack keep their names
    model.init_parallel_plans()  # idempotent: gathered again from the dense model's
    assert not [p for p in model.tp_plan if not _plan_matches(p, names)]


# ---------------------------------------------------------------------------------------------------- meta init
@pytest.mark.parametrize("arch", ["t5", "gpt2"])
def test_a_model_built_on_the_meta_device_is_initialised_as_the_dense_model_is(arch):
    """`from_pretrained` with missing weights initialises them on the meta-built model with the dense model's own
    `_init_weights`: T5 sets its feed-forward and attention weights from the parent module, GPT-2 its scaled output
    projections, which transformers' custom-code path would skip (they kept their child layer's generic std)."""
    if arch == "t5":
        model_class, config_class, dense, dense_class = TaskRoutedForSeq2SeqLM, TaskRoutedSeq2SeqConfig, t5(), \
            T5ForConditionalGeneration
    else:
        model_class, config_class, dense, dense_class = TaskRoutedForCausalLM, TaskRoutedLMConfig, gpt2(), \
            GPT2LMHeadModel
    assert not model_class.is_custom_code()
    torch.manual_seed(0)
    model = model_class.from_pretrained(None, config=config_class(dense_config=dense, tasks=TASKS), state_dict={})
    reference = dense_class.from_pretrained(None, config=dense, state_dict={}).state_dict()
    stacks = model._layer_stacks()
    checked = 0
    for name, value in model.backbone.state_dict().items():
        prefix = next((p for p in stacks if name.startswith(p)), None)
        if prefix is None or value.dtype != torch.float32:
            continue
        index, _experts, _j, rest = name[len(prefix):].split(".", 3)
        want = reference[f"{prefix}{index}.{rest}"].std()
        torch.testing.assert_close(value.std(), want, rtol=0.3, atol=1e-6, msg=name)
        checked += 1
    assert checked > 20


# ---------------------------------------------------------------------------------------------------- hidden states
def test_output_hidden_states_takes_a_list_of_indices():
    model = causal()
    inputs = batch()
    full = model(**inputs, output_hidden_states=True).hidden_states
    assert len(full) == 3 and all(h is not None for h in full)
    picked = model(**inputs, output_hidden_states=[0, -1]).hidden_states
    assert len(picked) == 3 and picked[1] is None
    torch.testing.assert_close(picked[0], full[0])
    torch.testing.assert_close(picked[2], full[2])
    with pytest.raises(ValueError, match="out of range"):
        model(**inputs, output_hidden_states=[3])


def test_seq2seq_output_hidden_states_takes_a_list_of_indices_per_stack():
    torch.manual_seed(0)
    model = TaskRoutedForSeq2SeqLM(TaskRoutedSeq2SeqConfig(dense_config=t5(), tasks=TASKS)).eval()
    inputs = dict(batch(), decoder_input_ids=torch.tensor([[0, 5], [0, 6]]))
    full = model(**inputs, output_hidden_states=True)
    picked = model(**inputs, output_hidden_states=[1])
    for field in ("encoder_hidden_states", "decoder_hidden_states"):
        got, want = getattr(picked, field), getattr(full, field)
        assert len(got) == len(want) == 3 and got[0] is None and got[2] is None
        torch.testing.assert_close(got[1], want[1])


def test_route_recorder_refuses_indices_that_are_not_ints():
    with pytest.raises(ValueError, match="list of indices"):
        RouteRecorder([0, "1"], False, {})
    with pytest.raises(ValueError, match="list of indices"):
        RouteRecorder([True], False, {})
