"""Every bad input raises a ValueError that names what is wrong, before any layer runs."""

import pytest
import torch

from hf_taskmoe import BertForTaskMoE, BertTaskMoEConfig, TaskSpec

from .conftest import ALL_KINDS, TINY, random_batch, tiny_config


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return BertForTaskMoE(tiny_config(tasks=ALL_KINDS[:3])).eval()  # sst2 (2 classes), mnli (3), stsb (regression)


def _batch(model, **changes):
    batch = random_batch(model.config, batch=4, seq=7, task_ids=torch.tensor([0, 1, 2, 0]))
    batch["labels"] = torch.tensor([1.0, 2.0, 0.5, 0.0])
    batch.update(changes)
    return {k: v for k, v in batch.items() if v is not None}


CASES = {
    "missing task_ids": (dict(task_ids=None), r"`task_ids` is required: this model has 3 tasks"),
    "task id out of range": (dict(task_ids=torch.tensor([0, 1, 3, 0])), r"Only 3 tasks available.*found task id = 3 \(row 2\)"),
    "negative task id": (dict(task_ids=torch.tensor([0, -1, 2, 0])), r"found task id = -1"),
    "float task ids": (dict(task_ids=torch.tensor([0.0, 1.0, 2.0, 0.0])), r"`task_ids` must be an integer tensor"),
    "task_ids batch mismatch": (dict(task_ids=torch.tensor([0, 1, 2])), r"`task_ids` must have shape \(batch,\) = \(4,\)"),
    "class index >= num_labels": (dict(labels=torch.tensor([2.0, 2.0, 0.5, 0.0])), r"task 'sst2' must be in \[0, 2\).*rows \[0\]"),
    "regression labels not float": (
        dict(task_ids=torch.tensor([2, 2, 2, 2]), labels=torch.tensor([1, 2, 3, 4])),
        r"regression task 'stsb' must be floating point",
    ),
    "labels batch mismatch": (dict(labels=torch.tensor([1.0, 2.0, 0.5])), r"`labels` must have 4 rows"),
    "attention_mask shape": (dict(attention_mask=torch.ones(4, 6, dtype=torch.long)), r"`attention_mask` must have shape \(batch, seq\) = \(4, 7\)"),
    "token_type_ids batch": (dict(token_type_ids=torch.zeros(3, 7, dtype=torch.long)), r"`token_type_ids` must have shape"),
    "input_ids 3-D": (dict(input_ids=torch.ones(4, 2, 7, dtype=torch.long)), r"`input_ids` must have shape \(batch, seq\)"),
}


@pytest.mark.parametrize("changes, message", CASES.values(), ids=CASES.keys())
def test_bad_input_raises_before_compute(model, changes, message):
    calls = []
    hook = model.bert.embeddings.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match=message):
            model(**_batch(model, **changes))
    finally:
        hook.remove()
    assert not calls, "the encoder ran before the input was rejected"


def test_both_or_neither_inputs(model):
    with pytest.raises(ValueError, match="exactly one of `input_ids` or `inputs_embeds`"):
        model(task_ids=torch.tensor([0]))


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(gating="per-token"), "gating"),
        (dict(num_experts=0), "num_experts"),
        (dict(num_experts=2, top_k=3), "top_k"),
        (dict(expert_weighting="soft"), "expert_weighting"),
        (dict(classifier_pooling="max"), "classifier_pooling"),
        (dict(moe_layers=[0, 5]), "moe_layers"),
        (dict(moe_layers=[1, 1]), "moe_layers"),
        (dict(router_init_std=-1.0), "router_init_std"),
        (dict(router_aux_loss_coef="x"), "router_aux_loss_coef"),
        (dict(hidden_size=30), "hidden_size"),
        (dict(hidden_size="32"), "hidden_size"),
        (dict(hidden_dropout_prob="a"), "hidden_dropout_prob"),
        (dict(tasks=[{"name": "x", "problem_type": "ranking", "num_labels": 2}]), "problem_type"),
        (dict(tasks=[{"name": "s", "problem_type": "seq2seq"}]), "needs a decoder"),
        (dict(tasks=None), "tasks"),
    ],
)
def test_bad_config_values_name_the_field(overrides, field):
    kwargs = {**TINY, "tasks": [{"name": "a", "num_labels": 2}], **overrides}
    with pytest.raises(ValueError, match=field):
        BertTaskMoEConfig(**kwargs)


def test_unknown_problem_type_in_taskspec():
    with pytest.raises(ValueError, match="problem_type"):
        TaskSpec(name="x", problem_type="ranking")
