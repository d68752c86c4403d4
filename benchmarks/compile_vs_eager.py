"""torch.compile (inductor) vs eager: training steps (forward + backward) of each BERT family upcycled from
MiniLM-L6-H384, over batches whose task composition changes from step to step.

- "mt_tag": MT-TaG (4 experts, top-1, task gates) with its default experts implementation (under torch.compile its
  grouped GEMMs), compiled without `fullgraph`. Plain batches, as a user calls it.
- "mt_tag_grouped_mm", "pals", "camtl": MT-TaG with its grouped GEMMs (`taskmoe_sorted_grouped`), PALs (s = 204) and
  CA-MTL compiled
  with `fullgraph=True` (one graph: no break, which CUDA graphs need) on the batches as `MultiTaskTrainer`'s collator
  hands them over (checked on the host: `values_checked=True` and `task_counts`). The compiled forward runs every
  head on every row; eager splits the batch by task. MT-TaG's grouped GEMM runs under bf16 autocast in both (in other
  dtypes it compiles through transformers' grouped product, a loop behind a custom op; `tests/test_compile.py`).

The compiled model first runs every distinct batch once (`--batches` of them: the compile cost, reported as
`compile_s`; dynamo's recompile limit is 1 for the fullgraph families and hitting it is an error, so a second graph
fails the run), then both models alternate over the same batches; each figure is a median.

    python benchmarks/compile_vs_eager.py [--families mt_tag,mt_tag_grouped_mm,pals,camtl] [--rounds 6] [--batches 6]
        [--threads 2] [--batch 16] [--seq 64] [--backend inductor]

Prints a line per family, then one JSON line: {"compiled_over_eager": {family: ...}, "compile_s": {family: ...},
"graphs": {family: unique graphs}, "graph_breaks": {family: count}, ...}
"""

from __future__ import annotations

import contextlib
import json
import statistics

import torch
from _bert_timing import benchmark_parser, make_batch, prepare, timed, train_step

from hf_taskmoe import BertForTaskMoE, BertWithPALs, CAMTLModel
from hf_taskmoe.training.batches import BatchChecker

#: family -> (build from the dense source and the tasks, fullgraph, autocast dtype)
FAMILIES = {
    "mt_tag": (lambda source, tasks: BertForTaskMoE.from_dense(source, tasks=tasks, num_experts=4, gating="task"),
               False, None),
    "mt_tag_grouped_mm": (lambda source, tasks: BertForTaskMoE.from_dense(
        source, tasks=tasks, num_experts=4, gating="task", experts_implementation="taskmoe_sorted_grouped"), True,
        torch.bfloat16),
    "pals": (lambda source, tasks: BertWithPALs.from_dense(source, tasks=tasks, pal_size=204,
                                                           pal_decoder_init="normal"), True, None),
    "camtl": (lambda source, tasks: CAMTLModel.from_dense(source, tasks=tasks, conditional_attention_max_length=128),
              True, None),
}


def task_mix_batches(args, vocab: int) -> list[dict]:
    """`--batches` batches whose task composition varies: batch i holds tasks 0..(i % num_tasks), in runs."""
    batches = []
    for i in range(args.batches):
        batch = make_batch(args.batch, args.seq, args.num_tasks, vocab, seed=i)
        batch["task_ids"] = (torch.arange(args.batch) * (1 + i % args.num_tasks) // args.batch).sort().values
        batches.append(batch)
    return batches


def measure(name: str, source, tasks, batches: list[dict], args) -> dict:
    from torch._dynamo.utils import counters

    build, fullgraph, autocast_dtype = FAMILIES[name]
    torch.manual_seed(0)
    eager = build(source, tasks).train()
    compiled_model = build(source, tasks).train()
    compiled_model.load_state_dict(eager.state_dict())
    if fullgraph:  # as the Trainer's collator hands them over
        checker = BatchChecker.for_model(eager)
        batches = [{**b, **checker.check(b)} for b in batches]

    def step(model, batch):
        with (torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()):
            train_step(model, batch)

    torch._dynamo.reset()
    counters.clear()
    limits = dict(recompile_limit=1) if fullgraph else {}
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, **limits):
        compiled = torch.compile(compiled_model, backend=args.backend, fullgraph=fullgraph)
        compile_s = sum(timed(lambda: step(compiled, b)) for b in batches)  # noqa: B023  (called right away)
        for b in batches[: args.warmup]:
            step(eager, b)
        times = {"eager": [], "compiled": []}
        for r in range(args.rounds):
            for b in batches:
                pair = [("eager", eager), ("compiled", compiled)]
                for kind, model in (pair if r % 2 == 0 else pair[::-1]):
                    times[kind].append(timed(lambda: step(model, b)))  # noqa: B023  (timed() calls it right away)
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {
        "ratio": medians["compiled"] / medians["eager"], "compile_s": compile_s, "ms": medians, "fullgraph": fullgraph,
        "graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values()),
    }


def main():
    parser = benchmark_parser(__doc__, rounds=6, num_tasks=8)
    parser.add_argument("--batches", type=int, default=6, help="Distinct batches (task compositions) cycled over.")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--families", default=",".join(FAMILIES), help=f"Comma-separated, of {list(FAMILIES)}.")
    parser.set_defaults(batch=16, seq=64)
    args = parser.parse_args()
    names = args.families.split(",")
    unknown = sorted(set(names) - set(FAMILIES))
    if unknown:
        parser.error(f"--families: unknown {unknown}; choose from {list(FAMILIES)}.")
    source, source_name, tasks = prepare(args)
    results = {}
    for name in names:
        batches = task_mix_batches(args, 30522)
        results[name] = r = measure(name, source, tasks, batches, args)
        print(f"{name:<18} {'fullgraph' if r['fullgraph'] else 'graph breaks allowed'}: first pass over "
              f"{args.batches} batches (compilation) {r['compile_s']:.1f} s, {r['graphs']} graph(s), "
              f"{r['graph_breaks']} break(s); train step eager {r['ms']['eager'] * 1000:.1f} ms, compiled "
              f"({args.backend}) {r['ms']['compiled'] * 1000:.1f} ms, ratio {r['ratio']:.3f}", flush=True)
    print(json.dumps({
        "compiled_over_eager": {n: round(r["ratio"], 3) for n, r in results.items()},
        "compile_s": {n: round(r["compile_s"], 1) for n, r in results.items()},
        "graphs": {n: r["graphs"] for n, r in results.items()},
        "graph_breaks": {n: r["graph_breaks"] for n, r in results.items()},
        "train_ms": {n: {k: round(v * 1000, 1) for k, v in r["ms"].items()} for n, r in results.items()},
        "backend": args.backend, "batches": args.batches, "rounds": args.rounds, "threads": args.threads,
        "batch": [args.batch, args.seq], "weights": source_name, "torch": torch.__version__,
    }))


if __name__ == "__main__":
    main()
