"""What a training run reports beside its metrics: each score's trivial baseline, the per-task results table,
samples of generated text, and the run summary (metrics, counts, time, memory, versions, redacted command line)."""

from __future__ import annotations

import json
import platform
import resource
import subprocess
import time
import warnings
from pathlib import Path

import datasets
import torch
import transformers

from .. import __version__
from ..problem_types import TEXT_TO_TEXT, get_problem_type
from .push import redacted_argv

#: a score within this of its baseline (0.5 points x100) is flagged as at its baseline
BASELINE_MARGIN = 0.005


def baseline_scores(task, train_labels: list | None, eval_labels: list) -> dict[str, float] | None:
    """The task's metrics for always predicting its training set's majority class (multi-label: each label's
    majority; multiple choice: the most frequent right choice) or, for regression, the mean training target; from
    the evaluation labels when there is no training set. None where no such baseline applies (seq2seq, token
    classification). A correlation of a constant prediction is undefined: counted as 0."""
    import numpy as np

    from ..problem_types import compute_task_metrics

    if not eval_labels:
        return None
    logits = get_problem_type(task.problem_type).baseline_logits(task, train_labels or eval_labels, len(eval_labels))
    if logits is None:  # no trivial predictor for the type (generated text, token tags)
        return None
    with warnings.catch_warnings():  # a constant prediction's correlation: scipy warns and returns nan
        warnings.simplefilter("ignore")
        scores = compute_task_metrics(task, logits, np.asarray(eval_labels))
    return {k: 0.0 if v != v else float(v) for k, v in scores.items()}


def task_baselines(task_data, labels: dict) -> dict[str, dict[str, float]]:
    """`{task: baseline_scores}` of every task with evaluation labels (`labels`: `(task, split) -> labels`) and a
    baseline."""
    baselines = {}
    for t in task_data:
        if (t.name, "validation") in labels:
            base = baseline_scores(t.spec, labels.get((t.name, "train")), labels[(t.name, "validation")])
            if base:
                baselines[t.name] = base
    return baselines


def with_baselines(metrics: dict, baselines: dict) -> dict:
    """`metrics` with each score's baseline beside it (`eval_<task>_<metric>_baseline`, sorted next to its score)."""
    return {**metrics, **{f"eval_{task}_{m}_baseline": v for task, base in baselines.items()
                          for m, v in base.items() if f"eval_{task}_{m}" in metrics}}


def card_training_lines(trainer, totals: dict, checkpoint: str | None = None) -> dict:
    """The training section of the model card: `trainer.training_summary()`, the training time and the examples
    seen per task over the whole run (`totals`: `TrainingProgressCallback.totals()`), saying where it resumed."""
    training = trainer.training_summary()
    training["training time"] = f"{totals['train_seconds']:.0f} s"
    if checkpoint:
        training["training time"] += (
            f" ({totals['train_seconds_this_run']:.0f} s after resuming from {Path(checkpoint).name})"
            if totals["complete"]
            else f" after resuming from {Path(checkpoint).name} (earlier part not recorded)"
        )
    training["examples seen per task"] = ", ".join(f"{k} {v}" for k, v in totals["examples_seen"].items())
    return training


def results_table(tasks, metrics: dict, prefix: str = "eval", baselines: dict | None = None) -> str:
    """Each task's scores, each beside its baseline (`baseline_scores`), a score at its baseline flagged; the
    averages (the small-task average only when it differs, i.e. when not every task is small)."""
    baselines = baselines or {}
    rows = [("task", "metric", "value (x100)", "baseline", "")]
    for task in tasks:
        for m in task.metrics:
            for name in (m, f"{m}_teacher_forced"):
                key = f"{prefix}_{task.name}_{name}"
                if key not in metrics:
                    continue
                base = baselines.get(task.name, {}).get(m) if name == m else None
                note = ""
                if name != m:
                    note = "teacher-forced (not generated): not a result"
                elif base is not None and metrics[key] <= base + BASELINE_MARGIN:
                    note = "<- at or below its baseline"
                rows.append(
                    (task.name, name, f"{100 * metrics[key]:.2f}", "" if base is None else f"{100 * base:.2f}", note)
                )
    average, small = metrics.get(f"{prefix}_average"), metrics.get(f"{prefix}_small_tasks_average")
    if average is not None:
        rows.append(("average (all tasks)", "", f"{100 * average:.2f}", "", ""))
    if small is not None and small != average:  # equal when every task is small: said once
        rows.append(("average (small tasks)", "", f"{100 * small:.2f}", "", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths[:4]))
    if any(baselines.get(t.name) for t in tasks):
        lines.append("baseline: the same metric for always predicting the training set's majority class (regression: "
                     "its mean target; a constant has correlation 0)")
    return "\n".join(lines)


