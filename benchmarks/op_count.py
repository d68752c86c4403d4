"""aten operations dispatched by one training step (forward + backward) of each BERT family, against transformers'
`BertForSequenceClassification`: on a GPU each is at least one kernel launch, and a step of this size is bound by
launches (docs/scale-out.md, precision).

MiniLM-L6-H384 shapes with random weights (no download), a batch of 16 x 64 tokens (padded rows) mixing 5
single-label classification tasks, the models in training mode. The multi-task batch is checked on the host as the
Trainer's collator does (`BatchChecker.check`) and the forward is given what the collator adds: `values_checked=True`
and the rows per task, `task_counts`. Every operator call that reaches the dispatcher below autograd is counted
(`TorchDispatchMode`), the backward's included; the optimizer step is not. A warm-up step runs first, outside the
count.

    python benchmarks/op_count.py [--batch 16] [--seq 64] [--num-tasks 5] [--top 0]

Prints a table (with `--top k`, each model's k most frequent operators), then one JSON line:
{"ops": {model: count}, "ratio": {model: count / dense}, "goals": {...}, ...}
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import torch
from _bert_timing import make_batch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import BertConfig, BertForSequenceClassification, BertModel

from hf_taskmoe import BertForTaskMoE, BertWithPALs, CAMTLModel, TaskSpec
from hf_taskmoe.training.batches import BatchChecker

MINILM = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
#: the issue's goals (issue 34): a family's ops at most this multiple of the dense model's
GOALS = {"mt_dense": 1.05, "mt_tag_sorted_loop": 1.3, "mt_tag_grouped_mm": 1.3, "camtl": 1.3, "pals": 1.5}


class OpCounter(TorchDispatchMode):
    """Counts every aten operator call dispatched while active (forward and autograd's backward alike)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def build_models(num_tasks: int) -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    dense = BertModel(BertConfig(**MINILM))
    tasks = [TaskSpec(name=f"task{i}", num_labels=2) for i in range(num_tasks)]
    reference = BertForSequenceClassification(BertConfig(**MINILM, num_labels=2))
    reference.bert.load_state_dict(dense.state_dict())
    return {
        "bert_sequence_classification": reference,
        "mt_dense": BertForTaskMoE.from_dense(dense, tasks=tasks, num_experts=1),
        "mt_tag_sorted_loop": BertForTaskMoE.from_dense(dense, tasks=tasks, num_experts=4, gating="task"),
        "mt_tag_grouped_mm": BertForTaskMoE.from_dense(
            dense, tasks=tasks, num_experts=4, gating="task", experts_implementation="taskmoe_sorted_grouped"
        ),
        # what an accelerator runs ("auto" takes the per-group path on a CPU, where it is faster)
        "pals": BertWithPALs.from_dense(dense, tasks=tasks, pal_size=204, pal_dispatch="batched"),
        # what a CPU runs ("auto" there): one PAL call per group and layer, more operations but faster plain products
        "pals_per_group": BertWithPALs.from_dense(dense, tasks=tasks, pal_size=204, pal_dispatch="per_group"),
        "camtl": CAMTLModel.from_dense(dense, tasks=tasks, conditional_attention_max_length=128),
    }


def training_step(model: torch.nn.Module, batch: dict) -> None:
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()


def count_step(model: torch.nn.Module, batch: dict) -> Counter[str]:
    training_step(model, batch)  # warm-up: lazily made buffers, first-call paths
    with OpCounter() as counter:
        training_step(model, batch)
    return counter.ops


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--num-tasks", type=int, default=5)
    parser.add_argument("--top", type=int, default=0, help="Also list each model's k most frequent operators.")
    args = parser.parse_args()
    torch.set_num_threads(2)
    models = build_models(args.num_tasks)
    batch = make_batch(args.batch, args.seq, args.num_tasks, models["bert_sequence_classification"].config.vocab_size)
    dense_batch = {k: v for k, v in batch.items() if k != "task_ids"}
    counts = {}
    for name, model in models.items():
        model.train()
        if name == "bert_sequence_classification":
            step_batch = dense_batch
        else:
            marks = BatchChecker.for_model(model).check(batch)  # what the Trainer's collator does, on the CPU
            if marks is None:
                raise RuntimeError(f"{name}: the batch could not be checked on the host")
            step_batch = {**batch, **marks}  # values_checked=True, task_counts=(rows per task)
        counts[name] = count_step(model, step_batch)
    dense = sum(counts["bert_sequence_classification"].values())
    totals = {name: sum(ops.values()) for name, ops in counts.items()}
    ratios = {name: round(total / dense, 3) for name, total in totals.items()}

    print(f"aten ops per training step (forward + backward), {args.batch} x {args.seq} tokens, "
          f"{args.num_tasks} tasks mixed, MiniLM-L6-H384 shapes")
    print(f"{'model':<30} {'ops':>7} {'ratio':>7} {'goal':>7}")
    for name, total in totals.items():
        goal = f"<={GOALS[name]}" if name in GOALS else "-"
        print(f"{name:<30} {total:>7,} {ratios[name]:>7.3f} {goal:>7}")
        if args.top:
            print("    " + ", ".join(f"{op} {n}" for op, n in counts[name].most_common(args.top)))
    print(json.dumps({
        "ops": totals,
        "ratio": ratios,
        "goals": GOALS,
        "goals_met": {name: ratios[name] <= goal for name, goal in GOALS.items()},
        "batch": [args.batch, args.seq], "num_tasks": args.num_tasks, "torch": torch.__version__,
    }))


if __name__ == "__main__":
    main()
