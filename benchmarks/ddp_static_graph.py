"""DDP step time with a static graph (`--ddp_find_unused_parameters false`, the default: every parameter takes part
in every step) against `find_unused_parameters=True` (DDP walks the autograd graph after every forward to find
parameters without gradient), side by side: `torchrun --nproc_per_node 2 examples/run_multitask.py --use_cpu`
on the demo (MiniLM-L6-H384, real tasks), the two settings alternated, `--repeats` runs each.

Step time = the Trainer's `train_runtime` / steps (the model load and the final evaluation are outside it).

    python benchmarks/ddp_static_graph.py [--max_steps 20] [--repeats 2] [--model_family bert_taskmoe]

Prints each run, then one JSON line: {"find_unused_over_static": median ratio, ...}
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(find_unused: bool, args, folder: Path, index: int) -> float:
    out = folder / f"run{index}"
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_port()),
        str(ROOT / "examples" / "run_multitask.py"),
        "--use_cpu",
        "--model_family",
        args.model_family,
        "--max_steps",
        str(args.max_steps),
        "--max_eval_samples",
        "16",
        "--ddp_find_unused_parameters",
        str(find_unused).lower(),
        "--output_dir",
        str(out),
        "--disable_tqdm",
        "true",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    subprocess.run(argv, cwd=ROOT, env=env, check=True, capture_output=True)
    summary = json.loads((out / "run_summary.json").read_text())
    return summary["train_metrics"]["train_runtime"] / summary["steps"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max_steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="Threads per process (2 processes).")
    parser.add_argument("--model_family", default="bert_taskmoe")
    args = parser.parse_args()
    times = {"static": [], "find_unused": []}
    with tempfile.TemporaryDirectory() as folder:
        for r in range(args.repeats):
            order = [False, True] if r % 2 == 0 else [True, False]
            for find_unused in order:
                name = "find_unused" if find_unused else "static"
                times[name].append(
                    run(find_unused, args, Path(folder), len(times["static"]) + len(times["find_unused"]))
                )
                print(f"{name:<12} {times[name][-1]:.3f} s/step", flush=True)
    medians = {k: statistics.median(v) for k, v in times.items()}
    print(
        json.dumps(
            {
                "find_unused_over_static": round(medians["find_unused"] / medians["static"], 3),
                "step_s": {k: round(v, 3) for k, v in medians.items()},
                "runs": times,
                "model_family": args.model_family,
                "max_steps": args.max_steps,
                "processes": 2,
                "threads": args.threads,
            }
        )
    )


if __name__ == "__main__":
    main()
