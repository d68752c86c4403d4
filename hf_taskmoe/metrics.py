"""Per-task metrics: one registry of plain functions, offline.

Every metric is a function `fn(predictions, references) -> float` in `METRIC_REGISTRY`, registered with
`register_metric` (the defaults below at import, a user's own in code); evaluation calls it directly. For code that
wants `evaluate`'s API, `load_metric(name)` wraps any registered metric in the package's one local `evaluate` module
(`hf_taskmoe/metric_modules/taskmoe_metric/`, its `config_name` is the metric's name), so it loads offline.
A name that is not registered is loaded with `evaluate.load(name)`, which runs the code it finds under that name
(a local folder or a Hub repo). Metric names are data (they come from task files and saved configs), so such a
name is refused unless the caller opts in with `trust_remote_metrics=True` (`MultiTaskTrainingArguments`,
`--trust_remote_metrics`).

| metric name | inputs | used for |
|---|---|---|
| `accuracy` | labels | classification, multiple choice, span, token (per token) |
| `f1`, `f1_macro`, `f1_micro` | labels | MRPC/QQP (binary), CB (macro), multi-label (micro) |
| `matthews_correlation` | labels | CoLA |
| `pearson`, `spearmanr` | values | STS-B and other regression tasks |
| `f1a` | labels | MultiRC |
| `multiple_choice_accuracy` | choice_scores | ranking tasks scored per choice |
| `exact_match` | texts | generated text (accuracy of generated class names, QA answers) |
| `rouge1`, `rouge2`, `rougeL` | texts | generated summaries (F-measures) |
| `roc_auc` | positive_scores | binary tasks scored by the positive class's probability (MMoE census-income) |

A task's score is the mean of its metrics (GLUE convention); aggregates are the mean score over all
tasks and over small tasks (<= 10k training examples, MT-TaG section 4.5).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial
from itertools import takewhile
from pathlib import Path

import numpy as np

#: the one local `evaluate` module: it serves every registered metric, picked by `config_name`
EVALUATE_MODULE = Path(__file__).parent / "metric_modules" / "taskmoe_metric"

#: what a metric reads -> its `evaluate` features (column -> value type; a list marks a sequence), alternatives first
#: to last. `labels`: class indices, or multi-hot rows (multi-label); `values`: floats (regression); `texts`: strings
#: (seq2seq); `choice_scores`: the logits, one score per choice, and the right choice; `positive_scores`: the positive
#: class's score of a binary task (`positive_scores`) and 0/1 labels.
METRIC_INPUTS: dict[str, list[dict]] = {
    "labels": [{"predictions": "int64", "references": "int64"}, {"predictions": ["int64"], "references": ["int64"]}],
    "values": [{"predictions": "float64", "references": "float64"}],
    "texts": [{"predictions": "string", "references": "string"}],
    "choice_scores": [{"predictions": ["float64"], "references": "int64"}],
    "positive_scores": [{"prediction_scores": "float64", "references": "int64"}],
}


@dataclass(frozen=True)
class Metric:
    """A registered metric: `fn(predictions, references) -> float` and what it reads (a `METRIC_INPUTS` key)."""

    name: str
    fn: Callable[..., float]
    inputs: str = "labels"
    description: str = ""

    def __call__(self, predictions, references, **kwargs) -> float:
        return float(self.fn(predictions, references, **kwargs))


#: every metric a task may name: name -> Metric (`register_metric`; the defaults are registered below)
METRIC_REGISTRY: dict[str, Metric] = {}


def register_metric(name: str, fn: Callable[..., float], overwrite: bool = False, *, inputs: str = "labels",
                    description: str = "") -> None:
    """Make `name` usable in `TaskSpec.metrics`: `fn(predictions, references)` returns the metric's value, from the
    lists `compute_task_metrics` prepares: class indices (multi-hot rows for multi-label tasks), floats, or texts for
    seq2seq tasks, as the task predicts; `inputs="choice_scores"` gets the logits instead, `inputs="positive_scores"`
    the positive class's score. The defaults cannot be replaced."""
    if not isinstance(name, str) or not name or name in DEFAULT_METRICS:
        raise ValueError(f"Metric name {name!r} must be a new non-empty name (defaults: {sorted(DEFAULT_METRICS)}).")
    if name in METRIC_REGISTRY and not overwrite:
        raise ValueError(f"Metric {name!r} is already registered; pass overwrite=True to replace it.")
    _register(Metric(name, fn, inputs, description))


