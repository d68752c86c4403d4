"""`MultiTaskHeads`: one `nn.ModuleDict` of heads keyed by task name, each the head of its task's problem type
(`hf_taskmoe.problem_types`; their base class `TaskHead` is in `task_head.py`).

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

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from .task_head import IGNORE_INDEX, TaskHead, bad_rows  # noqa: F401 (part of this module's API)

if TYPE_CHECKING:
    from ..tasks import TaskSpec


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

    def __init__(
        self, tasks: list[TaskSpec], hidden_size: int, dropout: float, scale_loss_by_num_classes: bool = False
    ):
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
