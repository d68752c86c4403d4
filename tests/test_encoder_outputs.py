"""Issue 32: one loop collects every encoder family's hidden states and attentions (`run_layer_stack`).

The loop on toy layers that are not BERT's, then each BERT family through it: `hidden_states[0]` is what the first
layer reads (the embeddings; after CA-MTL's conditional alignment), the last is `last_hidden_state` (also after
CA-MTL's LARGE skip), one attention map per layer, the same tuples from the task-level model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_taskmoe import BertTaskMoEModel
from hf_taskmoe.models import multitask_bert
from hf_taskmoe.models.multitask_bert import LayerStackOutput, run_layer_stack

from .conftest import random_batch, tiny_config
from .test_bert_pals import _model as pals_model
from .test_camtl import _model as camtl_model


def _toy_stack(hidden, **flags):
    layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
    calls = []

    def step(index, layer, hidden):
        calls.append(index)
        return layer(hidden), torch.full((1,), float(index))  # a stand-in "attention" naming its layer

    return layers, calls, run_layer_stack(layers, hidden, step, **flags)


def test_the_loop_calls_each_layer_once_in_order_and_collects_only_what_is_asked():
    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 4)
    layers, calls, plain = _toy_stack(hidden)
    assert calls == [0, 1, 2] and plain.hidden_states is None and plain.attentions is None
    expected = hidden
    for layer in layers:
        expected = layer(expected)
    torch.testing.assert_close(plain.last_hidden_state, expected, atol=0, rtol=0)

    _, _, asked = _toy_stack(hidden, output_hidden_states=True, output_attentions=True)
    assert len(asked.hidden_states) == len(layers) + 1 and asked.hidden_states[0] is hidden
    assert asked.hidden_states[-1] is asked.last_hidden_state
    assert [a.item() for a in asked.attentions] == [0.0, 1.0, 2.0]


def test_with_last_hidden_state_keeps_hidden_states_ending_in_the_output():
    hidden = torch.zeros(1, 2, 4)
    _, _, stack = _toy_stack(hidden, output_hidden_states=True)
    final = stack.last_hidden_state + 1
    tied = stack.with_last_hidden_state(final)
    assert tied.last_hidden_state is final and tied.hidden_states[-1] is final
    assert tied.hidden_states[:-1] == stack.hidden_states[:-1] and len(tied.hidden_states) == len(stack.hidden_states)
    assert LayerStackOutput(hidden).with_last_hidden_state(final).hidden_states is None


def _taskmoe():
    """MT-TaG runs the dense model's own forward (`TaskMoEForMultiTask`), not this loop; its former bare encoder's
    name returns the encoder's output."""
    torch.manual_seed(0)
    return BertTaskMoEModel(tiny_config(num_experts=3)).eval()


FAMILIES = {
    "bert_pals": pals_model,
    # LARGE bottleneck: a skip connection after the last layer changes the encoder's output
    "camtl_large": lambda: camtl_model(conditional_bottleneck="large"),
    "camtl_base": lambda: camtl_model(conditional_bottleneck="base"),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_reports_through_the_one_loop(family, monkeypatch):
    model = FAMILIES[family]()
    model.set_attn_implementation("eager")  # attention probabilities exist only on the eager path
    config = model.config
    batch = random_batch(config, task_ids=torch.arange(6) % config.num_tasks)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    stacks = []

    def spy(*args, **kwargs):
        stacks.append(run_layer_stack(*args, **kwargs))
        return stacks[-1]

    monkeypatch.setattr(multitask_bert, "run_layer_stack", spy)
    with torch.no_grad():
        encoded = model.bert(**inputs, output_hidden_states=True, output_attentions=True)
        full = model(**batch, output_hidden_states=True, output_attentions=True)
        if hasattr(model.bert, "first_layer_inputs"):  # CA-MTL: the embeddings after the conditional alignment
            first = model.bert.first_layer_inputs(inputs["input_ids"], token_type_ids=inputs["token_type_ids"],
                                                  task_ids=inputs["task_ids"])
        else:
            first = model.bert.embeddings(input_ids=inputs["input_ids"], token_type_ids=inputs["token_type_ids"])
    assert len(stacks) == 2, "the encoder and the task-level model each run the layers through run_layer_stack"

    hidden_states, attentions = encoded.hidden_states, encoded.attentions
    assert len(hidden_states) == config.num_hidden_layers + 1 and len(attentions) == config.num_hidden_layers
    torch.testing.assert_close(hidden_states[0], first, atol=0, rtol=0)
    assert hidden_states[-1] is encoded.last_hidden_state
    if family == "camtl_large":  # the reported last state is h_L + s_L, not the last layer's own output
        assert not torch.equal(stacks[0].last_hidden_state, encoded.last_hidden_state)
    for attention in attentions:
        assert attention.shape == (6, config.num_attention_heads, 9, 9)
        torch.testing.assert_close(attention.sum(-1), torch.ones(6, config.num_attention_heads, 9))
    # the task-level model hands on the encoder's tuples
    for ours, theirs in ((full.hidden_states, hidden_states), (full.attentions, attentions)):
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("family", ["bert_taskmoe", "camtl_large"])
def test_flags_off_by_argument_win_over_the_config(family):
    model = {**FAMILIES, "bert_taskmoe": _taskmoe}[family]()
    encoder = getattr(model, "bert", model)
    model.set_attn_implementation("eager")  # transformers allows `config.output_attentions` only on the eager path
    model.config.output_hidden_states = model.config.output_attentions = True
    batch = random_batch(model.config, task_ids=torch.arange(6) % model.config.num_tasks)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        off = encoder(**inputs, output_hidden_states=False, output_attentions=False)
        on = encoder(**inputs)
    assert off.hidden_states is None and off.attentions is None
    assert len(on.hidden_states) == model.config.num_hidden_layers + 1
    torch.testing.assert_close(off.last_hidden_state, on.hidden_states[-1], atol=0, rtol=0)
