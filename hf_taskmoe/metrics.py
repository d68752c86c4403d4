"""Per-task metrics through `evaluate`, offline.

The metrics the papers use ship inside the package as local `evaluate` modules
(`hf_taskmoe/metric_modules/<name>/`), because `evaluate.load("accuracy")` fetches its script from the
Hub. Metric names are data (they come from task files and saved configs), and `evaluate.load(name)` runs
the code it finds under that name (a local folder or a Hub repo): so a name that is neither shipped nor
registered in code with `register_metric` is refused, unless the caller opts in with
`trust_remote_metrics=True` (`MultiTaskTrainingArguments`, `--trust_remote_metrics`).

| metric name | module | used for |
|---|---|---|
| `accuracy` | accuracy | classification, multiple choice, span, token (per token) |
| `f1`, `f1_macro`, `f1_micro` | f1 | MRPC/QQP (binary), CB (macro), multi-label (micro) |
| `matthews_correlation` | matthews_correlation | CoLA |
| `pearson`, `spearmanr` | pearson, spearmanr | STS-B and other regression tasks |
| `f1a` | f1a | MultiRC |
| `multiple_choice_accuracy` | multiple_choice_accuracy | ranking tasks scored per choice |
| `exact_match` | exact_match | generated text (accuracy of generated class names, QA answers) |
| `rouge1`, `rouge2`, `rougeL` | rouge | generated summaries (F-measures) |
| `roc_auc` | roc_auc | binary tasks scored by the positive class's probability (MMoE census-income) |

A task's score is the mean of its metrics (GLUE convention); aggregates are the mean score over all
tasks and over small tasks (<= 10k training examples, MT-TaG section 4.5).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable
from pathlib import Path

import numpy as np

from .layers.heads import IGNORE_INDEX
from .tasks import TaskSpec

MODULE_DIR = Path(__file__).parent / "metric_modules"

# metric name -> (module folder, compute kwargs, key of the result)
SHIPPED_METRICS: dict[str, tuple[str, dict, str]] = {
    "accuracy": ("accuracy", {}, "accuracy"),
    "f1": ("f1", {"average": "binary"}, "f1"),
    "f1_macro": ("f1", {"average": "macro"}, "f1"),
    "f1_micro": ("f1", {"average": "micro"}, "f1"),
    "matthews_correlation": ("matthews_correlation", {}, "matthews_correlation"),
    "pearson": ("pearson", {}, "pearson"),
    "spearmanr": ("spearmanr", {}, "spearmanr"),
    "f1a": ("f1a", {}, "f1a"),
    "multiple_choice_accuracy": ("multiple_choice_accuracy", {}, "multiple_choice_accuracy"),
    "exact_match": ("exact_match", {}, "exact_match"),
    "roc_auc": ("roc_auc", {}, "roc_auc"),
    "rouge1": ("rouge", {}, "rouge1"),
    "rouge2": ("rouge", {}, "rouge2"),
    "rougeL": ("rouge", {}, "rougeL"),
}


#: metrics registered in code: name -> fn(predictions, references) -> float (`register_metric`)
METRIC_REGISTRY: dict[str, Callable[[list, list], float]] = {}


def register_metric(name: str, fn: Callable[[list, list], float], overwrite: bool = False) -> None:
    """Make `name` usable in `TaskSpec.metrics`: `fn(predictions, references)` returns the metric's value (the
    predictions as `compute_task_metrics` prepares them: class indices, floats, or texts for seq2seq tasks)."""
    if not isinstance(name, str) or not name or name in SHIPPED_METRICS:
        raise ValueError(f"Metric name {name!r} must be a new non-empty name (shipped: {sorted(SHIPPED_METRICS)}).")
    if name in METRIC_REGISTRY and not overwrite:
        raise ValueError(f"Metric {name!r} is already registered; pass overwrite=True to replace it.")
    METRIC_REGISTRY[name] = fn


def check_metric_names(tasks, trust_remote_metrics: bool = False) -> None:
    """Refuse, before any compute, a metric name that is neither shipped nor registered in code: evaluating it
    would make `evaluate.load` import and run whatever code it finds under that name."""
    if trust_remote_metrics:
        return
    unknown = [(t.name, m) for t in tasks for m in t.metrics if m not in SHIPPED_METRICS and m not in METRIC_REGISTRY]
    if unknown:
        listed = ", ".join(f"{m!r} (task {t!r})" for t, m in unknown)
        raise ValueError(
            f"Metric(s) {listed} are not shipped with hf_taskmoe ({sorted(SHIPPED_METRICS)}) nor registered in code "
            "(hf_taskmoe.metrics.register_metric). Metric names come from task files and saved configs, and loading an "
            "unknown one with `evaluate.load` runs the code found under that name (a local folder or a Hub repo). To "
            "allow it, pass trust_remote_metrics=True (MultiTaskTrainingArguments, or --trust_remote_metrics)."
        )


@lru_cache(maxsize=None)
def load_metric(name: str, config_name: str | None = None, trust_remote_metrics: bool = False):
    """The `evaluate` module of metric `name`: the shipped local one; any other name only with
    `trust_remote_metrics=True` (then `evaluate.load(name)`, which may run code from a folder or the Hub)."""
    import evaluate

    if name in SHIPPED_METRICS:
        folder = MODULE_DIR / SHIPPED_METRICS[name][0]
        return evaluate.load(str(folder), config_name) if config_name else evaluate.load(str(folder))
    if not trust_remote_metrics:
        raise ValueError(
            f"Metric {name!r} is not shipped with hf_taskmoe ({sorted(SHIPPED_METRICS)}); loading it would run code. "
            "Register it with hf_taskmoe.metrics.register_metric, or pass trust_remote_metrics=True."
        )
    return evaluate.load(name, config_name) if config_name else evaluate.load(name)


def predictions_from_logits(task: TaskSpec, logits: np.ndarray) -> np.ndarray:
    """Model outputs -> the predictions metrics compare with labels, by problem type."""
    logits = np.asarray(logits)
    if task.problem_type == "regression":
        return logits.reshape(len(logits), -1).squeeze(-1) if task.num_labels == 1 else logits
    if task.problem_type == "multi_label_classification":
        return (logits > 0).astype(np.int64)  # sigmoid(x) > 0.5
    return logits.argmax(-1)


def positive_scores(logits: np.ndarray) -> np.ndarray:
    """Score of class 1 for a binary task: softmax over two logits, or the single logit itself."""
    logits = np.asarray(logits, dtype=np.float64).reshape(len(logits), -1)
    if logits.shape[1] == 1:
        return logits[:, 0]
    if logits.shape[1] != 2:
        raise ValueError(f"roc_auc needs a binary task (1 or 2 logits per row), got {logits.shape[1]} logits.")
    return 1.0 / (1.0 + np.exp(logits[:, 0] - logits[:, 1]))  # softmax(logits)[:, 1]


def decode_texts(token_ids: np.ndarray, tokenizer, eos_token_id: int | list[int] | None = None) -> list[str]:
    """Rows of target or generated token ids -> texts, each cut at its first end token.

    The rows hold the target positions only (no decoder start token; -100 pads them). Padding is dropped, but no
    other special token is: a prediction that repeats [CLS] before the answer decodes as `[CLS] [CLS] fresh` and
    does not match `fresh`, where `skip_special_tokens` would have hidden the loop. `eos_token_id` defaults to the
    tokenizer's EOS ([SEP] for a BERT vocabulary, which has none)."""
    if eos_token_id is None:
        eos_token_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    ends = set(eos_token_id) if isinstance(eos_token_id, (list, tuple)) else {eos_token_id}
    dropped = {IGNORE_INDEX, tokenizer.pad_token_id}
    texts = []
    for row in np.asarray(token_ids).tolist():
        kept = []
        for token in row:
            if token in ends:
                break
            if token not in dropped:
                kept.append(token)
        texts.append(tokenizer.decode(kept, skip_special_tokens=False).strip())
    return texts


