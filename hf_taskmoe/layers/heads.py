"""Per-task heads, their losses, and `MultiTaskHeads`: one `nn.ModuleDict` of heads keyed by task name.

A batch may mix tasks. `MultiTaskHeads` splits the rows by task with one stable `argsort` of
`task_ids` (rows keep their order inside a task), runs each task's head on its rows only, and returns
per-task logits and losses plus the total loss.

Label format per row (the collator pads a mixed batch's labels to one 2-D tensor with -100):

- single-label / span classification: class index (int, or a float holding an integer), -100 = ignore;
- multiple choice: every row is one (context, choice) pair; the `num_choices` rows of an example are
  consecutive among the task's rows and all carry the index of the right choice;
- regression: float (`num_labels` floats for a multi-output regression), dtype must be floating;
- multi-label: multi-hot row of `num_labels` 0/1 values;
- token classification: one class index per token, -100 for special tokens and padding.

A label shaped for another task is refused, never read in part: a one-hot row for a single-label task, three
targets for a one-output regression. Columns beyond a task's own are allowed only as the -100 padding of a
mixed batch with wider tasks (`TaskHead.label_width`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from ..tasks import TaskSpec
from ..utils import checking_values, lookup

IGNORE_INDEX = -100


def _bad_rows(mask: torch.Tensor, rows: torch.Tensor, limit: int = 5) -> list[int]:
    """Batch row indices (not task-local ones) where `mask` is true, for error messages."""
    return rows[mask.nonzero(as_tuple=True)[0][:limit]].tolist()


class TaskHead(nn.Module):
    """Base class of a task head. `forward` maps the encoder outputs of the task's rows to logits."""

    #: whether logits line up with rows (False for multiple choice: one logit vector per group of rows)
    per_row = True

    def __init__(self, task: TaskSpec, hidden_size: int, dropout: float, scale_loss_by_num_classes: bool = False):
        super().__init__()
        self.task_name = task.name
        self.num_labels = task.num_labels
        self.scale_loss_by_num_classes = scale_loss_by_num_classes
        self.dropout = nn.Dropout(dropout)

    # -- labels ---------------------------------------------------------------------------------
    def prepare_labels(self, labels: torch.Tensor, rows: torch.Tensor, seq_len: int, padded: bool = True) -> torch.Tensor:
        """Select and check this task's labels; `labels` are the task's rows of the batch labels. `padded`: the
        batch holds tasks with wider labels, so columns beyond this task's are the collator's -100 padding
        (`MultiTaskHeads.check_inputs` knows; True, the lenient reading, when called alone).

        Raises `ValueError` naming the task and the batch rows at fault.
        """
        raise NotImplementedError

    def _class_indices(self, values: torch.Tensor, rows: torch.Tensor, num_classes: int) -> torch.Tensor:
        if values.is_floating_point():
            non_integral = values != values.round()
            if checking_values() and non_integral.any():
                raise ValueError(
                    f"Labels of task {self.task_name!r} must be class indices; rows {_bad_rows(non_integral.reshape(len(rows), -1).any(-1), rows)} "
                    "hold non-integer values."
                )
        elif values.dtype == torch.bool or values.is_complex():
            raise ValueError(f"Labels of task {self.task_name!r} must be integer class indices, got dtype {values.dtype}.")
        values = values.long()
        if not checking_values():
            return values
        bad = (values != IGNORE_INDEX) & ((values < 0) | (values >= num_classes))
        if bad.any():
            bad_rows = bad.reshape(len(rows), -1).any(-1)
            example = values[bad][0].item()
            raise ValueError(
                f"Labels of task {self.task_name!r} must be in [0, {num_classes}) or {IGNORE_INDEX}; "
                f"rows {_bad_rows(bad_rows, rows)} hold out-of-range values (e.g. {example})."
            )
        return values

    def label_width(self) -> int | None:
        """How many label values one row of the task takes (None: one per token, any width)."""
        return 1

    def _own_columns(self, labels: torch.Tensor, rows: torch.Tensor, width: int, padded: bool, what: str) -> torch.Tensor:
        """The first `width` columns of a task's labels `(rows,)` or `(rows, k)`, refusing labels shaped for
        another task: a one-hot row for a single-label task, three targets for a one-output regression.

        A mixed batch holds one label tensor padded with -100 to its widest task (`padded`): only then may a row
        carry columns beyond `width`, and those must be -100 -- a value check, made where values are checked
        (on the host by `BatchChecker` in training). Without wider tasks in the batch it is a shape check."""
        if labels.dim() == 1 and width == 1:
            return labels.unsqueeze(-1)  # (rows, 1)
        if labels.dim() != 2 or labels.shape[1] < width or (labels.shape[1] > width and not padded):
            wanted = "(batch,) or (batch, 1)" if width == 1 else f"(batch, {width})"
            hint = (" A one-hot or probability row is not a class index: pass `labels.argmax(-1)`."
                    if width == 1 and labels.dim() == 2 else "")
            raise ValueError(
                f"Labels of {what} task {self.task_name!r} must have shape {wanted}, got {tuple(labels.shape)}.{hint}"
            )
        if labels.shape[1] > width and checking_values():
            extra = labels[:, width:] != IGNORE_INDEX  # (rows, k - width): must be the collator's padding
            if extra.any():
                raise ValueError(
                    f"Labels of {what} task {self.task_name!r} take {width} value(s) per row, but rows "
                    f"{_bad_rows(extra.any(-1), rows)} hold more (columns {width}.. must be {IGNORE_INDEX}, the "
                    "padding of a mixed batch): labels shaped for another task, e.g. a one-hot row, are not guessed at."
                )
        return labels[:, :width]

    # -- loss -----------------------------------------------------------------------------------
    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        raise NotImplementedError

    def num_examples(self, num_rows: int) -> int:
        return num_rows

    def _cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor | None:
        """Mean cross-entropy over the labels not ignored; None when all are ignored. Inside `values_checked()` that
        test (a host sync) is skipped: a task whose labels are all ignored then gives a zero loss, not None."""
        if checking_values():
            if not (labels != IGNORE_INDEX).any():
                return None
            loss = F.cross_entropy(logits.float().reshape(-1, num_classes), labels.reshape(-1), ignore_index=IGNORE_INDEX)
        else:
            total = F.cross_entropy(logits.float().reshape(-1, num_classes), labels.reshape(-1),
                                    ignore_index=IGNORE_INDEX, reduction="sum")
            loss = total / (labels != IGNORE_INDEX).sum().clamp(min=1)
        if self.scale_loss_by_num_classes:
            # MT-TaG section 3.3: divide by log|C_t| so tasks with many classes do not dominate the sum.
            loss = loss / math.log(num_classes)
        return loss


