"""Which parameters a task owns (each family's `_task_specific_parameters`), and freezing the others (PALs'
second stage). Its own module: the trainer and the two-stage protocols both use it, and neither imports the other
for it."""

from __future__ import annotations

import re

from torch import nn

DEFAULT_TASK_SPECIFIC = (r"(^|\.)heads\.",)


def task_specific_patterns(model: nn.Module) -> tuple[str, ...]:
    base = getattr(model, "get_base_model", None)  # a peft model wraps ours
    target = base() if callable(base) else model
    return tuple(getattr(target, "_task_specific_parameters", DEFAULT_TASK_SPECIFIC))


def freeze_shared_parameters(model: nn.Module) -> dict[str, int]:
    """Set `requires_grad=False` on every parameter that no task owns; return counts of both kinds."""
    patterns = [re.compile(p) for p in task_specific_patterns(model)]
    counts = {"task_specific": 0, "frozen": 0}
    for name, param in model.named_parameters():
        if any(p.search(name) for p in patterns):
            param.requires_grad_(True)
            counts["task_specific"] += param.numel()
        else:
            param.requires_grad_(False)
            counts["frozen"] += param.numel()
    if counts["task_specific"] == 0:
        raise ValueError(f"No parameter matches the task-specific patterns {task_specific_patterns(model)}.")
    return counts
