"""The CA-MTL paper's Table 1 ablation, in its order, on the shipped demo mixture with the real MiniLM:
MTL baseline (random task sampling), + conditional attention, + conditional alignment, + conditional
layer norm, + MT-Uncertainty sampling, and the full CA-MTL BASE (+ the conditional bottleneck).

Every model is `CAMTLModel` from MiniLM-L6-H384 with the bottom half of the layers and the embeddings
frozen (as in the paper's Table 1, appendix A.5); the components are switched on one by one. Training
follows `examples/run_multitask.py`: `--max_steps` steps of batch 16, lr 1e-4, 64 tokens, uniform task
sampling (the paper's pi_rand) until MT-Uncertainty replaces it; then one evaluation on every dev set.
"Task sigma" is the standard deviation of the five task scores (the paper's Task sigma).

    python examples/experiments/camtl_ablation.py [--seed 42] [--max_steps 200]

Slow (a few minutes per run on 2 CPU cores, 6 runs): an experiment, not a test. Prints a table and, as its
last line, a JSON object with every measured figure (also written to results/camtl_ablation.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import run_multitask  # noqa: E402

OFF = ["--conditional_attention", "false", "--conditional_alignment", "false", "--conditional_layer_norm", "false"]
ROWS = {
    "MTL baseline (random sampling)": [*OFF, "--conditional_bottleneck", "none", "--task_sampling", "uniform"],
    "+ conditional attention": [
        "--conditional_alignment", "false", "--conditional_layer_norm", "false", "--conditional_bottleneck", "none",
        "--task_sampling", "uniform",
    ],
    "+ conditional alignment": ["--conditional_layer_norm", "false", "--conditional_bottleneck", "none", "--task_sampling", "uniform"],
    "+ conditional layer norm": ["--conditional_bottleneck", "none", "--task_sampling", "uniform"],
    "+ MT-Uncertainty": ["--conditional_bottleneck", "none", "--task_sampling", "uncertainty"],
    "+ conditional bottleneck (CA-MTL BASE)": ["--conditional_bottleneck", "base", "--task_sampling", "uncertainty"],
}
SCORE = {  # one score per task (x100)
    "rotten_tomatoes": ["accuracy"], "trec": ["accuracy"], "sms_spam": ["f1"],
    "tweet_sentiment": ["pearson"], "boolq": ["accuracy"],
}


def run(seed: int, max_steps: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        argv = [
            "--model_family", "camtl", "--output_dir", out, "--do_train", "--do_eval", "--max_steps", str(max_steps),
            "--per_device_train_batch_size", "16", "--per_device_eval_batch_size", "64",
            "--learning_rate", "1e-4", "--warmup_steps", "0.1", "--max_seq_length", "64",
            "--logging_steps", "50", "--save_strategy", "no", "--report_to", "none",
            "--disable_tqdm", "true", "--log_level", "warning", "--seed", str(seed), *extra,
        ]
        started = time.time()
        metrics = run_multitask.main(argv)
        scores = {task: round(100 * metrics[f"eval_{task}_{m[0]}"], 2) for task, m in SCORE.items()}
        values = list(scores.values())
        scores["average"] = round(sum(values) / len(values), 2)
        scores["task_sigma"] = round(statistics.pstdev(values), 2)
        scores["seconds"] = round(time.time() - started)
        return scores


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--max_steps", type=int, default=200)
    parser.add_argument("--rows", type=int, nargs="*", help="run only these rows (0-based indices into the table)")
    parser.add_argument("--output", default=str(HERE / "results" / "camtl_ablation.json"))
    args = parser.parse_args()
    torch.set_num_threads(2)

    started = time.time()
    rows = []
    for index, (name, extra) in enumerate(ROWS.items()):
        if args.rows and index not in args.rows:
            continue
        scores = run(args.seed, args.max_steps, extra)
        rows.append({"model": name, **scores})
        print(f"{name:<40} " + "  ".join(f"{k} {v}" for k, v in scores.items()), flush=True)

    header = ["model", *SCORE, "average", "task_sigma"]
    print("\n" + " | ".join(header))
    for row in rows:
        print(" | ".join(str(row[h]) for h in header))
    result = {
        "seed": args.seed, "max_steps": args.max_steps, "batch_size": 16, "learning_rate": 1e-4,
        "max_seq_length": 64, "frozen": "embeddings + bottom 3 of 6 layers", "score_metrics": SCORE,
        "minutes": round((time.time() - started) / 60, 1), "rows": rows,
    }
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
