"""`MultiTaskHeads`: one `nn.ModuleDict` of heads keyed by task name, each the head of its task's problem type
(`hf_taskmoe.problem_types`; their base class `TaskHead` is in `task_head.py`).

A batch may mix tasks. `MultiTaskHeads` splits the rows by task with one stable `argsort` of
`task_ids` (rows keep their order inside a task), runs each task's head on its rows only, and returns
per-task logits and losses plus the total loss (the heads of single-label tasks of one width as one product: the same
numbers in a fraction of the operations). That split needs the per-task row counts on the host: counted where the
batch was made (`task_counts`, `BatchChecker.check`), or else read back from the device. A captured forward of a
batch checked on the host (`values_checked=True`: torch.export, ONNX, compile) instead runs every head on every row
and takes each row's loss and logits from its own task's head (`forward_every_row`): no shape that depends on the
task mix, which a program taking batches of any mix needs. Heads of tasks absent from such a batch then get zero
gradients (as under DDP's static graph), so an optimizer with momentum or weight decay moves them too.

Label format per row (the collator pads a mixed batch's labels to one 2-D tensor with -100):

- single-label / span classification: class index (int, or a float holding an integer), -100 = ignore;
- multiple choice: every row is one (context, choice) pair; the `num_choices` rows of an example are
  consecutive among the task's rows and all carry the index of the right choice;
- regression: float (`num_labels` floats for a multi-output regression), dtype must be floating;
- multi-label: multi-hot row of `num_labels` 0/1 values;
- token classification: one class index per token, -100 for special tokens and padding.

A label shaped for another task is refused, never read in part: a one-hot row for a single-label task, three
targets for a one-output regression. Columns beyond a task's own are allowed only as the -100 padding of a
mixed batch with wider tasks (`TaskHead.label_width`), or of labels as wide as the mixture's widest task, which the
Trainer's collator gives every batch of a mixture with a multi-label task (one labels shape for a compiled step).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from .task_head import IGNORE_INDEX, TaskHead, bad_rows  # noqa: F401 (part of this module's API)

if TYPE_CHECKING:
    from ..tasks import TaskSpec


def build_head(task: TaskSpec, hidden_size: int, dropout: float, scale_loss_by_num_classes: bool = False) -> TaskHead:
    """The head of `task`'s problem type (`hf_taskmoe.problem_types`)."""
    from ..problem_types.registry import ENCODER, problem_type_names, problem_type_of

    kind = problem_type_of(task)
    if kind.head_class is None or ENCODER not in kind.capabilities:
        raise ValueError(
            f"`problem_type of task {task.name!r} (for an encoder head)` must be one of "
            f"{sorted(problem_type_names(ENCODER))}, got {task.problem_type!r}."
        )
    return kind.head_class(task, hidden_size, dropout, scale_loss_by_num_classes)


