"""MT-Uncertainty sampling (CA-MTL Algorithm 1) against the algorithm computed by hand, and with every family."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from hf_taskmoe import BertForTaskMoE, BertWithPALs, CAMTLModel, TaskSpec
from hf_taskmoe.modeling_utils import MultiTaskModelOutput
from hf_taskmoe.training import MTUncertaintySampling, MultiTaskTrainingArguments, example_layout
from hf_taskmoe.training.samplers import build_task_sampling

from .conftest import random_batch, tiny_config
from .test_bert_pals import pals_config
from .test_camtl import camtl_config
from .test_trainer import make_trainer


class FixedLogits(nn.Module):
    """Returns hand-made logits: row r of the pool reads `table[task][input_ids[r, 0]]`."""

    def __init__(self, specs, table):
        super().__init__()
        self.config = SimpleNamespace(task_specs=specs, task_names=[s.name for s in specs])
        self.table = table
        self.calls = []
        self.weight = nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, task_ids, attention_mask=None, **kwargs):
        self.calls.append((self.training, torch.is_grad_enabled(), len(task_ids)))
        out = {}
        for t, spec in enumerate(self.config.task_specs):
            rows = torch.nonzero(task_ids == t).flatten()
            if len(rows):
                logits = torch.stack([self.table[t][i] for i in input_ids[rows, 0].tolist()])
                if spec.problem_type == "multiple_choice":
                    logits = logits[:, 0].view(-1, spec.num_choices)
                out[spec.name] = logits
        return MultiTaskModelOutput(task_logits=out, task_ids=task_ids)


def _pool(task_of_rows, labels=None):
    n = len(task_of_rows)
    counters = {}
    index = []
    for t in task_of_rows:
        index.append(counters.get(t, 0))
        counters[t] = counters.get(t, 0) + 1
    batch = {
        "input_ids": torch.tensor(index).unsqueeze(1).repeat(1, 3),
        "attention_mask": torch.ones(n, 3, dtype=torch.long),
        "task_ids": torch.tensor(task_of_rows),
    }
    if labels is not None:
        batch["labels"] = torch.tensor(labels, dtype=torch.float)
    return batch


def _by_hand(probabilities: list[list[list[float]]]) -> np.ndarray:
    """Algorithm 1 line by line: entropies, H', the max average entropy, U."""
    u, averages = [], []
    for task in probabilities:
        h = [-sum(p * math.log(p) for p in probs if p > 0) for probs in task]
        h_uniform = -sum((1 / len(task[0])) * math.log(1 / len(task[0])) for _ in task[0])
        averages.append(sum(h) / len(h))
        u.append([x / h_uniform for x in h])
    h_hat = max(averages)
    return np.array([x / h_hat for task in u for x in task])


def test_selection_matches_algorithm_1_by_hand():
    specs = [
        TaskSpec(name="binary", num_labels=2),
        TaskSpec(name="three", num_labels=3),
        TaskSpec(name="four", num_labels=4),
    ]
    probabilities = [
        [[0.5, 0.5], [0.9, 0.1], [0.99, 0.01]],
        [[0.2, 0.3, 0.5], [0.8, 0.1, 0.1], [1 / 3, 1 / 3, 1 / 3]],
        [[0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25], [0.97, 0.01, 0.01, 0.01]],
    ]
    table = [[torch.tensor(p).log() for p in task] for task in probabilities]
    model = FixedLogits(specs, table)
    strategy = MTUncertaintySampling()
    pool = _pool([0, 0, 0, 1, 1, 1, 2, 2, 2])
    chosen = strategy.select(model, pool, batch_size=3, step=0)
    expected = _by_hand(probabilities)
    np.testing.assert_allclose(strategy.last_uncertainty, expected, rtol=1e-5)
    top = np.sort(np.argsort(-expected)[:3])
    assert chosen["task_ids"].tolist() == pool["task_ids"][top].tolist()
    assert chosen["input_ids"].tolist() == pool["input_ids"][top].tolist()
    assert strategy.last_counts.tolist() == np.bincount(pool["task_ids"][top].numpy(), minlength=3).tolist()
    # scoring ran once, in eval mode, without gradients, and the model is back in train mode
    model.train()
    strategy.select(model, pool, batch_size=3, step=1)
    assert model.calls[-1] == (False, False, 9) and model.training


def test_multiple_choice_rows_stay_together_and_other_problem_types_score():
    specs = [
        TaskSpec(name="mc", problem_type="multiple_choice", choice_fields=["a", "b"]),
        TaskSpec(name="ml", problem_type="multi_label_classification", num_labels=2),
    ]
    # mc: example 0 rows 0-1 (certain), example 1 rows 2-3 (uniform); ml: example 0 certain, example 1 p = 0.5
    table = [
        [torch.tensor([10.0]), torch.tensor([-10.0]), torch.tensor([0.0]), torch.tensor([0.0])],
        [torch.tensor([9.0, -9.0]), torch.tensor([0.0, 0.0])],
    ]
    model = FixedLogits(specs, table)
    pool = _pool([0, 0, 0, 0, 1, 1])
    rows, tasks = example_layout(pool["task_ids"], specs)
    assert rows.tolist() == [0, 0, 1, 1, 2, 3] and tasks.tolist() == [0, 0, 1, 1]
    strategy = MTUncertaintySampling()
    chosen = strategy.select(model, pool, batch_size=2, step=0)
    # the uniform choice (U = 1/H^) and the p = 0.5 multi-label example (2 log 2 / 2 log 2 = 1) win
    assert chosen["task_ids"].tolist() == [0, 0, 1] and chosen["input_ids"][:, 0].tolist() == [2, 3, 1]
    assert strategy.last_uncertainty[1] == pytest.approx(strategy.last_uncertainty[3])


