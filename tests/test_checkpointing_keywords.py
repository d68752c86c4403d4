"""Activation checkpointing of a task model takes its `torch.utils.checkpoint` keywords by position or by name
(`hf_taskmoe.compat.checkpointing_enable_with`): transformers' deprecated `gradient_checkpointing_enable` passes them
by name, which the override once received twice (a TypeError)."""

from __future__ import annotations

import pytest
import torch
from transformers import BertConfig

from hf_taskmoe import TaskMoEConfig, TaskMoEForMultiTask, TaskSpec
from hf_taskmoe.compat import CHECKPOINTING_ENABLE, CHECKPOINTING_KWARGS

TASKS = [TaskSpec(name="a", num_labels=3), TaskSpec(name="b", problem_type="regression")]


def _model():
    torch.manual_seed(0)
    return TaskMoEForMultiTask(TaskMoEConfig(
        dense_config=BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                                vocab_size=60, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
        tasks=TASKS, num_experts=3)).train()


def _grads(model):
    batch = {"input_ids": torch.randint(4, 60, (4, 7), generator=torch.Generator().manual_seed(0)),
             "task_ids": torch.tensor([0, 1, 0, 1]), "labels": torch.tensor([1.0, 0.5, 2.0, -0.5])}
    model(**batch).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("how", ["position", "name", "deprecated alias"])
def test_the_checkpoint_keywords_arrive_by_position_or_by_name(how):
    reference = _grads(_model())
    model = _model()
    enable = getattr(model, CHECKPOINTING_ENABLE)
    if how == "position":
        enable({"use_reentrant": False})
    elif how == "name":
        enable(**{CHECKPOINTING_KWARGS: {"use_reentrant": False}})
    else:
        with pytest.warns(FutureWarning) if CHECKPOINTING_ENABLE != "gradient_checkpointing_enable" else _nothing():
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    got = _grads(model)
    assert got.keys() == reference.keys()
    for name, grad in reference.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6)


def _nothing():
    from contextlib import nullcontext

    return nullcontext()