def seq2seq_metrics(task: TaskSpec, predictions: np.ndarray, labels: np.ndarray, tokenizer, eos_token_id=None,
                    trust_remote_metrics: bool = False) -> dict[str, float]:
    """A text-to-text task's metrics on predicted target tokens (generated, without the decoder start token, or
    the teacher-forced arg-max) against the target ids, both decoded by `decode_texts`."""
    if tokenizer is None:
        raise ValueError(f"Task {task.name!r} is seq2seq: its metrics decode texts, so pass the tokenizer (processing_class).")
    predictions = np.asarray(predictions)
    if predictions.ndim == 3:  # logits
        predictions = predictions.argmax(-1)
    texts, references = decode_texts(predictions, tokenizer, eos_token_id), decode_texts(labels, tokenizer, eos_token_id)
    inputs = {"predictions": texts, "references": references}
    return {name: _run_metric(name, inputs, trust_remote_metrics=trust_remote_metrics) for name in task.metrics}


def _run_metric(name: str, inputs: dict, config_name: str | None = None, trust_remote_metrics: bool = False) -> float:
    """One metric's value: a registered function, or its module's `compute` with the shipped kwargs, read at its
    result key."""
    if name in METRIC_REGISTRY:
        return float(METRIC_REGISTRY[name](inputs.get("predictions", inputs.get("prediction_scores")), inputs["references"]))
    module = load_metric(name, config_name, trust_remote_metrics)
    kwargs, key = (SHIPPED_METRICS[name][1], SHIPPED_METRICS[name][2]) if name in SHIPPED_METRICS else ({}, None)
    value = module.compute(**inputs, **kwargs)
    return float(value[key] if key else next(iter(value.values())))


