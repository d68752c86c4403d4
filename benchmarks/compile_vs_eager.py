"""torch.compile (inductor) vs eager: MT-TaG (4 experts, top-1, task gates) upcycled from MiniLM-L6-H384, training
steps (forward + backward) over batches whose task composition changes from step to step.

The compiled model first runs every distinct batch once (`--batches` of them: the compile cost, reported as
`compile_s`, with dynamo's recompile limit made an error), then both models alternate over the same batches;
each figure is a median. The expert loop is a graph break by design (`hf_taskmoe.layers.moe._expert_loop`); the
rest of each layer is compiled.

    python benchmarks/compile_vs_eager.py [--rounds 6] [--batches 6] [--threads 2] [--batch 16] [--seq 64]

Prints a table, then one JSON line: {"compiled_over_eager": ..., "compile_s": ..., ...}
"""

from __future__ import annotations

import json
import statistics

import torch
from _bert_timing import benchmark_parser, make_batch, prepare, timed, train_step

from hf_taskmoe import BertForTaskMoE


def main():
    parser = benchmark_parser(__doc__, rounds=6, num_tasks=8)
    parser.add_argument("--batches", type=int, default=6, help="Distinct batches (task compositions) cycled over.")
    parser.add_argument("--backend", default="inductor")
    parser.set_defaults(batch=16, seq=64)
    args = parser.parse_args()
    source, source_name, tasks = prepare(args)
    eager = BertForTaskMoE.from_dense(source, tasks=tasks, num_experts=4, gating="task").train()
    compiled_model = BertForTaskMoE.from_dense(source, tasks=tasks, num_experts=4, gating="task").train()
    vocab = eager.config.vocab_size
    batches = []
    for i in range(args.batches):
        batch = make_batch(args.batch, args.seq, args.num_tasks, vocab, seed=i)
        # task composition varies: batch i holds tasks 0..(i % num_tasks), in runs
        batch["task_ids"] = (torch.arange(args.batch) * (1 + i % args.num_tasks) // args.batch).sort().values
        batches.append(batch)

    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        compiled = torch.compile(compiled_model, backend=args.backend)
        compile_s = sum(timed(lambda: train_step(compiled, b)) for b in batches)  # noqa: B023  (called right away)
        for b in batches[: args.warmup]:
            train_step(eager, b)
        times = {"eager": [], "compiled": []}
        for r in range(args.rounds):
            for b in batches:
                pair = [("eager", eager), ("compiled", compiled)]
                for name, model in (pair if r % 2 == 0 else pair[::-1]):
                    times[name].append(timed(lambda: train_step(model, b)))  # noqa: B023  (timed() calls it right away)
    medians = {k: statistics.median(v) for k, v in times.items()}
    print(f"first pass over {args.batches} batches (compilation): {compile_s:.1f} s")
    print(f"train step  eager {medians['eager'] * 1000:8.1f} ms   compiled ({args.backend}) "
          f"{medians['compiled'] * 1000:8.1f} ms   ratio {medians['compiled'] / medians['eager']:.3f}")
    print(json.dumps({
        "compiled_over_eager": round(medians["compiled"] / medians["eager"], 3),
        "compile_s": round(compile_s, 1),
        "train_ms": {k: round(v * 1000, 1) for k, v in medians.items()},
        "backend": args.backend, "batches": args.batches, "rounds": args.rounds, "threads": args.threads,
        "batch": [args.batch, args.seq], "weights": source_name,
    }))


if __name__ == "__main__":
    main()
