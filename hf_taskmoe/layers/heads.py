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

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..tasks import TaskSpec

IGNORE_INDEX = -100


def bad_rows(mask: torch.Tensor, rows: torch.Tensor, limit: int = 5) -> list[int]:
    """Batch row indices (not task-local ones) where `mask` is true, for error messages."""
    return rows[mask.nonzero(as_tuple=True)[0][:limit]].tolist()


class TaskHead(nn.Module):
    """Base class of a task head (each problem type in `hf_taskmoe.problem_types` has one). `forward` maps the
    encoder outputs of the task's rows to logits.

    `check_values` in the hooks below: whether to check label *values* (ranges, integrality, finiteness), each a
    read of the tensor's values. The model does it unless the batch says it was checked on the host where it was
    made (`values_checked=True`, set by `BatchChecker`); shapes and dtypes are always checked. The result is the
    same either way: the checks only refuse."""

    #: whether logits line up with rows (False for multiple choice: one logit vector per group of rows)
    per_row = True

    def __init__(self, task: TaskSpec, hidden_size: int, dropout: float, scale_loss_by_num_classes: bool = False):
        super().__init__()
        self.task_name = task.name
        self.num_labels = task.num_labels
        self.scale_loss_by_num_classes = scale_loss_by_num_classes
        self.dropout = nn.Dropout(dropout)

    # -- rows and labels ------------------------------------------------------------------------
    def check_rows(self, rows: torch.Tensor, seq_len: int, span_positions: torch.Tensor | None = None,
                   check_values: bool = True) -> None:
        """Check the task's rows of the batch beyond their labels (grouping, extra inputs); raises `ValueError`."""

    def prepare_labels(self, labels: torch.Tensor, rows: torch.Tensor, seq_len: int, padded: bool = True,
                       check_values: bool = True) -> torch.Tensor:
        """Select and check this task's labels; `labels` are the task's rows of the batch labels. `padded`: the
        batch holds tasks with wider labels, so columns beyond this task's are the collator's -100 padding
        (`MultiTaskHeads.check_inputs` knows; True, the lenient reading, when called alone).

        Raises `ValueError` naming the task and the batch rows at fault.
        """
        raise NotImplementedError

    def _class_indices(self, values: torch.Tensor, rows: torch.Tensor, num_classes: int,
                       check_values: bool = True) -> torch.Tensor:
        if values.dtype == torch.bool or values.is_complex():
            raise ValueError(f"Labels of task {self.task_name!r} must be integer class indices, got dtype {values.dtype}.")
        if not check_values:
            return values.long()
        if values.is_floating_point():
            non_integral = values != values.round()
            if non_integral.any():
                raise ValueError(
                    f"Labels of task {self.task_name!r} must be class indices; rows "
                    f"{bad_rows(non_integral.reshape(len(rows), -1).any(-1), rows)} hold non-integer values."
                )
        values = values.long()
        bad = (values != IGNORE_INDEX) & ((values < 0) | (values >= num_classes))
        if bad.any():
            example = values[bad][0].item()
            raise ValueError(
                f"Labels of task {self.task_name!r} must be in [0, {num_classes}) or {IGNORE_INDEX}; "
                f"rows {bad_rows(bad.reshape(len(rows), -1).any(-1), rows)} hold out-of-range values (e.g. {example})."
            )
        return values

    def label_width(self) -> int | None:
        """How many label values one row of the task takes (None: one per token, any width)."""
        return 1

    def _own_columns(self, labels: torch.Tensor, rows: torch.Tensor, width: int, padded: bool, what: str,
                     check_values: bool = True) -> torch.Tensor:
        """The first `width` columns of a task's labels `(rows,)` or `(rows, k)`, refusing labels shaped for
        another task: a one-hot row for a single-label task, three targets for a one-output regression.

        A mixed batch holds one label tensor padded with -100 to its widest task (`padded`): only then may a row
        carry columns beyond `width`, and those must be -100 -- a value check. Without wider tasks in the batch it
        is a shape check."""
        if labels.dim() == 1 and width == 1:
            return labels.unsqueeze(-1)  # (rows, 1)
        if labels.dim() != 2 or labels.shape[1] < width or (labels.shape[1] > width and not padded):
            wanted = "(batch,) or (batch, 1)" if width == 1 else f"(batch, {width})"
            hint = (" A one-hot or probability row is not a class index: pass `labels.argmax(-1)`."
                    if width == 1 and labels.dim() == 2 else "")
            raise ValueError(
                f"Labels of {what} task {self.task_name!r} must have shape {wanted}, got {tuple(labels.shape)}.{hint}"
            )
        if labels.shape[1] > width and check_values:
            extra = labels[:, width:] != IGNORE_INDEX  # (rows, k - width): must be the collator's padding
            if extra.any():
                raise ValueError(
                    f"Labels of {what} task {self.task_name!r} take {width} value(s) per row, but rows "
                    f"{bad_rows(extra.any(-1), rows)} hold more (columns {width}.. must be {IGNORE_INDEX}, the "
                    "padding of a mixed batch): labels shaped for another task, e.g. a one-hot row, are not guessed at."
                )
        return labels[:, :width]

    # -- loss -----------------------------------------------------------------------------------
    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def num_examples(self, num_rows: int) -> int:
        return num_rows

    def labelled_examples(self, labels: torch.Tensor) -> torch.Tensor:
        """How many of the task's examples carry a label (a tensor: counted on the device, never read back).
        `labels` are the prepared labels; an example whose labels are all -100 counts 0."""
        if labels.is_floating_point():  # regression, multi-label: every row is labelled
            return labels.new_tensor(labels.shape[0], dtype=torch.float32)
        kept = labels != IGNORE_INDEX
        return kept.reshape(labels.shape[0], -1).any(-1).sum().float()

    def _cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
        """Mean cross-entropy over the labels not ignored; 0 when all are ignored (no read of the labels' values:
        the sum over kept labels divided by their count, at least 1)."""
        total = F.cross_entropy(logits.float().reshape(-1, num_classes), labels.reshape(-1),
                                ignore_index=IGNORE_INDEX, reduction="sum")
        loss = total / (labels != IGNORE_INDEX).sum().clamp(min=1)
        if self.scale_loss_by_num_classes:
            # MT-TaG section 3.3: divide by log|C_t| so tasks with many classes do not dominate the sum.
            loss = loss / math.log(num_classes)
        return loss