def _register(metric: Metric) -> None:
    if metric.inputs not in METRIC_INPUTS:
        raise ValueError(f"`inputs` must be one of {sorted(METRIC_INPUTS)}, got {metric.inputs!r}.")
    METRIC_REGISTRY[metric.name] = metric
    load_metric.cache_clear()  # an evaluate module built for the replaced metric would keep its old features


def get_metric(name: str) -> Metric:
    """The registered metric `name`; the error lists the registered names."""
    if name not in METRIC_REGISTRY:
        raise ValueError(f"Metric {name!r} is not registered; registered: {sorted(METRIC_REGISTRY)}.")
    return METRIC_REGISTRY[name]


# ----------------------------------------------------------------------------------------- default metrics
def _class_indices(name: str, *arrays):
    arrays = [np.asarray(a) for a in arrays]
    if any(a.ndim != 1 for a in arrays):
        raise ValueError(f"{name} needs one class index per example, got arrays of shapes {[a.shape for a in arrays]}.")
    return arrays


def _accuracy(predictions, references) -> float:
    predictions, references = _class_indices("accuracy", predictions, references)
    return float(np.mean(predictions == references)) if len(references) else 0.0


def _binary_f1(pred, ref, positive) -> float:
    tp = np.sum((pred == positive) & (ref == positive))
    fp = np.sum((pred == positive) & (ref != positive))
    fn = np.sum((pred != positive) & (ref == positive))
    return float(2 * tp / (2 * tp + fp + fn)) if (tp + fp + fn) else 0.0


def _f1(predictions, references, average="binary", pos_label=1) -> float:
    """binary (positive class `pos_label`), macro (mean over classes) or micro (global counts; multi-label rows
    are flattened)."""
    pred, ref = np.asarray(predictions), np.asarray(references)
    if pred.ndim == 2:  # multi-label: every (row, label) decision counts
        pred, ref = pred.reshape(-1), ref.reshape(-1)
        if average == "macro":
            raise ValueError("macro F1 needs class indices, not multi-hot rows")
        return _binary_f1(pred, ref, 1)
    if average == "binary":
        return _binary_f1(pred, ref, pos_label)
    classes = np.union1d(pred, ref)
    if average == "macro":
        return float(np.mean([_binary_f1(pred, ref, c) for c in classes]))
    if average == "micro":  # single-label micro F1 equals accuracy
        return float(np.mean(pred == ref))
    raise ValueError(f"average must be 'binary', 'macro' or 'micro', got {average!r}")


def _f1a(predictions, references) -> float:
    pred, ref = _class_indices("f1a", predictions, references)
    tp = np.sum((pred == 1) & (ref == 1))
    precision = tp / max(np.sum(pred == 1), 1)
    recall = tp / max(np.sum(ref == 1), 1)
    return float(2 * precision * recall / (precision + recall)) if precision + recall else 0.0


def _matthews_correlation(predictions, references) -> float:
    pred, ref = _class_indices("matthews_correlation", predictions, references)
    classes = np.union1d(pred, ref)
    index = {c: i for i, c in enumerate(classes)}
    confusion = np.zeros((len(classes), len(classes)), dtype=np.float64)
    for r, p in zip(ref, pred):
        confusion[index[r], index[p]] += 1
    t, p = confusion.sum(1), confusion.sum(0)  # true / predicted counts per class
    c, s = np.trace(confusion), confusion.sum()
    denominator = np.sqrt((s**2 - p @ p) * (s**2 - t @ t))
    return float((c * s - t @ p) / denominator) if denominator else 0.0


def _pearson(predictions, references) -> float:
    x, y = np.asarray(predictions, dtype=np.float64), np.asarray(references, dtype=np.float64)
    x, y = x - x.mean(), y - y.mean()
    denominator = np.sqrt((x @ x) * (y @ y))
    return float(x @ y / denominator) if denominator else 0.0


def _spearmanr(predictions, references) -> float:
    from scipy.stats import rankdata  # ties get their average rank

    return _pearson(rankdata(np.asarray(predictions, dtype=np.float64)),
                    rankdata(np.asarray(references, dtype=np.float64)))


