"""An encoder's hidden states and attentions, asked by argument or by the config (issue 32).

Every encoder method now runs the dense model's own forward (`hf_taskmoe.models.encoder`), so what transformers'
layers report is what the task model reports: the family contract checks the tuples for every family
(`tests/family_tester.py`), and transformers' own `ModelTesterMixin` checks them again
(`tests/test_transformers_suite.py`).
What is left here: a model's encoder (`encode`, which returns the encoder's output) honours a flag passed as an
argument over the config's."""

from __future__ import annotations

import pytest
import torch

from hf_taskmoe import BertForTaskMoE

from .conftest import random_batch, tiny_config
from .test_camtl import _model as camtl_model


def _taskmoe():
    torch.manual_seed(0)
    return BertForTaskMoE(tiny_config(num_experts=3)).eval()


def _camtl_large():
    """The LARGE bottleneck's skip connection after the last layer changes the encoder's output."""
    return camtl_model(conditional_bottleneck="large").eval()


def _encode(model, flags=(), **inputs):
    return model.encode(inputs["input_ids"], inputs["attention_mask"], inputs["token_type_ids"], None, None,
                        inputs["task_ids"], *flags)


@pytest.mark.parametrize("build", [_taskmoe, _camtl_large], ids=["bert_taskmoe", "camtl_large"])
def test_flags_off_by_argument_win_over_the_config(build):
    encoder = build()
    encoder.set_attn_implementation("eager")  # transformers allows `config.output_attentions` only on the eager path
    encoder.config.output_hidden_states = encoder.config.output_attentions = True
    batch = random_batch(encoder.config, task_ids=torch.arange(6) % encoder.config.num_tasks)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        off = _encode(encoder, (False, False), **inputs)  # output_attentions, output_hidden_states
        on = _encode(encoder, **inputs)
    assert off.hidden_states is None and off.attentions is None
    assert len(on.hidden_states) == encoder.config.num_hidden_layers + 1
    assert len(on.attentions) == encoder.config.num_hidden_layers
    torch.testing.assert_close(off.last_hidden_state, on.hidden_states[-1], atol=0, rtol=0)