def build_head(task: TaskSpec, hidden_size: int, dropout: float, scale_loss_by_num_classes: bool = False) -> TaskHead:
    """The head of `task`'s problem type (`hf_taskmoe.problem_types`)."""
    from ..problem_types import ENCODER, problem_type_names, problem_type_of

    kind = problem_type_of(task)
    if kind.head_class is None or ENCODER not in kind.capabilities:
        raise ValueError(
            f"`problem_type of task {task.name!r} (for an encoder head)` must be one of "
            f"{sorted(problem_type_names(ENCODER))}, got {task.problem_type!r}."
        )
    return kind.head_class(task, hidden_size, dropout, scale_loss_by_num_classes)


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
        check_values: bool = True,
    ) -> dict[int, torch.Tensor]:
        """Check each task's rows (grouping, extra inputs) and labels; return each task's prepared labels.
        `check_values`: also the label values (see `TaskHead`), which `BatchChecker` does on the host.

        Runs before the encoder so that bad input costs no compute.
        """
        prepared = {}
        widths = [self[self.tasks[t].name].label_width() for t in task_rows]
        for t, rows in task_rows.items():
            head = self[self.tasks[t].name]
            head.check_rows(rows, seq_len, span_positions, check_values)
            if labels is not None:
                # padded: another task of the batch takes wider labels (token tags: any width), so -100 columns
                # beyond this task's may be the collator's padding; otherwise a wider label is refused by its shape
                own = head.label_width()
                padded = own is not None and any(w is None or w > own for w in widths)
                prepared[t] = head.prepare_labels(labels.index_select(0, rows), rows, seq_len, padded=padded,
                                                  check_values=check_values)
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
        weighted, examples = [], []
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
                labels = prepared_labels[t]
                loss = head.loss(logits, labels)
                out.task_losses[task.name] = loss
                n = head.labelled_examples(labels)  # a tensor: an all-ignored task counts no example
                weighted.append(loss * (task.loss_weight * n))
                examples.append(n)
        if weighted:
            # Mean over the labelled examples of the batch (each task weighted by its examples), as a single-task
            # batch would be; a batch whose labels are all ignored gives 0 on the graph (every head present gets a
            # zero gradient), without reading back how many labels were kept
            out.loss = torch.stack(weighted).sum() / torch.stack(examples).sum().clamp(min=1)
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