def generation_samples(model, tokenizer, task_data, per_task: int = 3) -> list[dict]:
    """The first dev examples of each seq2seq task with the target and what the model generates for them (greedy,
    through the text2text pipeline): something a reader can look at beside the scores."""
    from hf_taskmoe.pipelines import MultiTaskText2TextGenerationPipeline

    seq2seq = [t for t in task_data if TEXT_TO_TEXT in get_problem_type(t.spec.problem_type).capabilities
               and t.split("validation") is not None]
    if not seq2seq:
        return []
    pipe = MultiTaskText2TextGenerationPipeline(model=model, tokenizer=tokenizer)
    samples = []
    for t in seq2seq:
        rows = t.split("validation").select(range(min(per_task, len(t.split("validation")))))
        fields = t.spec.text_fields
        inputs = [
            {"text": row[fields[0]], "task": t.name, **({"text_pair": row[fields[1]]} if len(fields) > 1 else {})}
            for row in rows
        ]
        outputs = pipe(inputs, do_sample=False)
        for _item, row, out in zip(inputs, rows, outputs):
            samples.append({"task": t.name, "input": " | ".join(str(row[f]) for f in fields)[:300],
                            "target": str(row[t.spec.label_field]), "output": out["generated_text"]})
    return samples


def save_evaluation_extras(trainer, model, tokenizer, task_data, folder: str) -> None:
    """Beside the evaluation's metrics in `folder`: the routes of the evaluation sets (`routing.json` and
    `routing_heatmap.png`, which the model card then shows) where the trainer gathered them, and samples of generated
    text (`generations.json`, `generation_samples`) where a task generates."""
    import os

    os.makedirs(folder, exist_ok=True)
    if trainer.routing_statistics is not None:
        trainer.routing_statistics.save_json(os.path.join(folder, "routing.json"))
        trainer.routing_statistics.plot(os.path.join(folder, "routing_heatmap.png"))
        trainer.routing_heatmap = "routing_heatmap.png"
    samples = generation_samples(model, tokenizer, task_data)
    if samples:
        with open(os.path.join(folder, "generations.json"), "w") as f:
            json.dump(samples, f, indent=2, ensure_ascii=False)


def git_revision(folder: str | Path | None = None) -> str | None:
    """The commit checked out where `folder` lies (default: this package's source); None outside a checkout."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder or Path(__file__).parent, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def run_summary(trainer, metrics: dict, train_metrics: dict, started: float, argv: list[str],
                progress: dict | None = None, baselines: dict | None = None, revision_of: str | None = None) -> dict:
    """What the experiment runner records of a run: metrics, baselines, steps, examples per task (over the whole run
    when it resumed: `progress`, from `TrainingProgressCallback.totals`), time, memory, versions, and the command
    line with every secret-named option's value redacted; the generated samples (`generations.json` in the output
    folder) and the evaluation routes (`trainer.routing_statistics`) where the run has them."""
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux: kilobytes
    args = trainer.args
    progress = progress or {}
    summary = {
        "metrics": metrics,
        "train_metrics": train_metrics,
        "baselines": baselines or {},
        "steps": trainer.state.global_step,
        "examples_seen": progress.get("examples_seen", trainer.examples_seen()),
        "train_time_s": progress.get("train_seconds"),
        "train_time_s_this_run": progress.get("train_seconds_this_run"),
        "resumed_from": progress.get("resumed_from"),
        "counts_cover_whole_run": progress.get("complete", True),
        "log_history": trainer.state.log_history,
        "wall_time_s": round(time.time() - started, 1),
        "peak_rss_mb": round(peak_kb / 1024, 1),
        "peak_gpu_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1) if torch.cuda.is_available() else None,
        "device": str(args.device),
        "precision": trainer.precision_used(),
        "threads": torch.get_num_threads(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "hf_taskmoe": __version__,
            "datasets": datasets.__version__,
        },
        "git_revision": git_revision(revision_of),
        "argv": redacted_argv(argv),
    }
    generations = Path(args.output_dir) / "generations.json"  # `generation_samples`, as the run saved them
    if generations.exists():
        summary["samples"] = json.loads(generations.read_text())
    routing = getattr(trainer, "routing_statistics", None)
    if routing is not None and routing.counts is not None:
        summary["routing"] = routing.to_dict()  # each task's route on the dev sets
    return summary

