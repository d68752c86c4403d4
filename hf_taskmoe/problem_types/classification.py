"""The problem types of an encoder with per-task heads: one class per type, with its head.

| problem type | head | loss | label of one example |
|---|---|---|---|
| `single_label_classification` | linear on the pooled representation | cross-entropy | class index |
| `multi_label_classification` | linear on the pooled representation | binary cross-entropy | multi-hot vector |
| `regression` | linear on the pooled representation | mean squared error | float (or `num_labels` floats) |
| `multiple_choice` | one score per (context, choice) row | cross-entropy over the choices | index of the right choice |
| `span_classification` | linear on [CLS] + mean of each word span (WiC) | cross-entropy | class index |
| `token_classification` | linear on every token | cross-entropy, -100 ignored | one class index per token |
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from ..layers.task_head import IGNORE_INDEX, TaskHead, bad_rows
from ..utils import check_str_list
from .base import ENCODER, TABULAR, ProblemType, _join, register_problem_type
from .labels import class_index, number


# ----------------------------------------------------------------------------------------------- heads
class SequenceClassificationHead(TaskHead):
    """`P(c|x_t) = softmax(U_t h(x_t))` on the pooled representation (MT-TaG eq. 7)."""

    every_row = True
    reads_sequence = False
    stacks = True
    #: the kind of task its label errors name
    label_kind = "single-label"

    def __init__(self, task, hidden_size, dropout, scale_loss_by_num_classes=False):
        super().__init__(task, hidden_size, dropout, scale_loss_by_num_classes)
        self.classifier = nn.Linear(hidden_size, task.num_labels)

    def forward(self, sequence_output, pooled_output, span_positions=None):
        return self.classifier(self.dropout(pooled_output))  # (rows, num_labels)

    def prepare_labels(self, labels, rows, seq_len, padded=True, check_values=True):
        values = self._own_columns(labels, rows, 1, padded, self.label_kind, check_values)[:, 0]  # (rows,)
        return self._class_indices(values, rows, self.num_labels, check_values)

    def loss(self, logits, labels):
        return self._cross_entropy(logits, labels, self.num_labels)


class MultiLabelClassificationHead(SequenceClassificationHead):
    """Independent sigmoid per label, binary cross-entropy."""

    stacks = False  # its loss is not the cross-entropy over class indices

    def label_width(self):
        return self.num_labels

    def prepare_labels(self, labels, rows, seq_len, padded=True, check_values=True):
        if labels.dim() != 2 or labels.shape[1] < self.num_labels:
            raise ValueError(
                f"Labels of multi-label task {self.task_name!r} must be multi-hot rows of {self.num_labels} values, "
                f"got labels of shape {tuple(labels.shape)}."
            )
        values = self._own_columns(labels, rows, self.num_labels, padded, "multi-label", check_values)
        if check_values:
            bad = (values != 0) & (values != 1)  # (rows, num_labels)
            if bad.any():
                raise ValueError(
                    f"Labels of multi-label task {self.task_name!r} must be 0 or 1; rows {bad_rows(bad.any(-1), rows)} "
                    "hold other values."
                )
        return values.float()

    def loss(self, logits, labels):
        return F.binary_cross_entropy_with_logits(logits.float(), labels)

    def loss_on_rows(self, logits, labels, member):
        return self._mean_on_rows(F.binary_cross_entropy_with_logits(logits.float(), labels, reduction="none"), member)


class RegressionHead(TaskHead):
    """`S(x_t) = V_t h(x_t)` (MT-TaG eq. 8), mean squared error."""

    every_row = True
    reads_sequence = False

    def __init__(self, task, hidden_size, dropout, scale_loss_by_num_classes=False):
        super().__init__(task, hidden_size, dropout, scale_loss_by_num_classes)
        self.regressor = nn.Linear(hidden_size, task.num_labels)

    def forward(self, sequence_output, pooled_output, span_positions=None):
        return self.regressor(self.dropout(pooled_output))  # (rows, num_labels)

    def label_width(self):
        return self.num_labels

    def prepare_labels(self, labels, rows, seq_len, padded=True, check_values=True):
        if not labels.is_floating_point():
            raise ValueError(
                f"Labels of regression task {self.task_name!r} must be floating point, got dtype {labels.dtype} "
                "(cast them with `labels.float()`; class indices belong to a classification task)."
            )
        values = self._own_columns(labels, rows, self.num_labels, padded, "regression", check_values)
        if check_values:
            bad = ~torch.isfinite(values)  # (rows, num_labels)
            if bad.any():
                raise ValueError(
                    f"Labels of regression task {self.task_name!r} must be finite; rows {bad_rows(bad.any(-1), rows)} "
                    "are not."
                )
        return values.float()

    def loss(self, logits, labels):
        return F.mse_loss(logits.float(), labels)

    def loss_on_rows(self, logits, labels, member):
        return self._mean_on_rows(F.mse_loss(logits.float(), labels, reduction="none"), member)


class MultipleChoiceHead(TaskHead):
    """One score per (context, choice) row; cross-entropy over the `num_choices` rows of an example."""

    per_row = False
    reads_sequence = False

    def __init__(self, task, hidden_size, dropout, scale_loss_by_num_classes=False):
        super().__init__(task, hidden_size, dropout, scale_loss_by_num_classes)
        self.num_choices = task.num_choices
        self.scorer = nn.Linear(hidden_size, 1)

    def forward(self, sequence_output, pooled_output, span_positions=None):
        scores = self.scorer(self.dropout(pooled_output))  # (rows, 1)
        return scores.view(-1, self.num_choices)  # (examples, num_choices)

    def check_rows(self, rows, seq_len, span_positions=None, check_values=True):
        if len(rows) % self.num_choices:
            raise ValueError(
                f"Multiple-choice task {self.task_name!r} needs {self.num_choices} consecutive rows per example, "
                f"but the batch holds {len(rows)} rows of it."
            )

    def prepare_labels(self, labels, rows, seq_len, padded=True, check_values=True):
        values = self._own_columns(labels, rows, 1, padded, "multiple-choice", check_values)[:, 0]  # (rows,)
        values = self._class_indices(values, rows, self.num_choices, check_values)
        grouped = values.view(-1, self.num_choices)  # (examples, num_choices)
        if check_values:
            differs = (grouped != grouped[:, :1]).any(-1)  # (examples,)
            if differs.any():
                first = differs.nonzero()[0, 0].item() * self.num_choices
                raise ValueError(
                    f"Multiple-choice task {self.task_name!r}: the {self.num_choices} rows of one example must carry "
                    f"the same label (the index of the right choice); rows "
                    f"{rows[first : first + self.num_choices].tolist()} differ."
                )
        return grouped[:, 0]

    def num_examples(self, num_rows):
        return num_rows // self.num_choices

    def loss(self, logits, labels):
        return self._cross_entropy(logits, labels, self.num_choices)


class SpanClassificationHead(SequenceClassificationHead):
    """WiC-style: [CLS] representation concatenated with the mean of each word span's tokens (labels and loss as a
    single-label head's)."""

    reads_spans = True
    label_kind = "span-classification"

    def __init__(self, task, hidden_size, dropout, scale_loss_by_num_classes=False):
        # the classifier reads [CLS] and the mean of each span: (1 + spans) * hidden features
        super().__init__(task, hidden_size * (1 + task.num_spans), dropout, scale_loss_by_num_classes)
        self.num_spans = task.num_spans

    def forward(self, sequence_output, pooled_output, span_positions=None):
        rows, seq_len, _ = sequence_output.shape
        positions = torch.arange(seq_len, device=sequence_output.device)
        start = span_positions[..., 0:1]  # (rows, spans, 1)
        end = span_positions[..., 1:2]
        in_span = (positions >= start) & (positions < end)  # (rows, spans, seq)
        weights = in_span.to(sequence_output.dtype) / in_span.sum(-1, keepdim=True).clamp(min=1)
        spans = torch.einsum("rns,rsd->rnd", weights, sequence_output)  # (rows, spans, hidden)
        features = torch.cat([pooled_output, spans.flatten(1)], dim=-1)  # (rows, (1+spans)*hidden), also for 0 rows
        return self.classifier(self.dropout(features))  # (rows, num_labels)

    def check_rows(self, rows, seq_len, span_positions=None, check_values=True):
        if span_positions is None:
            raise ValueError(
                f"Span-classification task {self.task_name!r} needs `span_positions` (LongTensor (batch, "
                f"{self.num_spans}, 2): start and end token of each span, end exclusive)."
            )
        if check_values:
            spans = span_positions.index_select(0, rows)
            bad = (spans[..., 0] < 0) | (spans[..., 1] <= spans[..., 0]) | (spans[..., 1] > seq_len)  # (rows, spans)
            if bad.any():
                raise ValueError(
                    f"`span_positions` of task {self.task_name!r} must satisfy 0 <= start < end <= {seq_len}; "
                    f"rows {bad_rows(bad.any(-1), rows)} do not."
                )