class SequenceClassificationHead(TaskHead):
    """`P(c|x_t) = softmax(U_t h(x_t))` on the pooled [CLS] representation (MT-TaG eq. 7)."""

    def __init__(self, task, hidden_size, dropout, scale_loss_by_num_classes=False):
        super().__init__(task, hidden_size, dropout, scale_loss_by_num_classes)
        self.classifier = nn.Linear(hidden_size, task.num_labels)

    def forward(self, sequence_output, pooled_output, span_positions=None):
        return self.classifier(self.dropout(pooled_output))  # (rows, num_labels)

    def prepare_labels(self, labels, rows, seq_len, padded=True):
        values = self._own_columns(labels, rows, 1, padded, "single-label")[:, 0]  # (rows,)
        return self._class_indices(values, rows, self.num_labels)

    def loss(self, logits, labels):
        return self._cross_entropy(logits, labels, self.num_labels)


class MultiLabelClassificationHead(SequenceClassificationHead):
    """Independent sigmoid per label, binary cross-entropy."""

    def label_width(self):
        return self.num_labels

    def prepare_labels(self, labels, rows, seq_len, padded=True):
        if labels.dim() != 2 or labels.shape[1] < self.num_labels:
            raise ValueError(
                f"Labels of multi-label task {self.task_name!r} must be multi-hot rows of {self.num_labels} values, "
                f"got labels of shape {tuple(labels.shape)}."
            )
        values = self._own_columns(labels, rows, self.num_labels, padded, "multi-label")  # (rows, num_labels)
        bad = (values != 0) & (values != 1)
        if checking_values() and bad.any():
            raise ValueError(
                f"Labels of multi-label task {self.task_name!r} must be 0 or 1; rows {_bad_rows(bad.any(-1), rows)} "
                "hold other values."
            )
        return values.float()

    def loss(self, logits, labels):
        return F.binary_cross_entropy_with_logits(logits.float(), labels)


