"""`ProblemType`: everything the library does differently for one kind of task, in one class.

A problem type owns, for the tasks of its kind:

- the task spec: which `TaskSpec` fields it uses and how `num_labels` is resolved (`resolve_num_labels`,
  `check_spec`, `id2label`);
- the data: the fields a row must hold, how a raw label is encoded (`encode_label`, checked on the host where the
  batch is made), how rows are tokenised and which extra columns they carry (`tokenize`);
- the model: its head (`head_class`, a `hf_taskmoe.layers.heads.TaskHead` that also prepares labels, computes the
  loss and says how many label values a row takes), and the `capabilities` a family checks (an encoder head, a
  tabular tower, a text-to-text decoder);
- evaluation: labels as the evaluation compares them (`eval_labels`), predictions from logits, the metrics and
  their defaults (`compute_metrics`, `default_metrics`), a trivial baseline (`baseline_logits`);
- MT-Uncertainty sampling (`entropy`), the pipelines' output (`pipeline_result`), the model card's label column
  (`card_labels`) and the Hub's pipeline tag (`hub_pipeline_tag`).

A new problem type is one file: a subclass, and `register_problem_type(MyType())`. Nothing outside its class
compares its name: the rest of the library asks the type (`problem_type_of(spec)`) or its capabilities.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from ..layers.task_head import IGNORE_INDEX  # noqa: F401 (re-exported to the types)
from .registry import (  # noqa: F401 (the registry's names, re-exported where they were defined before)
    ENCODER,
    PROBLEM_TYPES,
    TABULAR,
    TEXT_TO_TEXT,
    get_problem_type,
    problem_type_names,
    problem_type_of,
    register_problem_type,
)

if TYPE_CHECKING:
    import torch

    from ..tasks import TaskSpec



class ProblemType:
    """Base class of a problem type; subclasses set the class attributes and override the hooks that differ.

    Instances are stateless singletons kept in `PROBLEM_TYPES` by `name`. Every hook takes the task's `TaskSpec`.
    """

    #: the `TaskSpec.problem_type` value; transformers' words where they exist
    name: ClassVar[str] = ""
    #: what the task's results are filed under on the Hub (`model-index` task type, pipeline tag)
    hub_pipeline_tag: ClassVar[str] = "text-classification"
    #: metrics of a spec that names none (keys of `hf_taskmoe.metrics`, or any evaluate metric)
    default_metrics: ClassVar[tuple[str, ...]] = ("accuracy",)
    #: what a family may rely on (`ENCODER`, `TABULAR`, `TEXT_TO_TEXT`)
    capabilities: ClassVar[frozenset[str]] = frozenset({ENCODER})
    #: whether labels are classes (`label_values`, `label_names`, `id2label` apply)
    has_classes: ClassVar[bool] = True
    #: the smallest `num_labels` (2 for a classification over classes)
    min_labels: ClassVar[int] = 2
    #: the text field holds a list of words (token classification) rather than a text
    text_is_words: ClassVar[bool] = False
    #: an empty text field is a valid row (e.g. an empty choice context)
    allows_empty_text: ClassVar[bool] = False
    #: the label is a real number (a float in a batch's labels): a mixture holding such a task collates every
    #: batch's labels as floats, so that their dtype does not follow the batch's mix (`MultiTaskCollator`)
    float_labels: ClassVar[bool] = False
    #: the label is a JSON object (extractive QA's `{"text": [...], "answer_start": [...]}`), checked by
    #: `encode_label` rather than as a column of one kind
    label_is_object: ClassVar[bool] = False
    #: spec fields only this type may use (checked by `TaskSpec`): e.g. `("choice_fields",)`
    own_spec_fields: ClassVar[tuple[str, ...]] = ()
    #: the pipeline that serves the type (`"classification"`, `"text2text"`, `"question-answering"`) and the keys
    #: of its input dicts besides `task`
    pipeline: ClassVar[str] = "classification"
    pipeline_inputs: ClassVar[tuple[str, ...]] = ("text", "text_pair")
    #: the head class (a `TaskHead`) for encoder families; None for a type without an encoder head
    head_class: ClassVar[type | None] = None

    # ------------------------------------------------------------------ the spec
    def resolve_num_labels(self, spec: TaskSpec, prefix: str) -> int | None:
        """`num_labels` of the spec: given, from `label_names`, or (for types that have one) a default."""
        from ..utils import check_int

        n = spec.num_labels
        if n is None and spec.label_names is not None:
            n = len(spec.label_names)
        if n is None:
            raise ValueError(f"{prefix}: `num_labels` (or `label_names`) is required for problem_type={self.name!r}.")
        return check_int(n, f"{prefix}.num_labels", minimum=self.min_labels)

    def check_spec(self, spec: TaskSpec, prefix: str) -> dict[str, Any]:
        """Check the fields this type owns; return `{field: normalised value}` to set on the spec."""
        return {}

    def id2label(self, spec: TaskSpec) -> dict[int, str]:
        if not self.has_classes or spec.num_labels is None:
            return {}
        if spec.label_names is not None:
            return dict(enumerate(spec.label_names))
        return {i: f"LABEL_{i}" for i in range(spec.num_labels)}

    def label_width(self, spec: TaskSpec) -> int | None:
        """How many label values one row of the task takes in a collated batch (its head's `label_width`: 1 for a
        class index, `num_labels` for a multi-hot row or a multi-output regression), or None when the width follows
        the batch (a label per token, a target text's tokens) or the type has no encoder head."""
        if self.head_class is None:
            return None
        return self.head_class(spec, 1, 0.0).label_width()

    def rows_per_example(self, spec: TaskSpec) -> int:
        """Batch rows one example takes (multiple choice: one per choice, consecutive)."""
        return 1

    # ------------------------------------------------------------------ data
    def required_fields(self, spec: TaskSpec, with_labels: bool) -> list[str]:
        fields = list(spec.text_fields)
        if with_labels:
            fields.append(spec.label_field)
        return fields

    def text_fields(self, spec: TaskSpec) -> list[str]:
        """The fields holding text (checked: text, or words for `text_is_words`)."""
        return list(spec.text_fields)

    def encode_label(self, spec: TaskSpec, value: Any, where: str) -> Any:
        """A label as a data file writes it -> the model label of the row; `ValueError` naming `where` otherwise."""
        raise NotImplementedError(f"problem type {self.name!r} reads no labels")

    def check_row(self, spec: TaskSpec, row: dict, label: Any, where: str) -> list[str]:
        """Problems a row's label and inputs make together (token classification: one tag per word)."""
        return []

    def tokenize(self, spec: TaskSpec, batch: dict, labels: list | None, tokenizer, max_length: int,
                 where, **options) -> dict[str, list]:
        """Model columns for a batch of rows (`datasets.map(batched=True)`): `input_ids`, `attention_mask`,
        (`token_type_ids`), `labels` when `labels` (the encoded labels of these rows) is given, and the type's extra
        columns. May return more rows than it was given (long contexts split into windows). `where(i)` names row i
        for errors. `task_ids` is added by the caller."""
        out = self._encode_texts(spec, batch, tokenizer, max_length)
        if labels is not None:
            out["labels"] = list(labels)
        return out

    def _encode_texts(self, spec: TaskSpec, batch: dict, tokenizer, max_length: int, **tokenizer_kwargs) -> dict:
        """The rows' text fields as one text or a pair (three or more: all but the last joined, e.g. MultiRC's
        (paragraph + question, answer)), tokenised."""
        texts = [batch[f] for f in self.text_fields(spec)]
        n = len(texts[0])
        if len(texts) > 2:
            texts = [[_join([t[i] for t in texts[:-1]]) for i in range(n)], texts[-1]]
        return dict(tokenizer(*texts, truncation=True, max_length=max_length, **tokenizer_kwargs))

    # ------------------------------------------------------------------ tabular towers (MMoE)
    def check_tabular_column(self, spec: TaskSpec, column: torch.Tensor) -> None:
        """Check the values of one task's label column `(batch,)` of a tabular batch (NaN: no label); raises
        `ValueError` naming the task and row. A read of the values: done where the batch is checked."""

    def tabular_loss(self, spec: TaskSpec, logits: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
        """The task's loss on a tower's `logits` `(batch, logit_width)` against its label column `(batch,)`, rows
        without a label (NaN) left out; 0 when none has one. Reads no value back from the device."""
        raise NotImplementedError(f"problem type {self.name!r} has no tabular loss")

    # ------------------------------------------------------------------ evaluation
    def own_labels(self, spec: TaskSpec, labels: torch.Tensor) -> torch.Tensor:
        """A collated batch's labels of this task's rows without the columns the collator padded them with to the
        mixture's widest label (`MultiTaskCollator(label_width=...)`): a class index per row `(batch,)`, a multi-hot
        row `(batch, num_labels)`."""
        width = self.label_width(spec)
        if width is None or labels.dim() != 2 or labels.shape[1] <= width:
            return labels
        return labels[:, 0] if width == 1 else labels[:, :width]

    def eval_labels(self, spec: TaskSpec, labels: torch.Tensor) -> torch.Tensor:
        """A batch's labels as the evaluation gathers them (multiple choice: one per example)."""
        return labels

    def predictions(self, spec: TaskSpec, logits: np.ndarray) -> np.ndarray:
        """Model outputs of an evaluation set -> the predictions metrics compare with the labels."""
        return np.asarray(logits).argmax(-1)

    def metric_inputs(self, spec: TaskSpec, metric: str, logits: np.ndarray, predictions: np.ndarray,
                      labels: np.ndarray) -> tuple[dict, str | None]:
        """`(inputs, evaluate config name)` of one metric, by what the metric reads (`register_metric(inputs=...)`):
        scores of the positive class, the choice scores, or (default) the predicted labels."""
        from ..metrics import metric_inputs_kind

        reads = metric_inputs_kind(metric)
        if reads == "positive_scores":
            return {
                "prediction_scores": positive_scores(logits).tolist(),
                "references": labels.astype(np.int64).tolist(),
            }, None
        if reads == "choice_scores":
            return {"predictions": np.asarray(logits).tolist(), "references": labels.tolist()}, None
        return self.label_metric_inputs(spec, metric, predictions, labels)

    def label_metric_inputs(self, spec: TaskSpec, metric: str, predictions: np.ndarray,
                            labels: np.ndarray) -> tuple[dict, str | None]:
        """`metric_inputs` of a metric that compares predicted labels with the labels."""
        return {"predictions": predictions.tolist(), "references": labels.astype(np.int64).tolist()}, None

    def compute_metrics(
        self, spec: TaskSpec, logits: np.ndarray, labels: np.ndarray, run_metric, **context
    ) -> dict[str, float]:
        """Every metric of the task on one evaluation set. `run_metric(name, inputs, config_name)` computes one
        metric; `context` holds what some types need (`tokenizer`, `eos_token_id`, `dataset`: the task's
        tokenised evaluation set)."""
        predictions, labels = self._compared(spec, logits, np.asarray(labels))
        return {name: run_metric(name, *self.metric_inputs(spec, name, logits, predictions, labels))
                for name in spec.metrics}

    def _compared(self, spec, logits, labels):
        return self.predictions(spec, logits), labels

    def baseline_logits(self, spec: TaskSpec, source_labels: list, num_rows: int) -> np.ndarray | None:
        """Logits of a trivial predictor fitted on `source_labels` (the training labels): the majority class; None
        where no trivial baseline applies."""
        width = self.logit_width(spec)
        majority = Counter(int(v) for v in source_labels).most_common(1)[0][0]  # ties: the first seen
        logits = np.zeros((num_rows, width), dtype=np.float32)
        logits[:, majority] = 1.0
        return logits

    def logit_width(self, spec: TaskSpec) -> int:
        return spec.num_labels

    # ------------------------------------------------------------------ MT-Uncertainty
    def entropy(self, spec: TaskSpec, logits: torch.Tensor, attention_mask: torch.Tensor | None):
        """Per-example entropy `H` and the uniform distribution's `H'` (CA-MTL Algorithm 1); `None` for a type
        scored otherwise (regression: `regression_uncertainty`)."""
        import torch

        probs = torch.softmax(logits.float(), dim=-1)
        return torch.special.entr(probs).sum(-1), math.log(logits.shape[-1])

    # ------------------------------------------------------------------ pipelines, cards
    def pipeline_encode(self, spec: TaskSpec, item: dict, tokenizer, max_length: int, **extra) -> list[dict]:
        """One pipeline input -> the encoded rows (features) the model runs on."""
        return [tokenizer(item["text"], item.get("text_pair"), truncation=True, max_length=max_length, **extra)]

    def pipeline_result(self, spec: TaskSpec, logits: torch.Tensor, features: list[dict], item: dict,
                        top_k: int | None = None) -> dict:
        """The pipeline's answer for one input from the logits of its rows (`features`)."""
        raise NotImplementedError(f"problem type {self.name!r} has no pipeline output")

    def card_labels(self, spec: TaskSpec, label_range=None) -> str:
        """The model card task table's label column."""
        return ", ".join(spec.label_names) if spec.label_names else f"{spec.num_labels} classes"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def compute_task_metrics(task: TaskSpec, logits: np.ndarray, labels: np.ndarray, tokenizer=None, eos_token_id=None,
                         trust_remote_metrics: bool = False, dataset=None) -> dict[str, float]:
    """Every metric of `task` on one evaluation set: `{metric_name: value}`, as its problem type compares
    predictions with labels (`ProblemType.compute_metrics`), each metric run from `hf_taskmoe.metrics`' registry.
    `tokenizer`, `eos_token_id`: for types that decode text (seq2seq); `dataset`: the task's tokenised evaluation
    set, for types that read it (extractive QA)."""
    from ..metrics import run_metric

    def run(name: str, inputs: dict, config_name: str | None = None) -> float:
        return run_metric(name, inputs, config_name, trust_remote_metrics)

    return problem_type_of(task).compute_metrics(task, logits, labels, run, tokenizer=tokenizer,
                                                 eos_token_id=eos_token_id, dataset=dataset)


def mixture_label_width(specs) -> int | None:
    """The width of a mixture's collated labels: the widest `label_width` of its tasks when each has a fixed one and
    one is wider than 1 (a multi-label or multi-output regression task), so that every batch's labels have one shape
    whatever rows it holds (`MultiTaskCollator(label_width=...)`; a compiled step's graph keys on it); None when labels
    stay as wide as the batch's widest row (a task whose width follows the batch: token tags, target texts), or are
    one value per row anyway (width 1)."""
    widths = [problem_type_of(spec).label_width(spec) for spec in specs]
    if not widths or any(w is None for w in widths) or max(widths) <= 1:
        return None
    return max(widths)


def _join(values: list[str]) -> str:
    return " ".join(v for v in values if v)


def positive_scores(logits: np.ndarray) -> np.ndarray:
    """Score of class 1 for a binary task: softmax over two logits, or the single logit itself."""
    logits = np.asarray(logits, dtype=np.float64).reshape(len(logits), -1)
    if logits.shape[1] == 1:
        return logits[:, 0]
    if logits.shape[1] != 2:
        raise ValueError(f"roc_auc needs a binary task (1 or 2 logits per row), got {logits.shape[1]} logits.")
    return 1.0 / (1.0 + np.exp(logits[:, 0] - logits[:, 1]))  # softmax(logits)[:, 1]


def as_text(value: Any) -> str:
    """A JSON value as a data file wrote it (true, 3, 2.5) for a text target."""
    return value if isinstance(value, str) else json.dumps(value)