class TokenClassificationHead(SequenceClassificationHead):
    """A class per token (a single-label head's classifier and loss on every token); labels of -100 (special tokens,
    padding, non-first word pieces) are ignored."""

    def logit_shape(self):
        return (None, self.num_labels)

    def forward(self, sequence_output, pooled_output, span_positions=None):
        return self.classifier(self.dropout(sequence_output))  # (rows, seq, num_labels)

    def label_width(self):
        return None

    def prepare_labels(self, labels, rows, seq_len, padded=True, check_values=True):
        if labels.dim() != 2:
            raise ValueError(
                f"Labels of token-classification task {self.task_name!r} must be 2-D (batch, seq), "
                f"got shape {tuple(labels.shape)}."
            )
        if labels.shape[1] < seq_len:
            labels = F.pad(labels, (0, seq_len - labels.shape[1]), value=IGNORE_INDEX)
        elif labels.shape[1] > seq_len:
            if check_values:
                beyond = labels[:, seq_len:] != IGNORE_INDEX  # (rows, extra)
                if beyond.any():
                    raise ValueError(
                        f"Labels of token-classification task {self.task_name!r} are longer than the input "
                        f"({labels.shape[1]} > {seq_len} tokens) in rows {bad_rows(beyond.any(-1), rows)}."
                    )
            labels = labels[:, :seq_len]
        return self._class_indices(labels, rows, self.num_labels, check_values)