class RegressionHead(TaskHead):
    """`S(x_t) = V_t h(x_t)` (MT-TaG eq. 8), mean squared error."""

    def __init__(self, task, hidden_size, dropout, scale_loss_by_num_classes=False):
        super().__init__(task, hidden_size, dropout, scale_loss_by_num_classes)
        self.regressor = nn.Linear(hidden_size, task.num_labels)

    def forward(self, sequence_output, pooled_output, span_positions=None):
        return self.regressor(self.dropout(pooled_output))  # (rows, num_labels)

    def label_width(self):
        return self.num_labels

    def prepare_labels(self, labels, rows, seq_len, padded=True):
        if not labels.is_floating_point():
            raise ValueError(
                f"Labels of regression task {self.task_name!r} must be floating point, got dtype {labels.dtype} "
                "(cast them with `labels.float()`; class indices belong to a classification task)."
            )
        values = self._own_columns(labels, rows, self.num_labels, padded, "regression")  # (rows, num_labels)
        bad = ~torch.isfinite(values)
        if checking_values() and bad.any():
            raise ValueError(
                f"Labels of regression task {self.task_name!r} must be finite; rows {_bad_rows(bad.any(-1), rows)} are not."
            )
        return values.float()

    def loss(self, logits, labels):
        return F.mse_loss(logits.float(), labels)


class MultipleChoiceHead(TaskHead):
    """One score per (context, choice) row; cross-entropy over the `num_choices` rows of an example."""

    per_row = False

    def __init__(self, task, hidden_size, dropout, scale_loss_by_num_classes=False):
        super().__init__(task, hidden_size, dropout, scale_loss_by_num_classes)
        self.num_choices = task.num_choices
        self.scorer = nn.Linear(hidden_size, 1)

    def forward(self, sequence_output, pooled_output, span_positions=None):
        scores = self.scorer(self.dropout(pooled_output))  # (rows, 1)
        return scores.view(-1, self.num_choices)  # (examples, num_choices)

    def check_rows(self, rows: torch.Tensor) -> None:
        if len(rows) % self.num_choices:
            raise ValueError(
                f"Multiple-choice task {self.task_name!r} needs {self.num_choices} consecutive rows per example, "
                f"but the batch holds {len(rows)} rows of it."
            )

    def prepare_labels(self, labels, rows, seq_len, padded=True):
        values = self._own_columns(labels, rows, 1, padded, "multiple-choice")[:, 0]  # (rows,)
        values = self._class_indices(values, rows, self.num_choices)
        grouped = values.view(-1, self.num_choices)  # (examples, num_choices)
        differs = (grouped != grouped[:, :1]).any(-1)
        if checking_values() and differs.any():
            first = differs.nonzero()[0, 0].item() * self.num_choices
            raise ValueError(
                f"Multiple-choice task {self.task_name!r}: the {self.num_choices} rows of one example must carry the "
                f"same label (the index of the right choice); rows {rows[first:first + self.num_choices].tolist()} differ."
            )
        return grouped[:, 0]

    def num_examples(self, num_rows):
        return num_rows // self.num_choices

    def loss(self, logits, labels):
        return self._cross_entropy(logits, labels, self.num_choices)


class SpanClassificationHead(TaskHead):
    """WiC-style: [CLS] representation concatenated with the mean of each word span's tokens."""

    def __init__(self, task, hidden_size, dropout, scale_loss_by_num_classes=False):
        super().__init__(task, hidden_size, dropout, scale_loss_by_num_classes)
        self.num_spans = task.num_spans
        self.classifier = nn.Linear(hidden_size * (1 + self.num_spans), task.num_labels)

    def forward(self, sequence_output, pooled_output, span_positions=None):
        rows, seq_len, _ = sequence_output.shape
        positions = torch.arange(seq_len, device=sequence_output.device)
        start = span_positions[..., 0:1]  # (rows, spans, 1)
        end = span_positions[..., 1:2]
        in_span = (positions >= start) & (positions < end)  # (rows, spans, seq)
        weights = in_span.to(sequence_output.dtype) / in_span.sum(-1, keepdim=True).clamp(min=1)
        spans = torch.einsum("rns,rsd->rnd", weights, sequence_output)  # (rows, spans, hidden)
        features = torch.cat([pooled_output, spans.reshape(rows, -1)], dim=-1)  # (rows, (1+spans)*hidden)
        return self.classifier(self.dropout(features))  # (rows, num_labels)

    def check_spans(self, span_positions: torch.Tensor | None, rows: torch.Tensor, seq_len: int) -> None:
        if span_positions is None:
            raise ValueError(
                f"Span-classification task {self.task_name!r} needs `span_positions` (LongTensor (batch, "
                f"{self.num_spans}, 2): start and end token of each span, end exclusive)."
            )
        spans = span_positions.index_select(0, rows)
        bad = (spans[..., 0] < 0) | (spans[..., 1] <= spans[..., 0]) | (spans[..., 1] > seq_len)
        if checking_values() and bad.any():
            raise ValueError(
                f"`span_positions` of task {self.task_name!r} must satisfy 0 <= start < end <= {seq_len}; "
                f"rows {_bad_rows(bad.any(-1), rows)} do not."
            )

    def prepare_labels(self, labels, rows, seq_len, padded=True):
        values = self._own_columns(labels, rows, 1, padded, "span-classification")[:, 0]  # (rows,)
        return self._class_indices(values, rows, self.num_labels)

    def loss(self, logits, labels):
        return self._cross_entropy(logits, labels, self.num_labels)


