"""`TaskHead`: the base class of a task's head (each problem type in `hf_taskmoe.problem_types` defines its own),
with the label checks and losses the heads share."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

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
    #: whether the head may run on every row of a mixed batch, its loss taken on its task's rows (`loss_on_rows`):
    #: the forward of a batch checked on the host (no host sync) and exported programs need it; a head without it
    #: is served by splitting the batch by task
    every_row = False
    #: whether `forward` reads `span_positions`
    reads_spans = False
    #: whether `forward` reads `sequence_output` (a head on the pooled representation says False: the split forward
    #: then hands it the whole batch's, not a copy of its rows)
    reads_sequence = True
    #: the head is `classifier(dropout(pooled_output))` with the cross-entropy over class indices (`loss`): the split
    #: forward of a mixed batch runs such heads of one width as one product (`MultiTaskHeads._forward_stacked`)
    stacks = False

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
            raise ValueError(
                f"Labels of task {self.task_name!r} must be integer class indices, got dtype {values.dtype}."
            )
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

    def logit_shape(self) -> tuple[int | None, ...]:
        """The shape of one row's logits (`None`: the sequence length), for a head with `every_row`: `(num_labels,)`
        here; a head with logits per token says `(None, num_labels)`."""
        return (self.num_labels,)

    def loss_on_rows(
        self, logits: torch.Tensor, labels: torch.Tensor, member: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(loss, labelled examples)` of the rows where `member` `(batch,)` is True, from the head's logits and
        prepared labels on every row of the batch (`every_row`); the other rows' labels belong to other tasks, may
        hold anything and count for nothing. Here for integer labels: those rows' labels become -100, which `loss`
        and `labelled_examples` ignore; a head with float labels overrides it."""
        keep = member.view(-1, *([1] * (labels.dim() - 1)))  # (batch, 1, ...)
        labels = labels.masked_fill(~keep, IGNORE_INDEX)
        return self.loss(logits, labels), self.labelled_examples(labels)

    def _mean_on_rows(self, per_value: torch.Tensor, member: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean of `per_value` `(batch, k)` over the rows where `member` is True, and their number (every row of
        a float-label task is a labelled example): `where`, not a product, so another task's label stays out even
        where it makes the value infinite."""
        kept = torch.where(member.unsqueeze(-1), per_value, torch.zeros_like(per_value))
        rows = member.sum().float()
        return kept.sum() / (rows * per_value.shape[-1]).clamp(min=1), rows

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