# ----------------------------------------------------------------------------------------------- types
class _ClassType(ProblemType):
    """A label that is one class of the task (a name, a position or one of `label_values`)."""

    def encode_label(self, spec, value, where):
        if isinstance(value, (list, tuple, dict)):
            raise ValueError(
                f"{where}: a {self.name} label is one class (a name or a position), got {value!r}; a one-hot or "
                "a list of classes is not guessed at."
            )
        return class_index(spec, value, where)

    def pipeline_result(self, spec, logits, features, item, top_k=None):
        labels = spec.label_names or [f"LABEL_{i}" for i in range(logits.shape[-1])]
        probs = logits[0].float().softmax(-1)
        if top_k is None:
            best = int(probs.argmax())
            return {"task": spec.name, "label": labels[best], "score": float(probs[best])}
        order = probs.argsort(descending=True)[:top_k].tolist()
        return {"task": spec.name, "top": [{"label": labels[i], "score": float(probs[i])} for i in order]}


class SingleLabelClassification(_ClassType):
    name = "single_label_classification"
    capabilities = frozenset({ENCODER, TABULAR})
    head_class = SequenceClassificationHead

    @staticmethod
    def _present(column):
        return ~torch.isnan(column) & (column != IGNORE_INDEX)  # NaN or -100: no label

    def check_tabular_column(self, spec, column):
        bad = self._present(column) & ((column < 0) | (column >= spec.num_labels) | (column != column.round()))
        if bad.any():
            row = bad.nonzero()[0, 0].item()
            raise ValueError(
                f"Task {spec.name!r}: label {column[row].item()} in row {row} is not a class index in [0, "
                f"{spec.num_labels})."
            )

    def tabular_loss(self, spec, logits, column):
        present = self._present(column)  # (batch,)
        targets = torch.where(present, column, torch.zeros_like(column)).long()
        per_row = F.cross_entropy(logits.float(), targets, reduction="none")  # (batch,)
        return (per_row * present).sum() / present.sum().clamp(min=1)