class TokenClassificationHead(TaskHead):
    """A class per token; labels of -100 (special tokens, padding, non-first word pieces) are ignored."""

    def __init__(self, task, hidden_size, dropout, scale_loss_by_num_classes=False):
        super().__init__(task, hidden_size, dropout, scale_loss_by_num_classes)
        self.classifier = nn.Linear(hidden_size, task.num_labels)

    def forward(self, sequence_output, pooled_output, span_positions=None):
        return self.classifier(self.dropout(sequence_output))  # (rows, seq, num_labels)

    def label_width(self):
        return None

    def prepare_labels(self, labels, rows, seq_len, padded=True):
        if labels.dim() != 2:
            raise ValueError(
                f"Labels of token-classification task {self.task_name!r} must be 2-D (batch, seq), "
                f"got shape {tuple(labels.shape)}."
            )
        if labels.shape[1] < seq_len:
            labels = F.pad(labels, (0, seq_len - labels.shape[1]), value=IGNORE_INDEX)
        elif labels.shape[1] > seq_len:
            beyond = labels[:, seq_len:] != IGNORE_INDEX
            if checking_values() and beyond.any():
                raise ValueError(
                    f"Labels of token-classification task {self.task_name!r} are longer than the input "
                    f"({labels.shape[1]} > {seq_len} tokens) in rows {_bad_rows(beyond.any(-1), rows)}."
                )
            labels = labels[:, :seq_len]
        return self._class_indices(labels, rows, self.num_labels)

    def loss(self, logits, labels):
        return self._cross_entropy(logits, labels, self.num_labels)


HEAD_TYPES: dict[str, type[TaskHead]] = {
    "single_label_classification": SequenceClassificationHead,
    "multi_label_classification": MultiLabelClassificationHead,
    "regression": RegressionHead,
    "multiple_choice": MultipleChoiceHead,
    "span_classification": SpanClassificationHead,
    "token_classification": TokenClassificationHead,
}


def build_head(task: TaskSpec, hidden_size: int, dropout: float, scale_loss_by_num_classes: bool = False) -> TaskHead:
    """Build the head for `task.problem_type` from `HEAD_TYPES`."""
    head_cls = lookup(HEAD_TYPES, task.problem_type, f"problem_type of task {task.name!r} (for an encoder head)")
    return head_cls(task, hidden_size, dropout, scale_loss_by_num_classes)


