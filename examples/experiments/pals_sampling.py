"""The structure of the PALs paper's Table 1 on the shipped demo mixture: BERT only vs BERT + PALs, each
under round-robin, square-root, proportional and annealed task sampling.

"BERT only" is the shared encoder with one head per task (`bert_taskmoe` with one expert = MT-Dense, which
computes exactly transformers' BertModel); "BERT + PALs" is `BertWithPALs` (s = 204, 12 PAL heads, D_t = 0
at the start). Both start from the real MiniLM-L6-H384 and train with `examples/run_multitask.py`'s
pipeline: `--max_steps` steps in epochs of `--steps_per_epoch` batches (the annealed schedule, PALs eq. 9,
moves alpha from 1 to 0.2 across those epochs), batch 16, lr 1e-4, then one evaluation on every dev set
(the paper keeps the best of 10 epochs; here the final model is scored).

    python examples/experiments/pals_sampling.py [--seed 42] [--max_steps 200] [--steps_per_epoch 40]

Slow (about 3 minutes per run on 2 CPU cores, 8 runs): an experiment, not a test. Prints a table and, as
its last line, a JSON object with every measured figure (also written to results/pals_sampling.json).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import run_multitask  # noqa: E402

MODELS = {
    "BERT only": ["--model_family", "bert_taskmoe", "--num_experts", "1"],
    "BERT + PALs": ["--model_family", "bert_pals", "--pal_size", "204", "--pal_num_heads", "12"],
}
SAMPLINGS = ["round_robin", "sqrt", "proportional", "annealed"]
SCORE = {  # one score per task (x100), as in the paper's table
    "rotten_tomatoes": ["accuracy"], "trec": ["accuracy"], "sms_spam": ["f1"],
    "tweet_sentiment": ["pearson"], "boolq": ["accuracy"],
}


def run(seed: int, max_steps: int, steps_per_epoch: int, model: list[str], sampling: str) -> dict:
    with tempfile.TemporaryDirectory() as out:
        argv = [
            "--output_dir", out, "--do_train", "--do_eval", "--max_steps", str(max_steps),
            "--steps_per_epoch", str(steps_per_epoch), "--task_sampling", sampling,
            "--per_device_train_batch_size", "16", "--per_device_eval_batch_size", "64",
            "--learning_rate", "1e-4", "--warmup_steps", "0.1", "--max_seq_length", "64",
            "--logging_steps", "50", "--save_strategy", "no", "--report_to", "none",
            "--disable_tqdm", "true", "--log_level", "warning", "--seed", str(seed), *model,
        ]
        started = time.time()
        metrics = run_multitask.main(argv)
        scores = {task: round(100 * metrics[f"eval_{task}_{m[0]}"], 2) for task, m in SCORE.items()}
        scores["average"] = round(sum(scores.values()) / len(SCORE), 2)
        scores["seconds"] = round(time.time() - started)
        return scores


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--max_steps", type=int, default=200)
    parser.add_argument("--steps_per_epoch", type=int, default=40)
    parser.add_argument("--output", default=str(HERE / "results" / "pals_sampling.json"))
    args = parser.parse_args()
    torch.set_num_threads(2)

    started = time.time()
    rows = []
    for name, model in MODELS.items():
        for sampling in SAMPLINGS:
            scores = run(args.seed, args.max_steps, args.steps_per_epoch, model, sampling)
            rows.append({"model": name, "sampling": sampling, **scores})
            print(f"{name:<12} {sampling:<13} " + "  ".join(f"{k} {v}" for k, v in scores.items()), flush=True)

    header = ["model", "sampling", *SCORE, "average"]
    print("\n" + " | ".join(header))
    for row in rows:
        print(" | ".join(str(row[h]) for h in header))
    result = {
        "seed": args.seed, "max_steps": args.max_steps, "steps_per_epoch": args.steps_per_epoch,
        "batch_size": 16, "learning_rate": 1e-4, "max_seq_length": 64, "score_metrics": SCORE,
        "minutes": round((time.time() - started) / 60, 1), "rows": rows,
    }
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