def _multiple_choice_accuracy(predictions, references) -> float:
    chosen = np.array([int(np.argmax(scores)) for scores in predictions])
    return float(np.mean(chosen == np.asarray(references))) if len(chosen) else 0.0


def _exact_match(predictions, references, ignore_case=False) -> float:
    def norm(text):
        text = " ".join(str(text).split())
        return text.lower() if ignore_case else text

    matches = [norm(p) == norm(r) for p, r in zip(predictions, references)]
    return float(np.mean(matches)) if matches else 0.0


def _roc_auc(prediction_scores, references) -> float:
    from sklearn.metrics import roc_auc_score  # only tabular tasks need scikit-learn

    return float(roc_auc_score(references, prediction_scores))


_TOKEN = re.compile(r"[a-z0-9]+")


def _tokens(text) -> list[str]:
    return _TOKEN.findall(str(text).lower())


def _f_measure(overlap, predicted, reference) -> float:
    if overlap == 0 or predicted == 0 or reference == 0:
        return 0.0
    precision, recall = overlap / predicted, overlap / reference
    return 2 * precision * recall / (precision + recall)


def _ngram_f(pred, ref, n) -> float:
    p = Counter(tuple(pred[i : i + n]) for i in range(len(pred) - n + 1))
    r = Counter(tuple(ref[i : i + n]) for i in range(len(ref) - n + 1))
    return _f_measure(sum((p & r).values()), sum(p.values()), sum(r.values()))


def _lcs_f(pred, ref) -> float:
    row = [0] * (len(ref) + 1)  # longest common subsequence, one row at a time
    for x in pred:
        previous = 0
        for j, y in enumerate(ref, 1):
            current = row[j]
            row[j] = previous + 1 if x == y else max(row[j], row[j - 1])
            previous = current
    return _f_measure(row[-1], len(pred), len(ref))


def _rouge(predictions, references, score=_lcs_f) -> float:
    """Mean over examples of one ROUGE F-measure (Lin 2004); tokens are lower-cased runs of letters and digits (as
    `rouge_score`'s default tokenizer, without stemming)."""
    scores = [score(_tokens(p), _tokens(r)) for p, r in zip(predictions, references)]
    return float(np.mean(scores)) if scores else 0.0


#: the metrics shipped with the package, registered below like any other (and not replaceable)
DEFAULT_METRICS: dict[str, Metric] = {
    m.name: m
    for m in (
        Metric("accuracy", _accuracy, "labels", "Accuracy: share of predictions equal to the reference."),
        Metric(
            "f1",
            partial(_f1, average="binary"),
            "labels",
            "F1 of the positive class 1 (multi-label: of every decision).",
        ),
        Metric("f1_macro", partial(_f1, average="macro"), "labels", "F1 averaged over classes."),
        Metric(
            "f1_micro", partial(_f1, average="micro"), "labels", "F1 from global counts (multi-label rows flattened)."
        ),
        Metric(
            "matthews_correlation",
            _matthews_correlation,
            "labels",
            "Matthews correlation coefficient (multi-class form of Gorodkin 2004; binary MCC for two classes).",
        ),
        Metric("pearson", _pearson, "values", "Pearson correlation between predicted and reference scores."),
        Metric(
            "spearmanr",
            _spearmanr,
            "values",
            "Spearman rank correlation (Pearson correlation of the ranks, ties get their average rank).",
        ),
        Metric("f1a", _f1a, "labels", "F1a (MultiRC): binary F1 over all answer options, not grouped by question."),
        Metric(
            "multiple_choice_accuracy",
            _multiple_choice_accuracy,
            "choice_scores",
            "Multiple-choice accuracy: the choice with the highest score must be the reference choice.",
        ),
        Metric(
            "exact_match",
            _exact_match,
            "texts",
            "Exact match of generated and reference texts after normalising whitespace (optionally ignoring case).",
        ),
        Metric(
            "roc_auc",
            _roc_auc,
            "positive_scores",
            "ROC AUC of binary scores: the probability that a random positive row scores higher than a random negative "
            "one.",
        ),
        Metric(
            "rouge1", partial(_rouge, score=partial(_ngram_f, n=1)), "texts", "ROUGE-1 F-measure, mean over examples."
        ),
        Metric(
            "rouge2", partial(_rouge, score=partial(_ngram_f, n=2)), "texts", "ROUGE-2 F-measure, mean over examples."
        ),
        Metric(
            "rougeL",
            partial(_rouge, score=_lcs_f),
            "texts",
            "ROUGE-L (longest common subsequence) F-measure, mean over examples.",
        ),
    )
}


