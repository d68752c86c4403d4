"""Issue 45, item 3 ("equivalence first"): BART through the one task-routing implementation (the encoder-decoder class
that serves T5, `TaskRoutedForSeq2SeqLM`, over BART declared as an encoder-decoder backbone) computes what
`BartTaskRouted` computes, on the same weights moved through a key map: to 1e-6 in evaluation (logits, hidden states,
losses, routing outputs) and in one training step (loss, per-task losses, every parameter's gradient; dropout 0, the
same Gumbel noise), and greedy and beam generation token for token."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import BartConfig, BartForConditionalGeneration

from hf_taskmoe import BartTaskRouted, TaskSpec
from hf_taskmoe.models.task_routing import TaskRoutedForSeq2SeqLM, TaskRoutedSeq2SeqConfig

from .equivalence import KeyMap, assert_same_training_step, close, load_mapped

TASKS = [TaskSpec(name=n, problem_type="seq2seq") for n in ("cls", "qa", "summ")]
TINY_BART = dict(
    vocab_size=60, d_model=16, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
    encoder_attention_heads=2, decoder_attention_heads=2, max_position_embeddings=40, dropout=0.0,
    forced_eos_token_id=None,
)
#: `BartTaskRouted` -> the encoder-decoder routed class: BART's modules move under `backbone.` (the dense
#: `BartForConditionalGeneration` the class wraps); the router keeps its names
BART_ROUTED_KEYS: KeyMap = [(r"^(model\.|lm_head\.|final_logits_bias$)", r"backbone.\1")]
#: the routing fields both configs share
ROUTING_FIELDS = (
    "num_experts", "selection", "router_type", "router_hidden_size", "router_attention_heads", "task_embedding_dim",
    "freeze_task_embeddings", "routed_encoder_layers", "routed_decoder_layers", "gumbel_temperature",
    "gumbel_min_temperature", "gumbel_anneal_rate", "router_init_std", "task_embedding_init_std",
)


def pair(selection="gumbel_softmax_st", seed=0, **kwargs):
    """A `BartTaskRouted` with distinct experts and router, and the generic class holding the same weights."""
    torch.manual_seed(seed)
    dense = BartForConditionalGeneration(BartConfig(**TINY_BART))
    reference = BartTaskRouted.from_dense(dense, TASKS, expert_noise_variance=0.0, selection=selection, **kwargs)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if ".experts." in name or name.startswith("router."):
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    config = TaskRoutedSeq2SeqConfig.from_dense_config(
        dense.config, TASKS, **{name: getattr(reference.config, name) for name in ROUTING_FIELDS}
    )
    model = TaskRoutedForSeq2SeqLM(config)
    names = load_mapped(model, reference, BART_ROUTED_KEYS)
    model.generation_config = copy.deepcopy(reference.generation_config)
    return reference.eval(), model.eval(), names


def batch(rows=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(3, 60, (rows, 7), generator=g)
    x[1, 5:] = 1  # padding
    labels = torch.randint(3, 60, (rows, 5), generator=g)
    labels[0, 3:] = -100
    return {"input_ids": x, "attention_mask": (x != 1).long(), "labels": labels, "task_ids": torch.arange(rows) % 3}


@pytest.mark.parametrize("selection", ["average", "softmax", "gumbel_softmax_st", "hard"])
def test_evaluation_is_the_same(selection):
    reference, model, _ = pair(selection)
    b = batch()
    with torch.no_grad():
        expected = reference(**b, output_router_logits=True, output_hidden_states=True)
        got = model(**b, output_router_logits=True, output_hidden_states=True)
    for field in ("logits", "loss", "encoder_last_hidden_state", "routing_decisions", "router_logits",
                  "routing_counts"):
        close(getattr(got, field), getattr(expected, field), field)
    for field in ("encoder_hidden_states", "decoder_hidden_states"):
        assert len(getattr(got, field)) == len(getattr(expected, field)) == 3
        for i, (a, e) in enumerate(zip(getattr(got, field), getattr(expected, field), strict=True)):
            close(a, e, f"{field}[{i}]")
    assert set(got.task_losses) == set(expected.task_losses)
    for task, loss in expected.task_losses.items():
        close(got.task_losses[task], loss, f"loss of {task!r}")
    if selection != "average":  # (average routing ignores the task)
        assert not torch.equal(expected.router_logits[0], expected.router_logits[1])  # the tasks' routes differ


def test_partial_routing_and_disabled_experts_are_the_same():
    reference, model, _ = pair(routed_encoder_layers=[1], routed_decoder_layers=[0])
    b = batch(seed=3)
    for m in (reference, model):
        m.disable_experts([("E1", 0), ("D0", 1)])
    with torch.no_grad():
        close(model(**b).logits, reference(**b).logits, "logits")


@pytest.mark.parametrize("selection", ["softmax", "gumbel_softmax_st", "hard"])
def test_a_training_step_is_the_same(selection):
    reference, model, names = pair(selection)
    for m in (reference, model):  # the same Gumbel noise in both
        m.register_forward_pre_hook(lambda *_: torch.manual_seed(7) and None)
    assert_same_training_step(reference, model, batch(seed=1), names)


@pytest.mark.parametrize("beams", [1, 3])
def test_generation_is_the_same_token_for_token(beams):
    reference, model, _ = pair("gumbel_softmax_st")
    b = batch(rows=6, seed=2)
    kwargs = dict(input_ids=b["input_ids"], attention_mask=b["attention_mask"], task_ids=b["task_ids"],
                  max_new_tokens=8, num_beams=beams, do_sample=False)
    expected = reference.generate(**kwargs)
    got = model.generate(**kwargs)
    assert torch.equal(got, expected)
    assert len({tuple(row.tolist()) for row in expected}) > 1  # not one constant output
