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


@pytest.mark.ci
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


# -- fullgraph: one graph per family for every task mix (what CUDA graphs need) --------------------------------------
FULLGRAPH_FAMILIES = {
    # MT-TaG's default implementation under torch.compile: its grouped GEMMs, torch's `F.grouped_mm` in bf16 and
    # transformers' grouped product (a custom op with a fake kernel) in fp32, where torch 2.13's meta kernel of
    # aten._grouped_mm refuses the dtype: one graph in every dtype (eager code on a CPU runs its loop)
    "mt_tag_bf16": (FAMILIES["mt_tag"], torch.bfloat16),
    "mt_tag_fp32": (FAMILIES["mt_tag"], None),
    "pals": (FAMILIES["pals"], None),
    "camtl": (FAMILIES["camtl"], None),
}


def _checked(batches):
    """The batches as the Trainer's collator hands them over: checked on the host, marked `values_checked` and given
    their rows per task (`task_counts`, which differ from batch to batch and must not make the compiled forward
    recompile: a captured forward splits nothing)."""
    from hf_taskmoe.training.batches import BatchChecker

    checker = BatchChecker(TASKS, with_heads=True)
    marked = [(batch, checker.check(batch)) for batch in batches]
    return [{**batch, **marks} for batch, marks in marked if marks is not None]


def _sgd_steps(model, batches, autocast_dtype):
    """Training steps with plain SGD: a parameter with a zero gradient (an absent task's head on the every-row path
    of a compiled forward) and one with none (eager's split path) move alike, so the two runs stay comparable."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for batch in batches:
        with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.ci
@pytest.mark.parametrize("family", sorted(FULLGRAPH_FAMILIES))
def test_fullgraph_training_over_changing_task_mixes_compiles_once(family):
    """`torch.compile(fullgraph=True)` of the forward (the backward is AOTAutograd's graph) of a checked batch: no graph
    break (fullgraph raises on one), one graph for 12 batches of the same shape with different task mixes (the
    recompile limit is 1 and hitting it is an error), and the eager split forward's losses step for step."""
    from torch._dynamo.utils import counters

    build, autocast_dtype = FULLGRAPH_FAMILIES[family]
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager = build().train()
    compiled_model = copy.deepcopy(eager)
    batches = _checked(_batches())
    assert len(batches) == 12 and len({tuple(b["task_ids"].tolist()) for b in batches}) > 6
    assert len({b["task_counts"] for b in batches}) > 3
    eager_losses = _sgd_steps(eager, batches, autocast_dtype)
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
        compiled_losses = _sgd_steps(compiled, batches, autocast_dtype)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    tolerance = dict(rel=2e-2, abs=2e-2) if autocast_dtype is not None else dict(rel=1e-4, abs=1e-5)
    assert compiled_losses == pytest.approx(eager_losses, **tolerance)
    for (name, p), q in zip(eager.named_parameters(), compiled_model.parameters()):
        torch.testing.assert_close(q, p, atol=5e-3 if autocast_dtype is not None else 1e-5, rtol=1e-3, msg=name)