def check_metric_names(tasks, trust_remote_metrics: bool = False) -> None:
    """Refuse, before any compute, a metric name that is not registered: evaluating it would make `evaluate.load`
    import and run whatever code it finds under that name."""
    if trust_remote_metrics:
        return
    unknown = [(t.name, m) for t in tasks for m in t.metrics if m not in METRIC_REGISTRY]
    if unknown:
        listed = ", ".join(f"{m!r} (task {t!r})" for t, m in unknown)
        raise ValueError(
            f"Metric(s) {listed} are not shipped with hf_taskmoe ({sorted(DEFAULT_METRICS)}) nor registered in code "
            "(hf_taskmoe.metrics.register_metric). Metric names come from task files and saved configs, and loading an "
            "unknown one with `evaluate.load` runs the code found under that name (a local folder or a Hub repo). To "
            "allow it, pass trust_remote_metrics=True (MultiTaskTrainingArguments, or --trust_remote_metrics)."
        )


@cache
def load_metric(name: str, config_name: str | None = None, trust_remote_metrics: bool = False):
    """The `evaluate` module of metric `name`: for a registered metric the package's local module (offline; it calls
    the registered function); any other name only with `trust_remote_metrics=True` (then `evaluate.load(name,
    config_name)`, which may run code from a folder or the Hub)."""
    import evaluate

    if name in METRIC_REGISTRY:
        if config_name is not None:
            raise ValueError(
                f"Metric {name!r} is registered in hf_taskmoe and takes no config_name, got {config_name!r}."
            )
        return evaluate.load(str(EVALUATE_MODULE), name)
    if not trust_remote_metrics:
        raise ValueError(
            f"Metric {name!r} is not shipped with hf_taskmoe ({sorted(DEFAULT_METRICS)}); loading it would run code. "
            "Register it with hf_taskmoe.metrics.register_metric, or pass trust_remote_metrics=True."
        )
    return evaluate.load(name, config_name) if config_name else evaluate.load(name)


for _metric in DEFAULT_METRICS.values():
    _register(_metric)


def decode_texts(token_ids: np.ndarray, tokenizer, eos_token_id: int | list[int] | None = None) -> list[str]:
    """Rows of target or generated token ids -> texts, each cut at its first end token.

    The rows hold the target positions only (no decoder start token; -100, a negative id, pads them). Padding (a
    negative id or the tokenizer's pad token) is dropped, but no
    other special token is: a prediction that repeats [CLS] before the answer decodes as `[CLS] [CLS] fresh` and
    does not match `fresh`, where `skip_special_tokens` would have hidden the loop. `eos_token_id` defaults to the
    tokenizer's EOS ([SEP] for a BERT vocabulary, which has none)."""
    if eos_token_id is None:
        eos_token_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    ends = set(eos_token_id) if isinstance(eos_token_id, (list, tuple)) else {eos_token_id}
    pad = tokenizer.pad_token_id
    return [tokenizer.decode([t for t in takewhile(lambda t: t not in ends, row) if t >= 0 and t != pad],
                             skip_special_tokens=False).strip() for row in np.asarray(token_ids).tolist()]


def run_metric(name: str, inputs: dict, config_name: str | None = None, trust_remote_metrics: bool = False) -> float:
    """One metric's value: its registered function, or (a name not registered) its `evaluate` module's `compute`,
    read at the result's first key. `hf_taskmoe.problem_types.compute_task_metrics` runs a task's metrics so."""
    if name in METRIC_REGISTRY:
        return METRIC_REGISTRY[name](inputs.get("predictions", inputs.get("prediction_scores")), inputs["references"])
    module = load_metric(name, config_name, trust_remote_metrics)
    value = module.compute(**inputs)
    return float(next(iter(value.values())))


def metric_inputs_kind(name: str) -> str:
    """What a metric reads (`register_metric(..., inputs=...)`): "labels" (predicted labels), "positive_scores" or
    "choice_scores"; "labels" for a metric loaded from `evaluate`."""
    return METRIC_REGISTRY[name].inputs if name in METRIC_REGISTRY else "labels"


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