def test_regression_uncertainty_mean_and_error():
    specs = [TaskSpec(name="cls", num_labels=2), TaskSpec(name="reg", problem_type="regression")]
    table = [[torch.tensor([0.0, 0.0]), torch.tensor([5.0, -5.0])], [torch.tensor([0.0]), torch.tensor([2.0])]]
    model = FixedLogits(specs, table)
    pool = _pool([0, 0, 1, 1], labels=[0, 1, 0.0, 0.0])
    mean = MTUncertaintySampling(regression_uncertainty="mean")
    mean.select(model, pool, batch_size=2, step=0)
    u = mean.last_uncertainty
    assert u[2] == pytest.approx(u[:2].mean()) and u[3] == pytest.approx(u[:2].mean())
    error = MTUncertaintySampling(regression_uncertainty="error")
    chosen = error.select(model, pool, batch_size=2, step=0)
    # labels 0, 0: variance 0 -> squared error itself, clipped to 1: example 0 -> 0, example 1 -> 1
    h_hat = error.last_uncertainty[0]  # the uniform binary example has H/H' = 1, so U = 1 / H^
    assert error.last_uncertainty[2] == 0 and error.last_uncertainty[3] == pytest.approx(h_hat)
    assert sorted(chosen["input_ids"][:, 0].tolist()) == [0, 1] and chosen["task_ids"].tolist() == [0, 1]
    with pytest.raises(ValueError, match="needs the candidates' labels"):
        error.select(model, {k: v for k, v in pool.items() if k != "labels"}, batch_size=2, step=0)


def test_score_every_k_steps_keeps_the_last_composition():
    specs = [TaskSpec(name="a", num_labels=2), TaskSpec(name="b", num_labels=2)]
    table = [[torch.tensor([0.0, 0.0])] * 4, [torch.tensor([4.0, -4.0])] * 4]  # task a always more uncertain
    model = FixedLogits(specs, table)
    strategy = MTUncertaintySampling(score_every=3)
    pool = _pool([0] * 4 + [1] * 4)
    picked = [strategy.select(model, pool, batch_size=3, step=s)["task_ids"].tolist() for s in range(6)]
    assert len(model.calls) == 2  # steps 0 and 3
    assert all(p == [0, 0, 0] for p in picked)
    assert strategy.pop_metrics(["a", "b"]) == {"sampled/a": 1.0, "sampled/b": 0.0}
    assert strategy.state_dict() == {"last_counts": [3, 0]}
    fresh = MTUncertaintySampling(score_every=3)
    fresh.load_state_dict(strategy.state_dict())
    assert fresh.select(model, pool, batch_size=3, step=4)["task_ids"].tolist() == [0, 0, 0] and len(model.calls) == 2


@pytest.mark.parametrize("family", ["bert_taskmoe", "bert_pals", "camtl"])
def test_works_with_every_family(family):
    tasks = [TaskSpec(name="a", num_labels=3), TaskSpec(name="b", problem_type="regression"),
             TaskSpec(name="tags", problem_type="token_classification", num_labels=4)]
    torch.manual_seed(0)
    model = {
        "bert_taskmoe": lambda: BertForTaskMoE(tiny_config(tasks=tasks)),
        "bert_pals": lambda: BertWithPALs(pals_config(tasks=tasks)),
        "camtl": lambda: CAMTLModel(camtl_config(tasks=tasks)),
    }[family]()
    model.train()
    batch = random_batch(model.config, batch=9, task_ids=torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2]))
    batch["labels"] = torch.zeros(9, 9, dtype=torch.float)
    batch["labels"][:6, 1:] = -100  # the collator's padding: one label per classification and regression row
    chosen = MTUncertaintySampling().select(model, batch, batch_size=4, step=0)
    assert len(chosen["task_ids"]) == 4 and chosen["labels"].shape == (4, 9) and model.training
    assert torch.isfinite(model(**chosen).loss)


def test_trainer_trains_with_uncertainty_sampling_and_logs_task_shares(tmp_path):
    trainer = make_trainer(
        tmp_path, task_sampling="uncertainty", max_steps=4, logging_steps=2, uncertainty_score_every=2
    )
    assert isinstance(trainer.task_sampler.strategy, MTUncertaintySampling)
    assert trainer.task_sampler.strategy.score_every == 2
    rows = []
    trainer.model.register_forward_pre_hook(lambda m, a, kw: rows.append(len(kw["task_ids"])), with_kwargs=True)
    trainer.train()
    batch = trainer.args.per_device_train_batch_size
    assert rows.count(batch) >= 4  # every training forward runs on the chosen batch
    logged = [h for h in trainer.state.log_history if "loss" in h]
    shares = {k: v for k, v in logged[-1].items() if k.startswith("sampled/")}
    assert set(shares) == {f"sampled/{n}" for n in trainer.model.config.task_names}
    assert sum(shares.values()) == pytest.approx(1.0, abs=1e-3)


def test_bad_options():
    with pytest.raises(ValueError, match="score_every"):
        MTUncertaintySampling(score_every=0)
    with pytest.raises(ValueError, match="regression_uncertainty"):
        build_task_sampling("uncertainty", regression_uncertainty="median")
    with pytest.raises(ValueError, match="uncertainty_regression"):
        MultiTaskTrainingArguments(output_dir="x", task_sampling="uncertainty", uncertainty_regression="median")
