"""Which expert weighting to upcycle with: the paper's `gate` (h = g* E*(x)) or `straight_through`
(the fresh model computes exactly the dense model)?

Trains MT-TaG (4 experts, task gates) upcycled from the real MiniLM-L6-H384 with each weighting, and
MT-Dense as the reference, on the shipped demo mixture with `examples/run_multitask.py`'s pipeline, for
each seed; prints a table and, as its last line, a JSON object with every measured figure.

    python examples/experiments/upcycling_modes.py [--seeds 42 43] [--max_steps 200]

Slow (a few minutes per run on 2 CPU cores): an experiment, not a test.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import run_multitask  # noqa: E402

from hf_taskmoe import BertForTaskMoE, TaskSpec  # noqa: E402
from hf_taskmoe.cli.train import default_model_path  # noqa: E402

CONFIGS = {
    "MT-Dense": ["--num_experts", "1"],
    "MT-TaG gate": ["--num_experts", "4", "--expert_weighting", "gate"],
    "MT-TaG straight_through": ["--num_experts", "4", "--expert_weighting", "straight_through"],
}


def initial_deviation() -> dict:
    """How far each fresh upcycled model is from the dense one: max |h_moe - h_dense| on real tokens."""
    from transformers import AutoModel, AutoTokenizer

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    dense = AutoModel.from_pretrained(path).eval()
    enc = tok(["A gripping, well acted film.", "Is the sky blue on Mars?"], padding=True, return_tensors="pt")
    real = enc["attention_mask"].bool()
    out = {}
    for weighting in ("gate", "straight_through"):
        model = BertForTaskMoE.from_dense(
            path, tasks=[TaskSpec(name="t", num_labels=2)], expert_weighting=weighting
        ).eval()
        with torch.no_grad():
            a = dense(**enc).last_hidden_state
            ids = torch.zeros(2, dtype=torch.long)
            b = model(**enc, task_ids=ids, output_hidden_states=True).hidden_states[-1]
        out[weighting] = round((a - b)[real].abs().max().item(), 6)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 43])
    parser.add_argument("--max_steps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(2)

    results: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    started = time.time()
    for seed in args.seeds:
        for name, extra in CONFIGS.items():
            with tempfile.TemporaryDirectory() as out:
                argv = [
                    "--output_dir", out, "--do_train", "--do_eval", "--max_steps", str(args.max_steps),
                    "--per_device_train_batch_size", "16", "--per_device_eval_batch_size", "64",
                    "--learning_rate", "1e-4", "--warmup_steps", "0.1", "--max_seq_length", "96",
                    "--logging_steps", "50", "--save_strategy", "no", "--report_to", "none",
                    "--disable_tqdm", "true", "--log_level", "warning", "--seed", str(seed), *extra,
                ]
                t0 = time.time()
                metrics = run_multitask.main(argv)
                results[name].append(
                    {
                        "seed": seed,
                        "seconds": round(time.time() - t0),
                        **{
                            k: round(v, 4)
                            for k, v in metrics.items()
                            if k.startswith("eval_") and not k.endswith(("runtime", "per_second", "loss"))
                        },
                    }
                )

    keys = [k for k in results["MT-Dense"][0] if k.startswith("eval_")]
    print(f"\n{'metric':<34}" + "".join(f"{n:>26}" for n in CONFIGS))
    summary = {}
    for key in keys:
        row = {}
        for name in CONFIGS:
            values = [r[key] for r in results[name]]
            row[name] = {"mean": round(statistics.mean(values), 4), "values": values}
        summary[key] = row
        print(f"{key:<34}" + "".join(f"{100 * row[n]['mean']:>26.2f}" for n in CONFIGS))
    deviation = initial_deviation()
    print(f"max |hidden - dense| right after upcycling: {deviation}")
    print(json.dumps({"seeds": args.seeds, "max_steps": args.max_steps, "initial_deviation": deviation,
                      "minutes": round((time.time() - started) / 60, 1), "results": summary}))


if __name__ == "__main__":
    main()
