"""Multi-task dense vs average routing vs Gumbel-softmax straight-through routing (Ye et al. 2022, Table 1
rows "BART-Base", (a) and (d)) on the shipped text-to-text mixture, from real weights.

No BART checkpoint can be loaded here, so every model starts from `bart_from_bert(MiniLM-L6-H384)` (encoder
= MiniLM, decoder warm-started from it, BERT2BERT; cross-attention random). "Dense" is `BartTaskRouted` with one
expert per layer (every layer plain: a multi-task BART); the routed models fork all 12 layers into 3 experts
(section 5.2: N(0, 1e-8) noise), MLP router, random task representations (the paper's (e)+(h)+(l)).
Training follows `examples/run_multitask.py`: `--max_steps` steps of heterogeneous batches of 16, lr 1e-4
(router 1e-3, task embeddings 1e-2 as in section 5.2), 64 input / 32 target tokens, proportional sampling;
then greedy generation (24 new tokens) on the first 100 dev examples of each task: exact match of the
generated label (rotten_tomatoes, trec, sms_spam, boolq) and ROUGE-1/2/L (xsum).

    python examples/experiments/bart_routing.py [--seed 42] [--max_steps 300]

Slow (minutes per run on 2 CPU cores): an experiment, not a test. Writes results/bart_routing.json and the
routing heatmap of the Gumbel-ST model (results/bart_routing_gumbel_st.png); its last line is a JSON object
with every measured figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import run_multitask  # noqa: E402

import hf_taskmoe  # noqa: E402
from hf_taskmoe.analysis import plot_task_routing  # noqa: E402

TASKS = HERE.parent / "data" / "text2text" / "tasks.json"
ROWS = {
    "multi-task dense": ["--num_experts", "1", "--selection", "average"],
    "(a) average routing": ["--num_experts", "3", "--selection", "average"],
    "(d) Gumbel-softmax ST": ["--num_experts", "3", "--selection", "gumbel_softmax_st"],
}
SCORE = {"rotten_tomatoes": "exact_match", "trec": "exact_match", "sms_spam": "exact_match", "boolq": "exact_match",
         "xsum": "rougeL"}


def run(seed: int, max_steps: int, extra: list[str], out: Path) -> tuple[dict, Path]:
    argv = [
        "--model_family", "bart_routed", "--tasks", str(TASKS), "--output_dir", str(out), "--do_train", "--do_eval",
        "--max_steps", str(max_steps), "--per_device_train_batch_size", "16", "--per_device_eval_batch_size", "50",
        "--learning_rate", "1e-4", "--group_learning_rates", "router=1e-3,task_embedding=1e-2", "--warmup_steps", "0.1",
        "--max_seq_length", "64", "--max_target_length", "32", "--max_eval_samples", "100",
        "--predict_with_generate", "--generation_max_length", "24", "--generation_num_beams", "1",
        "--logging_steps", "50", "--save_strategy", "no", "--report_to", "none",
        "--disable_tqdm", "true", "--log_level", "warning", "--seed", str(seed), *extra,
    ]
    started = time.time()
    metrics = run_multitask.main(argv)
    scores = {task: round(100 * metrics[f"eval_{task}_{m}"], 2) for task, m in SCORE.items()}
    scores["dev_token_loss"] = {task: round(metrics[f"eval_{task}_loss"], 3) for task in SCORE}  # teacher-forced
    scores["xsum_rouge1"] = round(100 * metrics["eval_xsum_rouge1"], 2)
    scores["xsum_rouge2"] = round(100 * metrics["eval_xsum_rouge2"], 2)
    values = [scores[t] for t in SCORE]
    scores["average"] = round(sum(values) / len(values), 2)
    scores["task_sigma"] = round(statistics.pstdev(values), 2)
    scores["seconds"] = round(time.time() - started)
    return scores, out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--max_steps", type=int, default=300)
    parser.add_argument("--work_dir", default="/tmp/bart_routing")
    parser.add_argument("--output", default=str(HERE / "results" / "bart_routing.json"))
    args = parser.parse_args()
    torch.set_num_threads(2)

    started = time.time()
    rows, routes = [], {}
    for index, (name, extra) in enumerate(ROWS.items()):
        scores, out = run(args.seed, args.max_steps, extra, Path(args.work_dir) / f"row{index}")
        rows.append({"model": name, **scores})
        print(f"{name:<28} " + "  ".join(f"{k} {v}" for k, v in scores.items()), flush=True)
        if "gumbel" in name.lower():
            model = hf_taskmoe.BartTaskRouted.from_pretrained(out)
            decisions = model.task_routing()
            routes = {
                "route_names": model.config.route_names,
                "chosen_expert": {t: decisions[i].argmax(-1).tolist() for i, t in enumerate(model.config.task_names)},
            }
            plot_task_routing(decisions, model.config.task_names, model.config.route_names,
                              HERE / "results" / "bart_routing_gumbel_st.png",
                              title=f"Gumbel-softmax ST routes after {args.max_steps} steps (1 = chosen expert)")

    header = ["model", *SCORE, "xsum_rouge1", "xsum_rouge2", "average", "task_sigma", "seconds"]
    print("\n" + " | ".join(header))
    for row in rows:
        print(" | ".join(str(row[h]) for h in header))
    result = {
        "seed": args.seed, "max_steps": args.max_steps, "batch_size": 16, "learning_rate": 1e-4,
        "router_learning_rate": 1e-3, "task_embedding_learning_rate": 1e-2, "max_seq_length": 64,
        "max_target_length": 32, "eval_examples_per_task": 100, "score_metrics": SCORE,
        "start": "bart_from_bert(MiniLM-L6-H384)", "minutes": round((time.time() - started) / 60, 1),
        "rows": rows, "gumbel_st_routes": routes,
    }
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