class MultiLabelClassification(_ClassType):
    name = "multi_label_classification"
    default_metrics = ("f1_micro",)
    min_labels = 1
    head_class = MultiLabelClassificationHead

    def encode_label(self, spec, value, where):
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if (len(values) == spec.num_labels and len(values) > 1 and spec.label_values is None
                and all(type(v) is int and v in (0, 1) for v in values)):
            raise ValueError(
                f"{where}: label {value!r} could be a multi-hot row or a list of class positions; a multi-label label "
                "lists the task's classes (names, or positions), e.g. "
                f"{[spec.id2label.get(i, i) for i, v in enumerate(values) if v][:3]}."
            )
        hot = [0] * spec.num_labels
        for v in values:
            index = class_index(spec, v, where)
            if hot[index]:
                raise ValueError(f"{where}: label {value!r} lists class {v!r} twice.")
            hot[index] = 1
        return hot

    def predictions(self, spec, logits):
        return (np.asarray(logits) > 0).astype(np.int64)  # sigmoid(x) > 0.5

    def label_metric_inputs(self, spec, metric, predictions, labels):
        inputs, _ = super().label_metric_inputs(spec, metric, predictions, labels)
        return inputs, ("multilabel" if metric.startswith("f1") else None)

    def baseline_logits(self, spec, source_labels, num_rows):
        majority = (np.asarray(source_labels, dtype=np.float64).mean(axis=0) > 0.5).astype(np.float32)
        return np.tile(np.where(majority > 0, 1.0, -1.0), (num_rows, 1)).astype(np.float32)

    def entropy(self, spec, logits, attention_mask):
        p = torch.sigmoid(logits.float())
        h = (torch.special.entr(p) + torch.special.entr(1 - p)).sum(-1)  # (rows,)
        return h, logits.shape[-1] * math.log(2)

    def pipeline_result(self, spec, logits, features, item, top_k=None):
        labels = spec.label_names or [f"LABEL_{i}" for i in range(logits.shape[-1])]
        probs = logits[0].float().sigmoid().tolist()
        return {
            "task": spec.name,
            "labels": [label for label, p in zip(labels, probs) if p > 0.5],
            "scores": dict(zip(labels, probs)),
        }


class Regression(ProblemType):
    name = "regression"
    float_labels = True
    hub_pipeline_tag = "text-regression"  # the Hub has none for regression on text; not a classification result
    default_metrics = ("pearson", "spearmanr")
    capabilities = frozenset({ENCODER, TABULAR})
    has_classes = False
    min_labels = 1
    own_spec_fields = ("target_range",)
    head_class = RegressionHead

    def resolve_num_labels(self, spec, prefix):
        if spec.num_labels is None and spec.label_names is None:
            return 1
        return super().resolve_num_labels(spec, prefix)

    def check_spec(self, spec, prefix):
        from ..utils import check_float

        if spec.target_range is None:
            return {}
        low_high = spec.target_range
        if isinstance(low_high, (str, bytes)) or not isinstance(low_high, (list, tuple)) or len(low_high) != 2:
            raise ValueError(f"{prefix}: `target_range` must be [low, high], got {low_high!r}.")
        low, high = (check_float(v, f"{prefix}.target_range[]") for v in low_high)
        if not low < high:
            raise ValueError(f"{prefix}: `target_range` must have low < high, got {low_high!r}.")
        return {"target_range": [low, high]}

    def encode_label(self, spec, value, where):
        values = value if isinstance(value, (list, tuple)) else [value]
        if len(values) != spec.num_labels:
            raise ValueError(f"{where}: expected {spec.num_labels} regression target(s), got {value!r}.")
        numbers = []
        for v in values:
            n = number(v)
            if n is None:
                raise ValueError(f"{where}: regression label {v!r} is not a number.")
            if not math.isfinite(n):
                raise ValueError(f"{where}: regression label {v!r} is not finite.")
            numbers.append(n)
        return numbers if isinstance(value, (list, tuple)) else numbers[0]

    def predictions(self, spec, logits):
        logits = np.asarray(logits)
        return logits.reshape(len(logits), -1).squeeze(-1) if spec.num_labels == 1 else logits

    def label_metric_inputs(self, spec, metric, predictions, labels):
        return {"predictions": predictions.reshape(-1).tolist(), "references": labels.reshape(-1).tolist()}, None

    def baseline_logits(self, spec, source_labels, num_rows):
        mean = np.asarray(source_labels, dtype=np.float64).reshape(len(source_labels), -1).mean(axis=0)
        return np.tile(mean, (num_rows, 1)).astype(np.float32)

    def entropy(self, spec, logits, attention_mask):
        return None  # scored by `regression_uncertainty` (hf_taskmoe.training.uncertainty)

    def tabular_loss(self, spec, logits, column):
        present = ~torch.isnan(column)  # (batch,)
        targets = torch.where(present, column, torch.zeros_like(column))
        squared = (logits[:, 0].float() - targets) ** 2 * present  # (batch,)
        return squared.sum() / present.sum().clamp(min=1)

    def logit_width(self, spec):
        return spec.num_labels

    def pipeline_result(self, spec, logits, features, item, top_k=None):
        value = logits[0].float().tolist()
        result = {"task": spec.name, "score": value[0] if len(value) == 1 else value}
        if spec.target_range:
            result["scale"] = list(spec.target_range)  # what the score means: the range of the task's targets
        return result

    def card_labels(self, spec, label_range=None):
        low_high = spec.target_range or label_range
        return f"target {low_high[0]:g} to {low_high[1]:g}" if low_high else f"{spec.num_labels} real value(s)"


