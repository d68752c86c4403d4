"""Pieces every multi-task family shares: the output dataclass, input checks, task bookkeeping.

The checks run at the top of `forward`, before any layer, so that a bad batch costs no compute and
fails with a message that names the argument (and the task, row or field) at fault.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput

from .layers.heads import HeadsOutput, MultiTaskHeads
from .tasks import TaskSpec


@dataclass
class MultiTaskModelOutput(ModelOutput):
    """Output of a multi-task model.

    Args:
        loss (`torch.FloatTensor` of shape `()`, returned when `labels` are given):
            Mean over the batch's examples of their task's loss (times the task's `loss_weight`), plus any
            router auxiliary losses whose coefficient is set.
        logits (`torch.FloatTensor`):
            Logits in batch order when the batch holds one task (shape set by the task's head: `(batch,
            num_labels)`, `(examples, num_choices)` for multiple choice, `(batch, seq, num_labels)` for token
            classification), or when every task present has per-row logits of one shape. Otherwise None: use
            `task_logits`.
        task_losses (`dict[str, torch.FloatTensor]`, returned when `labels` are given):
            Loss of each task present in the batch (mean over that task's rows).
        task_logits (`dict[str, torch.FloatTensor]`):
            Logits of each task present, for its rows in batch order (`task_ids == id`).
        task_ids (`torch.LongTensor` of shape `(batch,)`):
            The task of each row (filled in when the model has a single task and none were given).
        hidden_states (`tuple(torch.FloatTensor)`, returned when `output_hidden_states=True`):
            Embedding output and every layer's output, each `(batch, seq, hidden)`.
        attentions (`tuple(torch.FloatTensor)`, returned when `output_attentions=True`):
            Attention probabilities of every layer, each `(batch, heads, seq, seq)` (eager attention).
    """

    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    task_losses: dict[str, torch.FloatTensor] | None = None
    task_logits: dict[str, torch.FloatTensor] | None = None
    task_ids: torch.LongTensor | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    attentions: tuple[torch.FloatTensor, ...] | None = None


def resolve_task_ids(task_ids, batch_size: int, task_names: list[str], device) -> torch.LongTensor:
    """Check `task_ids` against the model's tasks; with a single task they may be omitted."""
    num_tasks = len(task_names)
    if task_ids is None:
        if num_tasks == 1:
            return torch.zeros(batch_size, dtype=torch.long, device=device)
        raise ValueError(
            f"`task_ids` is required: this model has {num_tasks} tasks {task_names}; pass a LongTensor of shape "
            f"(batch,) holding each row's index into that list. (Wrapped with peft? Leave the LoraConfig's "
            f"`task_type` unset: peft's task-specific wrappers, e.g. PeftModelForSeq2SeqLM, take `task_ids` for "
            f"themselves and do not pass it on.)"
        )
    if not isinstance(task_ids, torch.Tensor):
        task_ids = torch.as_tensor(task_ids, device=device)
    if task_ids.is_floating_point() or task_ids.dtype == torch.bool or task_ids.is_complex():
        raise ValueError(f"`task_ids` must be an integer tensor, got dtype {task_ids.dtype}.")
    if task_ids.dim() != 1 or task_ids.shape[0] != batch_size:
        raise ValueError(
            f"`task_ids` must have shape (batch,) = ({batch_size},) to match the inputs, got {tuple(task_ids.shape)}."
        )
    task_ids = task_ids.long()
    bad = (task_ids < 0) | (task_ids >= num_tasks)
    if bad.any():
        raise ValueError(
            f"Only {num_tasks} tasks available {task_names}: `task_ids` must be in [0, {num_tasks}); found task id = "
            f"{task_ids[bad][0].item()} (row {bad.nonzero()[0, 0].item()})."
        )
    return task_ids


def check_input_shapes(input_ids, inputs_embeds, **per_token: torch.Tensor | None) -> tuple[int, int]:
    """Check that exactly one of `input_ids`/`inputs_embeds` is given and every other per-token tensor matches
    its `(batch, seq)`; return `(batch, seq)`."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("Pass exactly one of `input_ids` or `inputs_embeds`.")
    if input_ids is not None:
        if input_ids.dim() != 2:
            raise ValueError(f"`input_ids` must have shape (batch, seq), got {tuple(input_ids.shape)}.")
        batch, seq = input_ids.shape
    else:
        if inputs_embeds.dim() != 3:
            raise ValueError(f"`inputs_embeds` must have shape (batch, seq, hidden), got {tuple(inputs_embeds.shape)}.")
        batch, seq = inputs_embeds.shape[:2]
    for name, tensor in per_token.items():
        if tensor is None:
            continue
        if name == "position_ids" and tensor.dim() == 2 and tensor.shape[0] == 1 and tensor.shape[1] == seq:
            continue  # broadcast over the batch
        if tensor.dim() != 2 or tuple(tensor.shape) != (batch, seq):
            raise ValueError(f"`{name}` must have shape (batch, seq) = ({batch}, {seq}), got {tuple(tensor.shape)}.")
    return batch, seq


def check_batch_dim(batch: int, **tensors: torch.Tensor | None) -> None:
    for name, tensor in tensors.items():
        if tensor is not None and (tensor.dim() == 0 or tensor.shape[0] != batch):
            raise ValueError(f"`{name}` must have {batch} rows (the batch size of the inputs), got shape {tuple(tensor.shape)}.")


class MultiTaskModelMixin:
    """Task bookkeeping for models that hold `self.heads: MultiTaskHeads` and `config.tasks`."""

    heads: MultiTaskHeads

    @property
    def task_names(self) -> list[str]:
        return self.config.task_names

    def task_id(self, name: str) -> int:
        """Index of task `name` (what `task_ids` holds)."""
        names = self.config.task_names
        if name not in names:
            raise ValueError(f"Unknown task {name!r}; this model's tasks are {names}.")
        return names.index(name)

    def task_ids_for(self, names: str | list[str], device=None) -> torch.LongTensor:
        """`task_ids` tensor for a task name (repeated by the caller) or a list of names, one per row."""
        names = [names] if isinstance(names, str) else list(names)
        return torch.tensor([self.task_id(n) for n in names], dtype=torch.long, device=device or self.device)

    def _prepare_task_batch(self, task_ids, batch: int, seq: int, labels, span_positions):
        """Validate task ids, labels and spans; return `(task_ids, task_rows, prepared_labels)`."""
        check_batch_dim(batch, labels=labels, span_positions=span_positions)
        task_ids = resolve_task_ids(task_ids, batch, self.config.task_names, self.device)
        task_rows = self.heads.split_rows(task_ids)
        prepared = self.heads.check_inputs(task_rows, seq, labels, span_positions)
        return task_ids, task_rows, prepared if labels is not None else None

    def _register_new_task(self, task: TaskSpec) -> int:
        """Add `task` to the config and give it a head initialised like the others; return its id."""
        task = TaskSpec.from_dict(task)
        if task.name in self.config.task_names:
            raise ValueError(f"Task {task.name!r} already exists; this model's tasks are {self.config.task_names}.")
        head = self.heads.add_task(task)
        head.to(self.device)
        head.train(self.training)  # a fresh module is in train mode; follow the model's mode
        head.apply(self._init_weights)
        self.config.tasks = [*self.config.tasks, task.to_dict()]
        return len(self.config.tasks) - 1


def heads_to_output_fields(heads_out: HeadsOutput) -> dict:
    return {
        "logits": heads_out.logits,
        "task_logits": heads_out.task_logits,
        "task_losses": heads_out.task_losses or None,
    }
