"""onnxruntime vs eager PyTorch inference, side by side: MT-TaG (4 experts, top-1, task gates), PALs and CA-MTL built
from MiniLM-L6-H384, each exported with `hf_taskmoe.export_onnx` and served a mixed-task batch (all `--num-tasks`
tasks in one batch, padded rows).

Eager runs the model's own forward under `torch.no_grad()` with `values_checked=True` (its per-task heads and the
sorted expert dispatch); onnxruntime runs the exported program (every head on every row, masked dense experts). The
two alternate round by round on the same batch; each figure is a median. The outputs are compared too (max abs
difference of the logits, eager's per-task rows against the program's padded rows).

    python benchmarks/onnx_vs_eager.py [--rounds 10] [--threads 2] [--batch 32] [--seq 128] [--families mt_tag pals]

Prints a table, then one JSON line: {"onnx_over_eager": {family: ratio}, "eager_ms": ..., "onnx_ms": ..., ...}
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from _bert_timing import benchmark_parser, make_batch, prepare, timed

from hf_taskmoe import BertForTaskMoE, BertWithPALs, CAMTLModel
from hf_taskmoe.onnx_export import export_onnx, task_widths

BUILDERS = {
    "mt_tag": lambda source, tasks: BertForTaskMoE.from_dense(source, tasks=tasks, num_experts=4, gating="task"),
    "pals": lambda source, tasks: BertWithPALs.from_dense(source, tasks=tasks, pal_size=204,
                                                          pal_decoder_init="normal"),
    "camtl": lambda source, tasks: CAMTLModel.from_dense(source, tasks=tasks, conditional_attention_max_length=128),
}


def main():
    import onnxruntime

    parser = benchmark_parser(__doc__, rounds=10, num_tasks=4)
    parser.add_argument("--families", nargs="+", default=list(BUILDERS), choices=list(BUILDERS))
    args = parser.parse_args()
    source, source_name, tasks = prepare(args)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = args.threads
    options.inter_op_num_threads = 1
    results, export_s, max_diff = {}, {}, {}
    with tempfile.TemporaryDirectory() as folder:
        for family in args.families:
            torch.manual_seed(0)
            model = BUILDERS[family](source, tasks).eval()
            batch = make_batch(args.batch, args.seq, args.num_tasks, model.config.vocab_size)
            batch.pop("labels")
            start = time.perf_counter()
            path = export_onnx(model, Path(folder) / f"{family}.onnx")
            export_s[family] = time.perf_counter() - start
            session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            feed = {name: batch[name].numpy() for name in ("input_ids", "attention_mask", "task_ids", "token_type_ids")}

            def eager(model=model, batch=batch):
                with torch.no_grad():
                    return model(**batch, values_checked=True)

            def served(session=session, feed=feed):
                return session.run(["logits"], feed)[0]

            out, logits = eager(), served()
            widths = task_widths(model)
            max_diff[family] = max(
                float(np.abs(logits[(batch["task_ids"] == t).numpy()][:, : widths[t]]
                             - out.task_logits[name].numpy()).max())
                for t, name in enumerate(model.config.task_names)
            )
            for _ in range(args.warmup):
                eager(), served()
            times = {"eager": [], "onnx": []}
            for r in range(args.rounds):
                pair = [("eager", eager), ("onnx", served)]
                for name, step in (pair if r % 2 == 0 else pair[::-1]):
                    times[name].append(timed(step))
            results[family] = {name: statistics.median(t) for name, t in times.items()}
            del session, model

    print(f"{source_name}; batch {args.batch} x {args.seq} tokens, {args.num_tasks} tasks mixed, "
          f"{args.threads} threads, median of {args.rounds}")
    print(f"{'family':8s} {'eager ms':>9s} {'onnx ms':>9s} {'onnx/eager':>10s} {'export s':>9s} {'max |diff|':>11s}")
    for family, r in results.items():
        print(f"{family:8s} {r['eager'] * 1000:9.1f} {r['onnx'] * 1000:9.1f} {r['onnx'] / r['eager']:10.3f} "
              f"{export_s[family]:9.1f} {max_diff[family]:11.2e}")
    print(json.dumps({
        "onnx_over_eager": {f: round(r["onnx"] / r["eager"], 3) for f, r in results.items()},
        "eager_ms": {f: round(r["eager"] * 1000, 1) for f, r in results.items()},
        "onnx_ms": {f: round(r["onnx"] * 1000, 1) for f, r in results.items()},
        "export_s": {f: round(s, 1) for f, s in export_s.items()},
        "max_abs_diff": {f: float(f"{d:.2e}") for f, d in max_diff.items()},
        "batch": args.batch, "seq": args.seq, "num_tasks": args.num_tasks, "threads": args.threads,
        "source": source_name,
    }))


if __name__ == "__main__":
    main()