def compute_task_metrics(task: TaskSpec, logits: np.ndarray, labels: np.ndarray, tokenizer=None, eos_token_id=None,
                         trust_remote_metrics: bool = False) -> dict[str, float]:
    """Every metric of `task` on one evaluation set: `{metric_name: value}` (`tokenizer`, `eos_token_id`: seq2seq
    tasks only)."""
    if task.problem_type == "seq2seq":
        return seq2seq_metrics(task, logits, labels, tokenizer, eos_token_id, trust_remote_metrics)
    predictions = predictions_from_logits(task, logits)
    labels = np.asarray(labels)
    if task.problem_type == "token_classification":
        # evaluation gathers token logits padded to the longest batch; compare real tokens only
        width = min(predictions.shape[1], labels.shape[1])
        predictions, labels = predictions[:, :width], labels[:, :width]
        keep = labels != IGNORE_INDEX
        predictions, labels = predictions[keep], labels[keep]
    results = {}
    for name in task.metrics:
        if name == "roc_auc":
            inputs = {"prediction_scores": positive_scores(logits).tolist(), "references": labels.astype(np.int64).tolist()}
        elif name == "multiple_choice_accuracy":
            inputs = {"predictions": np.asarray(logits).tolist(), "references": labels.tolist()}
        elif task.problem_type == "regression":
            inputs = {"predictions": predictions.reshape(-1).tolist(), "references": labels.reshape(-1).tolist()}
        else:
            inputs = {"predictions": predictions.tolist(), "references": labels.astype(np.int64).tolist()}
        config = "multilabel" if task.problem_type == "multi_label_classification" and name.startswith("f1") else None
        results[name] = _run_metric(name, inputs, config, trust_remote_metrics)
    return results


def task_score(metrics: dict[str, float]) -> float:
    """A task's single score: the mean of its metrics."""
    return float(np.mean(list(metrics.values())))


def aggregate_scores(
    scores: dict[str, float], train_sizes: dict[str, int] | None = None, small_task_threshold: int = 10_000
) -> dict[str, float]:
    """`average` over all tasks and `small_tasks_average` over tasks with <= threshold training examples."""
    out = {"average": float(np.mean(list(scores.values())))} if scores else {}
    if train_sizes:
        small = [s for t, s in scores.items() if t in train_sizes and train_sizes[t] <= small_task_threshold]
        if small:
            out["small_tasks_average"] = float(np.mean(small))
    return out