class MultipleChoice(ProblemType):
    name = "multiple_choice"
    hub_pipeline_tag = "multiple-choice"
    has_classes = False
    allows_empty_text = True
    own_spec_fields = ("choice_fields",)
    pipeline = "none"
    head_class = MultipleChoiceHead

    def resolve_num_labels(self, spec, prefix):
        n = spec.num_labels
        if n is not None and n != len(spec.choice_fields):
            raise ValueError(
                f"{prefix}: `num_labels` ({n}) must equal the number of `choice_fields` ({len(spec.choice_fields)})."
            )
        return len(spec.choice_fields)

    def check_spec(self, spec, prefix):
        if spec.choice_fields is None:
            raise ValueError(f"{prefix}: `choice_fields` is required for problem_type='multiple_choice'.")
        choices = check_str_list(spec.choice_fields, f"{prefix}.choice_fields")
        if len(choices) < 2:
            raise ValueError(f"{prefix}: `choice_fields` needs at least 2 choices, got {choices}.")
        return {"choice_fields": choices}

    def rows_per_example(self, spec):
        return spec.num_choices

    def required_fields(self, spec, with_labels):
        fields = super().required_fields(spec, with_labels)
        return fields[: len(spec.text_fields)] + list(spec.choice_fields) + fields[len(spec.text_fields):]

    def text_fields(self, spec):
        return list(spec.text_fields) + list(spec.choice_fields)

    def encode_label(self, spec, value, where):
        return _ClassType.encode_label(self, spec, value, where)

    def tokenize(self, spec, batch, labels, tokenizer, max_length, where, **options):
        n = len(batch[spec.text_fields[0]])
        contexts = [_join([batch[f][i] for f in spec.text_fields]) for i in range(n)]
        per_choice = [tokenizer(contexts, batch[c], truncation=True, max_length=max_length) for c in spec.choice_fields]
        # one row per example holding one sequence per choice; the collator makes one batch row per choice
        out = {key: [[enc[key][i] for enc in per_choice] for i in range(n)] for key in per_choice[0]}
        if labels is not None:
            out["labels"] = list(labels)
        return out

    def eval_labels(self, spec, labels):
        return labels.view(-1, spec.num_choices)[:, 0]  # one label per example, not per choice row

    def logit_width(self, spec):
        return spec.num_choices

    def card_labels(self, spec, label_range=None):
        return f"{spec.num_choices} choices"


class SpanClassification(_ClassType):
    name = "span_classification"
    own_spec_fields = ("span_fields",)
    pipeline = "none"
    head_class = SpanClassificationHead

    def check_spec(self, spec, prefix):
        spans = spec.span_fields
        if (
            not isinstance(spans, (list, tuple))
            or not spans
            or not all(isinstance(s, (list, tuple)) and len(s) == 2 for s in spans)
        ):
            raise ValueError(
                f"{prefix}: `span_fields` must be a non-empty list of [start_field, end_field] pairs for "
                f"problem_type='span_classification', got {spans!r}."
            )
        spans = [check_str_list(list(s), f"{prefix}.span_fields") for s in spans]
        if len(spans) > len(spec.text_fields):
            raise ValueError(
                f"{prefix}: `span_fields` has {len(spans)} spans but only {len(spec.text_fields)} text fields; "
                "the i-th span lies in the i-th text field."
            )
        return {"span_fields": spans}

    def required_fields(self, spec, with_labels):
        fields = list(spec.text_fields) + [f for pair in spec.span_fields for f in pair]
        return fields + ([spec.label_field] if with_labels else [])

    def tokenize(self, spec, batch, labels, tokenizer, max_length, where, **options):
        n = len(batch[spec.text_fields[0]])
        enc = tokenizer(*[batch[f] for f in spec.text_fields[:2]], truncation=True, max_length=max_length,
                        return_offsets_mapping=True)
        out = {k: v for k, v in enc.items() if k != "offset_mapping"}
        out["span_positions"] = [
            _span_tokens(spec, enc, i, [(batch[s][i], batch[e][i]) for s, e in spec.span_fields], where(i))
            for i in range(n)
        ]
        if labels is not None:
            out["labels"] = list(labels)
        return out