@dataclass
class HeadsOutput:
    """What `MultiTaskHeads` returns. `task_rows[name]` holds the batch rows of each task present."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    task_logits: dict[str, torch.Tensor] = field(default_factory=dict)
    task_losses: dict[str, torch.Tensor] = field(default_factory=dict)
    task_rows: dict[str, torch.Tensor] = field(default_factory=dict)


class MultiTaskHeads(nn.ModuleDict):
    """One head per task, keyed by task name (`heads["sst2"]`); task id `i` is the i-th task of the list."""

    def __init__(self, tasks: list[TaskSpec], hidden_size: int, dropout: float, scale_loss_by_num_classes: bool = False):
        super().__init__({t.name: build_head(t, hidden_size, dropout, scale_loss_by_num_classes) for t in tasks})
        self.hidden_size = hidden_size
        self.dropout = dropout
        self.scale_loss_by_num_classes = scale_loss_by_num_classes
        self.tasks = list(tasks)

    def add_task(self, task: TaskSpec) -> TaskHead:
        if task.name in self:
            raise ValueError(f"Task {task.name!r} already has a head.")
        head = build_head(task, self.hidden_size, self.dropout, self.scale_loss_by_num_classes)
        self[task.name] = head
        self.tasks.append(task)
        return head

    def split_rows(self, task_ids: torch.Tensor) -> dict[int, torch.Tensor]:
        """Batch rows of each task present, in batch order: one stable sort and one host sync (the per-task row
        counts: each head runs on its own rows), the one sync of a checked forward."""
        order = torch.argsort(task_ids, stable=True)
        counts = torch.bincount(task_ids, minlength=len(self.tasks)).tolist()
        return {t: rows for t, rows in enumerate(order.split(counts)) if len(rows)}

    def check_inputs(
        self,
        task_rows: dict[int, torch.Tensor],
        seq_len: int,
        labels: torch.Tensor | None,
        span_positions: torch.Tensor | None,
    ) -> dict[int, torch.Tensor]:
        """Check row grouping, spans and labels of every task present; return each task's prepared labels.

        Runs before the encoder so that bad input costs no compute.
        """
        prepared = {}
        widths = [self[self.tasks[t].name].label_width() for t in task_rows]
        for t, rows in task_rows.items():
            head = self[self.tasks[t].name]
            if isinstance(head, MultipleChoiceHead):
                head.check_rows(rows)
            if isinstance(head, SpanClassificationHead):
                head.check_spans(span_positions, rows, seq_len)
            if labels is not None:
                # padded: another task of the batch takes wider labels (token tags: any width), so -100 columns
                # beyond this task's may be the collator's padding; otherwise a wider label is refused by its shape
                own = head.label_width()
                padded = own is not None and any(w is None or w > own for w in widths)
                prepared[t] = head.prepare_labels(labels.index_select(0, rows), rows, seq_len, padded=padded)
        return prepared

    def forward(
        self,
        sequence_output: torch.Tensor,
        pooled_output: torch.Tensor,
        task_rows: dict[int, torch.Tensor],
        prepared_labels: dict[int, torch.Tensor] | None = None,
        span_positions: torch.Tensor | None = None,
    ) -> HeadsOutput:
        """Run each task's head on its rows. `task_rows` and `prepared_labels` come from `split_rows`/`check_inputs`."""
        out = HeadsOutput()
        weighted, examples = [], 0
        for t, rows in task_rows.items():
            task = self.tasks[t]
            head = self[task.name]
            logits = head(
                sequence_output.index_select(0, rows),  # (rows, seq, hidden)
                pooled_output.index_select(0, rows),  # (rows, hidden)
                span_positions.index_select(0, rows) if span_positions is not None else None,
            )
            out.task_logits[task.name] = logits
            out.task_rows[task.name] = rows
            if prepared_labels is not None and t in prepared_labels:
                loss = head.loss(logits, prepared_labels[t])
                if loss is not None:
                    out.task_losses[task.name] = loss
                    n = head.num_examples(len(rows))
                    weighted.append(loss * (task.loss_weight * n))
                    examples += n
        if weighted:
            # Mean over examples of the batch (each task weighted by its rows), as a single-task batch would be.
            out.loss = torch.stack(weighted).sum() / examples
        elif prepared_labels is not None and out.task_logits:
            # labels were given but every one is ignored (-100): a zero loss on the graph, which the Trainer can add
            # and back-propagate (None would stop it), and which gives every head present a (zero) gradient
            out.loss = sum((logits.float() * 0.0).sum() for logits in out.task_logits.values())
        out.logits = self._batch_logits(out, sequence_output.shape[0])
        return out

    def _batch_logits(self, out: HeadsOutput, batch_size: int) -> torch.Tensor | None:
        """Logits in batch order: the task's own logits for a one-task batch; for a mixed batch, rows stacked
        when every task present gives per-row logits of one shape; otherwise None (use `task_logits`)."""
        if len(out.task_logits) == 1:
            return next(iter(out.task_logits.values()))
        names = list(out.task_logits)
        shapes = {out.task_logits[n].shape[1:] for n in names}
        if len(shapes) != 1 or not all(self[n].per_row for n in names):
            return None
        first = out.task_logits[names[0]]
        logits = first.new_empty((batch_size, *first.shape[1:]))
        for name in names:
            logits.index_copy_(0, out.task_rows[name], out.task_logits[name])
        return logits
