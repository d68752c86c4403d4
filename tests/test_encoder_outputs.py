"""An encoder's hidden states and attentions, asked by argument or by the config (issue 32).

Every encoder method now runs the dense model's own forward (`hf_taskmoe.models.encoder`), so what transformers'
layers report is what the task model reports: the family contract checks the tuples for every family
(`tests/family_tester.py`), and transformers' own `ModelTesterMixin` checks them again
(`tests/test_transformers_suite.py`).
What is left here: the former bare encoders' names (`BertTaskMoEModel`, `CAMTLBertModel`, which return the encoder's
output) honour a flag passed as an argument over the config's."""

from __future__ import annotations

import pytest
import torch

from hf_taskmoe import BertTaskMoEModel

from .conftest import random_batch, tiny_config
from .test_camtl import _model as camtl_model


def _taskmoe():
    torch.manual_seed(0)
    return BertTaskMoEModel(tiny_config(num_experts=3)).eval()


def _camtl_large():
    """CAMTLModel's weights behind its bare encoder's name; the LARGE bottleneck's skip connection after the last layer
    changes the encoder's output."""
    from hf_taskmoe import CAMTLBertModel

    model = camtl_model(conditional_bottleneck="large")
    encoder = CAMTLBertModel(model.config)
    encoder.load_state_dict(model.state_dict())
    return encoder.eval()


@pytest.mark.parametrize("build", [_taskmoe, _camtl_large], ids=["bert_taskmoe", "camtl_large"])
def test_flags_off_by_argument_win_over_the_config(build):
    encoder = build()
    encoder.set_attn_implementation("eager")  # transformers allows `config.output_attentions` only on the eager path
    encoder.config.output_hidden_states = encoder.config.output_attentions = True
    batch = random_batch(encoder.config, task_ids=torch.arange(6) % encoder.config.num_tasks)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        off = encoder(**inputs, output_hidden_states=False, output_attentions=False)
        on = encoder(**inputs)
    assert off.hidden_states is None and off.attentions is None
    assert len(on.hidden_states) == encoder.config.num_hidden_layers + 1
    assert len(on.attentions) == encoder.config.num_hidden_layers
    torch.testing.assert_close(off.last_hidden_state, on.hidden_states[-1], atol=0, rtol=0)
