"""Peak memory of training MT-TaG (4 experts, task gates) against MT-Dense on the demo mixture, each in its own
process through `examples/run_multitask.py` (peak resident set size from `run_summary.json`, the process's
`ru_maxrss`), same data, steps and batch.

MT-TaG holds 3 more copies of every FFN: their parameters, gradients and AdamW's two moments add
4 x 4 bytes per extra parameter; the expected bound is MT-Dense's peak + that + 30%. MT-TaG runs with its default
experts implementation (on a CPU the sorted loop; `run_multitask.py` has no option for transformers'
`experts_implementation`, which is not a field of the config, so the grouped GEMM is not run here). Prints the
peaks, the extra parameters, the bound, the ratios to it and the step times; last line JSON.

What the sorted loop holds beyond the bound is glibc heap fragmentation, not tensors: its per-expert tensors change
size every step, and freed blocks of varying size stay in the heap (MALLOC_MMAP_THRESHOLD_=131072 removed it, at a
third more time per step; thresholds of 4 or 16 MB did not: the fragmenting blocks are one expert's activations,
0.4-1.5 MB). It also runs with `--release_freed_memory_every 1` and `10` (the Trainer calls glibc's `malloc_trim`
after every / every 10th step).

    python benchmarks/memory.py [--max_steps 30] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(
    num_experts: int, steps: int, threads: int, folder: Path, trim_every: int = 0
) -> dict:
    out = folder / f"experts{num_experts}-{trim_every}"
    argv = [
        sys.executable,
        str(ROOT / "examples" / "run_multitask.py"),
        "--num_experts",
        str(num_experts),
        "--max_steps",
        str(steps),
        "--max_eval_samples",
        "64",
        "--output_dir",
        str(out),
        "--disable_tqdm",
        "true",
        "--use_cpu",
        "--release_freed_memory_every",
        str(trim_every),
    ]
    subprocess.run(argv, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": str(threads)}, check=True, capture_output=True)
    return json.loads((out / "run_summary.json").read_text())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max_steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import torch  # noqa: F401

    from hf_taskmoe import BertForTaskMoE, TaskSpec

    with tempfile.TemporaryDirectory() as folder:
        dense = run(1, args.max_steps, args.threads, Path(folder))
        moe = run(4, args.max_steps, args.threads, Path(folder))
        trimmed = {k: run(4, args.max_steps, args.threads, Path(folder), trim_every=k) for k in (1, 10)}
    tasks = [TaskSpec(name="t", num_labels=2)]
    sizes = [
        sum(
            p.numel()
            for p in BertForTaskMoE(
                BertForTaskMoE.config_class(
                    tasks=tasks,
                    vocab_size=30522,
                    hidden_size=384,
                    num_hidden_layers=6,
                    num_attention_heads=12,
                    intermediate_size=1536,
                    num_experts=n,
                )
            ).parameters()
        )
        for n in (1, 4)
    ]
    extra_mb = (sizes[1] - sizes[0]) * 4 * 4 / 2**20  # parameter, gradient, two AdamW moments, fp32
    bound = (dense["peak_rss_mb"] + extra_mb) * 1.3
    print(
        f"MT-Dense peak {dense['peak_rss_mb']:.0f} MB; MT-TaG peak {moe['peak_rss_mb']:.0f} MB (sorted loop), "
        f"{trimmed[1]['peak_rss_mb']:.0f} / {trimmed[10]['peak_rss_mb']:.0f} MB (sorted loop, trimmed every 1 / 10 "
        "steps), "
        f"extra parameters {sizes[1] - sizes[0]:,} ({extra_mb:.0f} MB "
        "with "
        f"gradients and AdamW state); bound {bound:.0f} MB"
    )
    time = lambda r: r["train_metrics"]["train_runtime"] / r["steps"]  # noqa: E731
    print(
        json.dumps(
            {
                "dense_peak_mb": dense["peak_rss_mb"],
                "moe_peak_mb": moe["peak_rss_mb"],
                "trimmed_peak_mb": {k: r["peak_rss_mb"] for k, r in trimmed.items()},
                "trimmed_over_bound": {k: round(r["peak_rss_mb"] / bound, 3) for k, r in trimmed.items()},
                "extra_state_mb": round(extra_mb, 1),
                "bound_mb": round(bound, 1),
                "moe_over_bound": round(moe["peak_rss_mb"] / bound, 3),
                "step_s": {
                    "dense": round(time(dense), 3),
                    "moe": round(time(moe), 3),
                    **{f"moe_trimmed_every_{k}": round(time(r), 3) for k, r in trimmed.items()},
                },
                "steps": args.max_steps,
                "threads": args.threads,
            }
        )
    )


if __name__ == "__main__":
    main()
