"""How a training batch is made and checked on the host, where it is made: `MultiTaskCollator` pads a batch that
may mix tasks; `BatchChecker` checks its task ids, token ids, labels and spans against the model before it moves to a
device, and `HostCheckedCollator` (a collator followed by a checker, what `MultiTaskTrainer` uses) marks a checked
batch `values_checked=True` so that the model's forward reads nothing back from the device."""

from __future__ import annotations

import inspect
import math

import torch

from ..input_checks import check_batch_dim, check_token_ids, resolve_task_ids, token_table_sizes
from ..layers.heads import MultiTaskHeads
from ..layers.task_head import IGNORE_INDEX
from ..tasks import TaskSpec


class MultiTaskCollator:
    """Pads a batch that may mix tasks; a multiple-choice example becomes one row per choice (consecutive).

    Labels: a 1-D tensor when every row has one label, else a 2-D one padded with -100; float when any
    label is a float (regression) or `float_labels` (a mixture holding a task with real-valued labels: then every
    batch's labels are float, whatever its mix, so that a compiled step sees one dtype), long otherwise.
    `label_width` (the mixture's widest label, `mixture_label_width(tasks)`: a multi-label task's `num_labels`):
    every batch's labels are 2-D and at least that wide, padded with -100, also a batch without a row of the wide
    task, so that their shape does not follow the batch's mix either; each head reads its own columns.
    """

    model_keys = ("input_ids", "attention_mask", "token_type_ids")

    def __init__(self, pad_token_id: int = 0, pad_to_multiple_of: int | None = None, float_labels: bool = False,
                 label_width: int | None = None):
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.float_labels = float_labels
        self.label_width = label_width

    def _rows(self, features: list[dict]) -> list[dict]:
        rows = []
        for f in features:
            ids = f["input_ids"]
            if ids and isinstance(ids[0], (list, tuple)):  # multiple choice: one row per choice
                for c in range(len(ids)):
                    rows.append({**f, **{k: f[k][c] for k in self.model_keys if k in f}})
            else:
                rows.append(f)
        return rows

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        rows = self._rows(features)
        n = len(rows)
        length = max(len(r["input_ids"]) for r in rows)
        if self.pad_to_multiple_of:
            length = math.ceil(length / self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids = torch.full((n, length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((n, length), dtype=torch.long)
        has_types = "token_type_ids" in rows[0]
        token_type_ids = torch.zeros((n, length), dtype=torch.long) if has_types else None
        for i, r in enumerate(rows):
            k = len(r["input_ids"])
            input_ids[i, :k] = torch.tensor(r["input_ids"])
            attention_mask[i, :k] = torch.tensor(r["attention_mask"]) if "attention_mask" in r else 1
            if has_types:
                token_type_ids[i, :k] = torch.tensor(r["token_type_ids"])
        batch = {"input_ids": input_ids, "attention_mask": attention_mask}
        if has_types:
            batch["token_type_ids"] = token_type_ids
        batch["task_ids"] = torch.tensor([int(r["task_ids"]) for r in rows], dtype=torch.long)
        if "labels" in rows[0]:
            batch["labels"] = self._labels([r["labels"] for r in rows], self.float_labels, self.label_width)
        if any("span_positions" in r for r in rows):
            num_spans = max(len(r.get("span_positions") or []) for r in rows)
            spans = torch.zeros((n, num_spans, 2), dtype=torch.long)
            for i, r in enumerate(rows):
                if r.get("span_positions"):
                    spans[i, : len(r["span_positions"])] = torch.tensor(r["span_positions"])
            batch["span_positions"] = spans
        return batch

    @staticmethod
    def _labels(labels: list, float_labels: bool = False, label_width: int | None = None) -> torch.Tensor:
        is_float = float_labels or any(
            isinstance(v, float) or (isinstance(v, list) and any(isinstance(x, float) for x in v)) for v in labels
        )
        dtype = torch.float32 if is_float else torch.long
        if not label_width and not any(isinstance(v, (list, tuple)) for v in labels):
            return torch.tensor(labels, dtype=dtype)
        # (batch, width): the widest row, at least the mixture's widest label (one shape for every mix)
        width = max([label_width or 1] + [len(v) if isinstance(v, (list, tuple)) else 1 for v in labels])
        out = torch.full((len(labels), width), IGNORE_INDEX, dtype=dtype)
        for i, v in enumerate(labels):
            values = v if isinstance(v, (list, tuple)) else [v]
            out[i, : len(values)] = torch.tensor(values, dtype=dtype)
        return out


class BatchChecker:
    """Checks a collated batch on the host, before it moves to a device: the task ids and, for models with
    per-task heads, labels, spans and multiple-choice grouping -- the value checks `forward` skips for a batch
    marked `values_checked=True` (each would be a host sync there). Raises the `ValueError` `forward` would.
    Returns whether it checked every value the forward would (then `HostCheckedCollator` marks the batch).

    It holds the task specs and heads of hidden size 1 (their checks, not the model's weights), so a collator that
    calls it stays small when a `DataLoader` sends it to worker processes."""

    def __init__(self, tasks: list[TaskSpec], with_heads: bool, vocab_size: int | None = None,
                 type_vocab_size: int | None = None, marks_batches: bool = True, counts_tasks: bool | None = None,
                 position_table_size: int | None = None):
        #: whether `HostCheckedCollator` marks a checked batch `values_checked=True` (the model's forward takes it)
        self.marks_batches = marks_batches
        #: whether a marked batch also carries `task_counts`, its rows per task counted here, which an encoder
        #: family's forward splits the batch among its heads by instead of reading them back from the device.
        #: Not for a batch that is split again after the collator (`nn.DataParallel` scatters its rows over devices
        #: and copies the counts): `MultiTaskTrainer` turns it off there
        self.counts_tasks = with_heads and marks_batches if counts_tasks is None else counts_tasks
        self.task_names = [t.name for t in tasks]
        self.heads = MultiTaskHeads(tasks, hidden_size=1, dropout=0.0) if with_heads else None
        self.vocab_size = vocab_size
        self.type_vocab_size = type_vocab_size
        #: rows of the model's absolute position table (None: no such table, e.g. rotary positions)
        self.position_table_size = position_table_size

    @classmethod
    def for_model(cls, model, counts_tasks: bool = True) -> BatchChecker:
        """The checks of `model`'s forward; `counts_tasks=False`: marked batches carry no `task_counts`."""
        sizes = token_table_sizes(model)
        return cls(
            [TaskSpec.from_dict(t) for t in model.config.tasks],
            isinstance(getattr(model, "heads", None), MultiTaskHeads),
            vocab_size=sizes["input_ids"],
            type_vocab_size=sizes["token_type_ids"],
            position_table_size=sizes["position_ids"],
            marks_batches=_forward_takes(model, "values_checked"),
            counts_tasks=counts_tasks and _forward_takes(model, "task_counts"),
        )

    def __call__(self, batch) -> bool:
        return self.check(batch) is not None

    def check(self, batch) -> dict | None:
        """Check `batch`; return the keywords its forward can then take (`{"values_checked": True}`, and
        `"task_counts"`, the rows of each task as a tuple of ints, when `counts_tasks`), or None when the forward must
        check some values itself. `HostCheckedCollator` adds them to the batch (when `marks_batches`)."""
        first = batch.get("input_ids")
        if first is None:
            first = batch.get("inputs_embeds")
        if first is None or first.dim() < 2:
            return None  # nothing to size the batch by (a tabular batch): `forward` checks it
        rows, seq = first.shape[0], first.shape[1]
        check_token_ids({"input_ids": self.vocab_size, "token_type_ids": self.type_vocab_size,
                         "position_ids": self.position_table_size},
                        input_ids=batch.get("input_ids"), token_type_ids=batch.get("token_type_ids"),
                        position_ids=batch.get("position_ids"))
        task_ids = resolve_task_ids(batch.get("task_ids"), rows, self.task_names, first.device)
        marks = {"values_checked": True}
        if self.heads is not None:
            labels, spans = batch.get("labels"), batch.get("span_positions")
            check_batch_dim(rows, labels=labels, span_positions=spans)
            counts = torch.bincount(task_ids, minlength=len(self.task_names)).tolist()  # on the host: no sync
            self.heads.check_inputs(self.heads.split_rows(task_ids, counts), seq, labels, spans)
            if self.counts_tasks:
                marks["task_counts"] = tuple(counts)
        elif batch.get("labels") is not None:
            return None  # labels of a model without per-task heads (seq2seq targets): `forward` checks them
        return marks


def _forward_takes(model, name: str) -> bool:
    """Whether the model's forward (under a peft wrapper: its base model's) takes the keyword `name`
    (`values_checked`, `task_counts`): a family registered by a user may not."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return name in inspect.signature(base.forward).parameters


class HostCheckedCollator:
    """A collator followed by a `BatchChecker`: every batch is checked on the CPU where it is made. Other attributes
    read and write through to the wrapped collator (`trainer.data_collator.pad_to_multiple_of = 8` works)."""

    _OWN = ("collator", "checker")

    def __init__(self, collator, checker: BatchChecker):
        object.__setattr__(self, "collator", collator)
        object.__setattr__(self, "checker", checker)

    def __getattr__(self, name):
        try:
            collator = self.__dict__["collator"]
        except KeyError:  # while unpickling
            raise AttributeError(name) from None
        return getattr(collator, name)

    def __setattr__(self, name, value):
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.collator, name, value)

    def __call__(self, features):
        batch = self.collator(features)
        marks = self.checker.check(batch)
        if marks is not None and self.checker.marks_batches:
            batch.update(marks)  # `values_checked` (and `task_counts`): the forward then reads nothing back
        return batch
