"""Mixed precision that really runs: MT-TaG (4 experts, task gates) on the demo mixture in fp32, bf16 and (on a GPU)
fp16, same seed and data order, through `examples/run_multitask.py`.

For each precision: the precision the run recorded (`run_summary.json`), the training loss at every logging step,
the step time (train_runtime / steps) and the dev average. Printed: the largest and mean absolute difference of the
logged training losses from fp32's, relative to fp32's loss, and the step-time ratio to fp32; last line JSON.
Tolerance this benchmark checks against: mean relative loss difference below 5% over the run (mixed precision changes
rounding, so the trajectories drift apart slowly; the dev average is printed beside it).

    python benchmarks/precision.py [--max_steps 100] [--threads 2]
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


def run(precision: str, steps: int, threads: int, folder: Path) -> dict:
    out = folder / precision
    flags = {"fp32": [], "bf16": ["--bf16", "true"], "fp16": ["--fp16", "true"]}[precision]
    import torch

    if not torch.cuda.is_available():
        flags = flags + ["--use_cpu", "true"]
    argv = [
        sys.executable,
        str(ROOT / "examples" / "run_multitask.py"),
        "--max_steps",
        str(steps),
        "--logging_steps",
        "10",
        "--max_seq_length",
        "64",
        "--max_eval_samples",
        "200",
        "--output_dir",
        str(out),
        "--disable_tqdm",
        "true",
        *flags,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    subprocess.run(argv, cwd=ROOT, env=env, check=True, capture_output=True)
    summary = json.loads((out / "run_summary.json").read_text())
    losses = {h["step"]: h["loss"] for h in summary["log_history"] if "loss" in h and "step" in h}
    return {
        "recorded_precision": summary["precision"],
        "losses": losses,
        "eval_average": summary["metrics"].get("eval_average"),
        "step_time_s": summary["train_metrics"]["train_runtime"] / summary["steps"],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max_steps", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import torch

    precisions = ["fp32", "bf16"] + (["fp16"] if torch.cuda.is_available() else [])
    with tempfile.TemporaryDirectory() as folder:
        runs = {p: run(p, args.max_steps, args.threads, Path(folder)) for p in precisions}
    reference = runs["fp32"]["losses"]
    result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "steps": args.max_steps}
    for p, r in runs.items():
        rel = [abs(r["losses"][s] - reference[s]) / abs(reference[s]) for s in reference if s in r["losses"]]
        print(
            f"{p}: recorded {r['recorded_precision']}, step {1000 * r['step_time_s']:.1f} ms, dev average "
            f"{100 * r['eval_average']:.2f}, training loss vs fp32: max rel diff {max(rel):.4f}, mean "
            f"{sum(rel) / len(rel):.4f}"
        )
        result[p] = {"recorded": r["recorded_precision"], "step_ms": round(1000 * r["step_time_s"], 2),
                     "step_time_ratio": round(r["step_time_s"] / runs["fp32"]["step_time_s"], 3),
                     "loss_rel_diff_max": round(max(rel), 4), "loss_rel_diff_mean": round(sum(rel) / len(rel), 4),
                     "eval_average": round(r["eval_average"], 4)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