class PresentTasks:
    """`{task name: value}` over the tasks present in a batch, from values computed for every task by a forward that
    never read back which tasks are present (`MultiTaskHeads.forward_every_row`): the first access reads the per-task
    row counts (one host read, after the forward). With `rows=True` each value is a per-row tensor of the whole batch
    and a task's entry is its rows in batch order, what the split forward gives; otherwise a value is the task's own
    (a loss). `present()` and `stacked()` give the same without any host read.

    Read it like a dict (`[name]`, `get`, `keys`, `items`, `values`, `in`, `len`, iteration, `dict(...)`). It is no
    `Mapping` subclass on purpose: tools that rebuild every mapping of a model's output (accelerate's fp32 conversion
    under mixed precision) leave it as it is instead of reading it back at each step."""

    def __init__(self, names: list[str], task_ids: torch.Tensor, values: list[torch.Tensor], rows: bool):
        self.names = list(names)
        self.task_ids = task_ids
        self.values = values
        self.rows = rows
        self._present: list[str] | None = None
        self._selected: dict[str, torch.Tensor] = {}

    def present(self) -> torch.Tensor:
        """`(tasks,)` bool: whether each task has rows in the batch (on the device)."""
        counts = torch.zeros(len(self.names), dtype=torch.long, device=self.task_ids.device)
        return counts.scatter_add_(0, self.task_ids, torch.ones_like(self.task_ids)) > 0

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(values (tasks,), present (tasks,))` of one scalar per task (losses), in `names` order."""
        return torch.stack(self.values), self.present()

    def _names_present(self) -> list[str]:
        if self._present is None:
            self._present = [n for n, p in zip(self.names, self.present().tolist()) if p]  # the one host read
        return self._present

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names_present():
            raise KeyError(name)
        if name not in self._selected:
            task = self.names.index(name)
            value = self.values[task]
            self._selected[name] = value[self.task_ids == task] if self.rows else value
        return self._selected[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names_present())

    def __len__(self) -> int:
        return len(self._names_present())

    def __contains__(self, name) -> bool:
        return name in self._names_present()

    def keys(self) -> list[str]:
        return list(self._names_present())

    def values(self) -> list[torch.Tensor]:
        return [self[name] for name in self._names_present()]

    def items(self) -> list[tuple[str, torch.Tensor]]:
        return [(name, self[name]) for name in self._names_present()]

    def get(self, name: str, default=None):
        return self[name] if name in self else default

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict(self)!r})"


@dataclass
class HeadsOutput:
    """What `MultiTaskHeads` returns. `task_rows[name]` holds the batch rows of each task present (split forward
    only; `forward_every_row` gives `PresentTasks` as `task_logits` and `task_losses`)."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    task_logits: dict[str, torch.Tensor] | PresentTasks = field(default_factory=dict)
    task_losses: dict[str, torch.Tensor] | PresentTasks = field(default_factory=dict)
    task_rows: dict[str, torch.Tensor] = field(default_factory=dict)


class TaskRows(dict):
    """`{task id: the rows of that task}` (`MultiTaskHeads.split_rows`: the rows in batch order, each a view of one
    sort of the batch's task ids), with the sorted task ids, `(batch,)`, in `sorted_task_ids` (row `i` of the
    concatenated rows belongs to task `sorted_task_ids[i]`)."""

    def __init__(self, rows: dict, sorted_task_ids: torch.Tensor | None = None):
        super().__init__(rows)
        self.sorted_task_ids = sorted_task_ids
        self.stacked_heads = False  # `MultiTaskHeads._stacked_heads`, once worked out (False: not yet)


class MultiTaskHeads(nn.ModuleDict):
    """One head per task, keyed by task name (`heads["sst2"]`); task id `i` is the i-th task of the list.

    `runs_every_task` (default False): the split forward calls every task's head, in task order, on its rows of the
    batch -- none for a task the batch lacks --, and never stacks heads; an absent task's head then takes part in the
    graph with a zero gradient (as under DDP's static graph) and the loss and logits are unchanged. What DeepSpeed
    needs: ZeRO-3 gathers a module's shards when the module is called, on the ranks that call it, and ZeRO-2 and 3
    pack gradients into buckets in the order they arrive, so every rank must call the same modules in the same order
    whatever its batch's task mix (`hf_taskmoe.training.sharding.run_every_task` sets it)."""

    runs_every_task = False

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

    def split_rows(self, task_ids: torch.Tensor, counts: list[int] | None = None) -> dict[int, torch.Tensor]:
        """Batch rows of each task present, in batch order: one stable sort, and the per-task row counts (each head
        runs on its own rows): `counts` when the host counted them where the batch was made (`task_counts`, checked
        by `check_task_counts`), else read back from the device (one host sync)."""
        sorted_ids, order = torch.sort(task_ids, stable=True)  # argsort's one operation, the sorted ids kept too
        if counts is None:
            counts = torch.bincount(task_ids, minlength=len(self.tasks)).tolist()
        return TaskRows({t: rows for t, rows in enumerate(order.split(list(counts))) if counts[t]}, sorted_ids)

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
        if not check_values and labels is not None and self._stackable(task_rows, None):
            return self._stacked_labels(task_rows, seq_len, labels, span_positions)
        prepared = {}
        widths = [self[self.tasks[t].name].label_width() for t in task_rows]
        for t, rows in task_rows.items():
            head = self[self.tasks[t].name]
            head.check_rows(rows, seq_len, span_positions, check_values)
            if labels is not None:
                # padded: another task of the batch takes wider labels (token tags: any width), or the labels are
                # as wide as the mixture's widest (the collator's `label_width`, also for a batch without a row of
                # that task), so -100 columns beyond this task's may be the collator's padding; otherwise a wider
                # label is refused by its shape
                own = head.label_width()
                padded = own is not None and (any(w is None or w > own for w in widths)
                                              or self._mixture_padded(labels, own))
                prepared[t] = head.prepare_labels(labels.index_select(0, rows), rows, seq_len, padded=padded,
                                                  check_values=check_values)
        return prepared

    def _mixture_label_width(self) -> int | None:
        """The width of the mixture's collated labels (`problem_types.base.mixture_label_width`, from the heads): the
        widest task's when every task's is fixed and one is wider than 1, else None."""
        widths = [self[task.name].label_width() for task in self.tasks]
        if not widths or any(w is None for w in widths) or max(widths) <= 1:
            return None
        return max(widths)

    def _mixture_padded(self, labels: torch.Tensor, own: int | None) -> bool:
        """Whether `labels` have the shape the collator gives every batch of the mixture (`_mixture_label_width`
        columns), wider than a task's `own`: then columns beyond its own are the collator's -100 padding (a value
        check)."""
        width = self._mixture_label_width()
        return own is not None and width is not None and width > own and labels.dim() == 2 and labels.shape[1] == width

    def forward(
        self,
        sequence_output: torch.Tensor,
        pooled_output: torch.Tensor,
        task_rows: dict[int, torch.Tensor],
        prepared_labels: dict[int, torch.Tensor] | None = None,
        span_positions: torch.Tensor | None = None,
    ) -> HeadsOutput:
        """Run each task's head on its rows. `task_rows` and `prepared_labels` come from `split_rows`/`check_inputs`.

        A mixed batch of single-label tasks of one width runs their heads as one product (`_forward_stacked`): the
        same logits and losses with a fraction of the operations. With `runs_every_task` every head runs, an absent
        task's on no row (see the class)."""
        if not self.runs_every_task and self._stackable(task_rows, prepared_labels):
            return self._forward_stacked(pooled_output, task_rows, prepared_labels)
        out = HeadsOutput()
        weighted, examples, idle = [], [], []
        for t, rows in self._rows_of_heads_to_run(task_rows, pooled_output.device):
            task = self.tasks[t]
            head = self[task.name]
            spans = span_positions.index_select(0, rows) if span_positions is not None else None
            if spans is None and t not in task_rows and head.reads_spans:  # a batch without span tasks has none
                spans = rows.new_zeros((0, getattr(head, "num_spans", 1), 2))
            logits = head(
                # (rows, seq, hidden); a head on the pooled representation ignores it: no copy of the rows
                sequence_output.index_select(0, rows) if _own_flag(head, "reads_sequence", True) else sequence_output,
                pooled_output.index_select(0, rows),  # (rows, hidden)
                spans,
            )
            if t not in task_rows:  # an absent task's head, on no row: on the loss's graph as an exact 0
                idle.append(logits.sum())
                continue
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
            for zero in idle:  # the sum of no logits: 0, and a zero gradient for the idle head's parameters
                out.loss = out.loss + zero
        out.logits = self._batch_logits(out, sequence_output.shape[0])
        return out

    def _rows_of_heads_to_run(self, task_rows: dict[int, torch.Tensor], device) -> list[tuple[int, torch.Tensor]]:
        """`(task id, rows)` of each head the split forward runs: the tasks present, or with `runs_every_task` every
        task in task order, an absent one with no row."""
        if not self.runs_every_task:
            return list(task_rows.items())
        none = torch.zeros(0, dtype=torch.long, device=device)
        return [(t, task_rows.get(t, none)) for t in range(len(self.tasks))]

    # -- the heads of a mixed batch as one product ---------------------------------------------------------------
    def _stackable(self, task_rows: dict[int, torch.Tensor], prepared_labels) -> bool:
        """Whether `_forward_stacked` serves the batch: two tasks or more present, each with a head that stacks
        (`TaskHead.stacks`, set by its own class), all of one width, one dropout and one loss weight, labelled alike."""
        if prepared_labels is not None and set(prepared_labels) != set(task_rows):
            return False
        return self._stacked_heads(task_rows) is not None

    def _stacked_heads(self, task_rows: dict[int, torch.Tensor]) -> list[TaskHead] | None:
        """The heads of the tasks present (in `task_rows`' order) when they stack (`_stackable`), else None; worked
        out once per forward when `task_rows` is `split_rows`' (`check_inputs` and `forward` both ask)."""
        cached = getattr(task_rows, "stacked_heads", False)
        if cached is not False:
            return cached
        heads = None
        if len(task_rows) >= 2:
            heads = [self[self.tasks[t].name] for t in task_rows]
            stack = (
                all(_own_flag(head, "stacks", False) for head in heads)
                and len({head.num_labels for head in heads}) == 1
                and len({head.dropout.p for head in heads}) == 1
                and len({self.tasks[t].loss_weight for t in task_rows}) == 1
            )
            heads = heads if stack else None
        if isinstance(task_rows, TaskRows):
            task_rows.stacked_heads = heads
        return heads

    def _stacked_labels(self, task_rows, seq_len: int, labels: torch.Tensor, span_positions) -> dict[int, torch.Tensor]:
        """`check_inputs` without value checks for heads that stack: one head of their class prepares every row's
        label at once (the same shape and dtype checks), split back per task (views of one tensor)."""
        order = _joined(list(task_rows.values()))
        for t, rows in task_rows.items():
            self[self.tasks[t].name].check_rows(rows, seq_len, span_positions, check_values=False)
        head = self[self.tasks[next(iter(task_rows))].name]
        prepared = head.prepare_labels(labels.index_select(0, order), order, seq_len,
                                       padded=self._mixture_padded(labels, head.label_width()), check_values=False)
        return dict(zip(task_rows, prepared.split([len(rows) for rows in task_rows.values()])))

    def _forward_stacked(
        self, pooled_output: torch.Tensor, task_rows: dict[int, torch.Tensor], prepared_labels
    ) -> HeadsOutput:
        """`forward` for heads that stack (`_stackable`): the rows grouped by task (`order`), one dropout, one product
        with the present tasks' classifiers side by side, each row's own task's logits gathered, one cross-entropy,
        per-task sums on the device. The tasks absent from the batch take no part (their heads get no gradient), and
        nothing is read back beyond the split's row counts (none when the host counted them)."""
        present = list(task_rows)  # task ids, ascending
        heads = self._stacked_heads(task_rows)
        width = heads[0].num_labels
        order = _joined([task_rows[t] for t in present])  # (batch,) rows grouped by task, batch order inside
        counts = [len(task_rows[t]) for t in present]
        x = heads[0].dropout(pooled_output.index_select(0, order))  # (batch, hidden)
        weight = torch.cat([head.classifier.weight for head in heads])  # (present * width, hidden)
        bias = torch.cat([head.classifier.bias for head in heads])
        logits = F.linear(x, weight, bias).view(x.shape[0], len(present), width)  # every present head, every row
        # each row's task as its position among the present tasks: the sorted task ids themselves when the tasks
        # present are the first ones (every task, in a batch that mixes them all), else filled on the device (no host
        # data to copy)
        position = getattr(task_rows, "sorted_task_ids", None)
        if position is None or present[-1] != len(present) - 1:
            position = torch.cat([torch.full_like(task_rows[t], k) for k, t in enumerate(present)])  # (batch,)
        own = logits.gather(1, position.view(-1, 1, 1).expand(-1, 1, width)).squeeze(1)  # (batch, width)
        out = HeadsOutput()
        for t, head, task_logits in zip(present, heads, own.split(counts)):
            out.task_logits[head.task_name] = task_logits
            out.task_rows[head.task_name] = task_rows[t]
        out.logits = own.new_empty(own.shape).index_copy(0, order, own)  # batch order
        if prepared_labels is None:
            return out
        labels = _joined([prepared_labels[t] for t in present])  # (batch,) in `order`
        per_row = F.cross_entropy(own.float(), labels, ignore_index=IGNORE_INDEX, reduction="none")  # (batch,)
        # each row's loss beside whether it is labelled (the bool promoted to the loss's dtype by the stack): one sum
        # per task and one over the batch serve both
        rows = torch.stack((per_row, labels != IGNORE_INDEX), 1)  # (batch, 2)
        # each task's mean (0 for a task whose labels are all ignored); `TaskHead._cross_entropy`'s scaling
        scale = 1 / math.log(width) if self.scale_loss_by_num_classes else 1.0
        per_task = rows.new_zeros(len(present), 2).index_add(0, position, rows)  # (present, 2) loss, labelled rows
        losses = per_task[:, 0] / per_task[:, 1].clamp(min=1)
        out.task_losses = dict(zip((head.task_name for head in heads), (losses * scale if scale != 1 else losses)
                                   .unbind()))
        # the split forward's sum over tasks of loss_weight * task mean * labelled rows, over the labelled rows: with
        # one weight and one scale, the sum of the rows' losses (the per-task means are outputs, off the loss's graph)
        factor = scale * self.tasks[present[0]].loss_weight  # one loss weight for every task present (`_stackable`)
        total, examples = per_row.sum(), per_task.detach()[:, 1].sum()  # the count a constant of the loss
        out.loss = (total if factor == 1 else total * factor) / examples.clamp(min=1)
        return out

    # -- every head on every row: the sync-free forward and exported programs -----------------------------------
    def every_row_ready(self) -> bool:
        """Whether every head can run on every row (`TaskHead.every_row`), so `forward_every_row` serves the model."""
        return all(head.every_row for head in self.values())

    def logit_widths(self) -> list[int]:
        """The last dimension of each task's logits (task id order): what a row of the padded logits of
        `forward_every_row(padded=True)` (an exported program's output) holds before its zeros."""
        return [self[t.name].logit_shape()[-1] for t in self.tasks]

    def check_exportable(self) -> None:
        """Refuse, naming the tasks, heads an exported program cannot serve: heads that need the batch split by
        task (multiple choice, extractive QA), that read `span_positions` (not a program input), or logits of
        another rank than the others' (a token head beside sequence heads)."""
        split = [t.name for t in self.tasks if not self[t.name].every_row]
        spans = [t.name for t in self.tasks if self[t.name].reads_spans]
        ranks = {len(self[t.name].logit_shape()) for t in self.tasks}
        if split or spans or len(ranks) > 1:
            raise ValueError(
                f"Only tasks whose heads run on every row with logits of one rank can be exported (single-label, "
                f"multi-label, regression; or only token classification); tasks needing the batch split "
                f"{split}, reading span positions {spans}, logit ranks {sorted(ranks)}."
            )

    def forward_every_row(
        self,
        sequence_output: torch.Tensor,
        pooled_output: torch.Tensor,
        task_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        span_positions: torch.Tensor | None = None,
        padded: bool = False,
    ) -> HeadsOutput:
        """Every head on every row; each row's logits and loss from its own task's head (`loss_on_rows`), with no host
        sync and no shape that depends on the batch's task mix (needs `every_row_ready()`).

        For a batch whose values, shapes and dtypes were checked on the host (`BatchChecker`): a head that cannot read
        the batch's labels (shaped or typed for other tasks only) or needs `span_positions` the batch lacks has no row
        in it and takes no part. The loss is the split forward's (the mean over labelled examples, each task weighted
        by its `loss_weight`); `task_logits` and `task_losses` are `PresentTasks` (the tasks present, read back on
        first access); `logits` holds each row's own task's logits when every task's have one shape, else None, or,
        `padded`, zero-padded to the widest task (`logit_widths`), what exported programs return.
        """
        batch = sequence_output.shape[0]
        seq_len = sequence_output.shape[1]
        all_logits, losses, weighted, examples = [], [], [], []
        for t, task in enumerate(self.tasks):
            head = self[task.name]
            if head.reads_spans and span_positions is None:  # no row of this task: its logits are never read
                shape = [batch] + [seq_len if n is None else n for n in head.logit_shape()]
                all_logits.append(sequence_output.new_zeros(shape))
                losses.append(sequence_output.new_zeros((), dtype=torch.float32))
                continue
            logits = head(sequence_output, pooled_output, span_positions)  # (batch, ...) every row
            all_logits.append(logits)
            prepared = self._labels_on_every_row(head, labels, seq_len) if labels is not None else None
            if prepared is None:
                losses.append(logits.new_zeros((), dtype=torch.float32))
                continue
            loss, n = head.loss_on_rows(logits, prepared, task_ids == t)
            losses.append(loss)
            weighted.append(loss * (task.loss_weight * n))
            examples.append(n)
        names = [t.name for t in self.tasks]
        out = HeadsOutput(task_logits=PresentTasks(names, task_ids, all_logits, rows=True))
        if weighted:  # as in `forward`: 0 on the graph for a batch whose labels are all ignored
            out.loss = torch.stack(weighted).sum() / torch.stack(examples).sum().clamp(min=1)
            out.task_losses = PresentTasks(names, task_ids, losses, rows=False)
        shapes = [self[t.name].logit_shape() for t in self.tasks]
        if padded or all(shape == shapes[0] for shape in shapes):
            out.logits = _own_task_rows(all_logits, task_ids)
        return out

    @staticmethod
    def _labels_on_every_row(head: TaskHead, labels: torch.Tensor, seq_len: int) -> torch.Tensor | None:
        """`head`'s prepared labels of every row (other tasks' rows hold whatever their task's labels are), or None
        when no row of its task can be in the batch: the head refuses the labels' shape or dtype (a check that reads
        no value; `BatchChecker` refused the batch on the host if a row of that task was there)."""
        rows = torch.arange(labels.shape[0], device=labels.device)  # named in messages only
        try:
            return head.prepare_labels(labels, rows, seq_len, padded=True, check_values=False)
        except ValueError:
            return None

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


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """`torch.cat(parts)` of 1-D tensors, without the copy when they are consecutive views that tile one tensor (the
    per-task rows of `split_rows`, the per-task labels of `_stacked_labels`): that tensor."""
    base = parts[0]._base
    if base is None or base.dim() != 1 or base.stride() != (1,) or torch.compiler.is_compiling():
        return torch.cat(parts)
    offset = base.storage_offset()
    for part in parts:
        if part._base is not base or part.dim() != 1 or part.stride() != (1,) or part.storage_offset() != offset:
            return torch.cat(parts)
        offset += part.numel()
    return base if offset == base.storage_offset() + base.numel() else torch.cat(parts)


def _own_flag(head: TaskHead, name: str, default: bool) -> bool:
    """A flag (`reads_sequence`, `stacks`) as the head's own class sets it: a subclass that changes `forward` or
    `loss` does not inherit its parent's promise."""
    return type(head).__dict__.get(name, default)


def _own_task_rows(per_task: list[torch.Tensor], task_ids: torch.Tensor) -> torch.Tensor:
    """Each row's logits from its own task: `per_task[t]` `(batch, ..., width_t)` are every task's logits on every
    row, zero-padded here to the widest task and gathered by `task_ids` -> `(batch, ..., max width)`."""
    width = max(logits.shape[-1] for logits in per_task)
    padded = [F.pad(logits, (0, width - logits.shape[-1])) for logits in per_task]
    stacked = torch.stack(padded, dim=1)  # (batch, tasks, ..., width)
    index = task_ids.view(-1, 1, *([1] * (stacked.dim() - 2))).expand(-1, 1, *stacked.shape[2:])  # (B, 1, ..., w)
    return stacked.gather(1, index).squeeze(1)  # (batch, ..., width)
