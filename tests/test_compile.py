"""torch.compile trains the demo's families over batches that mix tasks differently from step to step, without
hitting dynamo's recompile limit (the run fails if it does), and matches eager training step for step.

`aot_eager` traces forward and backward as inductor would (the recompilations under test are the tracer's) without
generating C++; `benchmarks/compile_vs_eager.py` times the inductor build."""

import copy

import pytest
import torch

from hf_taskmoe import (
    BertForTaskMoE,
    BertPALsConfig,
    BertTaskMoEConfig,
    BertWithPALs,
    CAMTLConfig,
    CAMTLModel,
    TaskSpec,
)

SIZES = dict(
    vocab_size=60,
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=32,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)  # no dropout: eager and compiled see the same net
TASKS = [
    TaskSpec(name="a", num_labels=2),
    TaskSpec(name="b", num_labels=3),
    TaskSpec(name="c", problem_type="regression"),
]
FAMILIES = {
    "mt_tag": lambda: BertForTaskMoE(BertTaskMoEConfig(tasks=TASKS, num_experts=4, **SIZES)),
    "pals": lambda: BertWithPALs(BertPALsConfig(tasks=TASKS, pal_size=8, pal_num_heads=2, **SIZES)),
    "camtl": lambda: CAMTLModel(CAMTLConfig(tasks=TASKS, conditional_attention_max_length=8, **SIZES)),
}


def _batches(n=12, rows=6, length=8):
    g = torch.Generator().manual_seed(0)
    batches = []
    for step in range(n):
        # a different task composition every step: 1, 2 or 3 tasks, in varying proportions
        task_ids = torch.randint(0, 1 + step % 3, (rows,), generator=g).sort().values
        labels = torch.stack([
            torch.randint(0, 2, (), generator=g).float() if t == 0 else torch.randint(0, 3, (), generator=g).float()
            if t == 1 else torch.randn((), generator=g) for t in task_ids.tolist()
        ])
        batches.append(
            {
                "input_ids": torch.randint(3, 60, (rows, length), generator=g),
                "attention_mask": torch.ones(rows, length, dtype=torch.long),
                "task_ids": task_ids,
                "labels": labels,
            }
        )
    return batches


def _train(model, batches):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_compiled_training_over_mixed_batches(family):
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = FAMILIES[family]()
    compiled_model = copy.deepcopy(eager)
    batches = _batches()
    eager_losses = _train(eager.train(), batches)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        compiled = torch.compile(compiled_model.train(), backend="aot_eager")
        compiled_losses = _train(compiled, batches)
    assert compiled_losses == pytest.approx(eager_losses, rel=1e-4, abs=1e-5)
    assert eager_losses[-1] < eager_losses[0] or min(eager_losses[6:]) < max(eager_losses[:6])  # it trains