def _span_tokens(spec, enc, i, char_spans, where: str) -> list[list[int]]:
    """Token [start, end) of each character span; span k lies in text segment k."""
    sequence_ids = enc.sequence_ids(i)
    offsets = enc["offset_mapping"][i]
    spans = []
    for k, (start, end) in enumerate(char_spans):
        tokens = [
            t for t, (seg, (a, b)) in enumerate(zip(sequence_ids, offsets))
            if seg == k and b > a and a < int(end) and b > int(start)
        ]
        if not tokens:
            raise ValueError(
                f"Task {spec.name!r}, {where}: span {k} (characters {start}..{end}) covers no token "
                "(outside the text or truncated away)."
            )
        spans.append([tokens[0], tokens[-1] + 1])
    return spans


class TokenClassification(_ClassType):
    name = "token_classification"
    hub_pipeline_tag = "token-classification"
    text_is_words = True
    pipeline = "none"
    head_class = TokenClassificationHead

    def encode_label(self, spec, value, where):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where}: token-classification labels must be a list (one per word), got {value!r}.")
        return [class_index(spec, v, where) for v in value]

    def check_row(self, spec, row, label, where):
        words = row.get(spec.text_fields[0])
        if label is not None and isinstance(words, (list, tuple)) and len(words) != len(label):
            return [
                f"Task {spec.name!r}, {where}: {len(label)} label(s) (field {spec.label_field!r}) for {len(words)} "
                f"word(s) (field {spec.text_fields[0]!r}); a token-classification row has one label per word."
            ]
        return []

    def tokenize(self, spec, batch, labels, tokenizer, max_length, where, **options):
        words = batch[spec.text_fields[0]]
        enc = tokenizer(words, is_split_into_words=True, truncation=True, max_length=max_length)
        out = dict(enc)
        if labels is not None:
            for i, (row_words, row_labels) in enumerate(zip(words, labels)):
                problems = self.check_row(spec, {spec.text_fields[0]: row_words}, row_labels, where(i))
                if problems:  # `check_task_split` refuses it; labels passed in are checked too
                    raise ValueError(problems[0])
            out["labels"] = [_align_word_labels(enc.word_ids(i), row) for i, row in enumerate(labels)]
        return out

    def _compared(self, spec, logits, labels):
        predictions = self.predictions(spec, logits)
        # evaluation gathers token logits padded to the longest batch; compare real tokens only
        width = min(predictions.shape[1], labels.shape[1])
        predictions, labels = predictions[:, :width], labels[:, :width]
        keep = labels != IGNORE_INDEX
        return predictions[keep], labels[keep]

    def baseline_logits(self, spec, source_labels, num_rows):
        return None

    def entropy(self, spec, logits, attention_mask):
        per_token = torch.special.entr(torch.softmax(logits.float(), dim=-1)).sum(-1)  # (rows, seq)
        mask = attention_mask.float() if attention_mask is not None else torch.ones_like(per_token)
        return (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1), math.log(logits.shape[-1])


def _align_word_labels(word_ids: list[int | None], word_labels: list[int]) -> list[int]:
    """Label the first word piece of each word; -100 for special tokens and continuation pieces."""
    labels, previous = [], None
    for w in word_ids:
        labels.append(word_labels[w] if w is not None and w != previous else IGNORE_INDEX)
        previous = w
    return labels


for _type in (SingleLabelClassification, MultiLabelClassification, Regression, MultipleChoice, SpanClassification,
              TokenClassification):
    register_problem_type(_type(), default=_type is SingleLabelClassification)

#: the type of a `TaskSpec` that names none
DEFAULT_PROBLEM_TYPE: Any = SingleLabelClassification.name
