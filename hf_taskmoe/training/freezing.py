"""Which parameters a task owns (the `task_specific` roles of each family's `parameter_roles`), and freezing the
others (PALs' second stage). Its own module: the trainer and the two-stage protocols both use it, and neither
imports the other for it."""

from __future__ import annotations

import re

from torch import nn

from ..contract import UNDECLARED, parameter_roles_of

#: what a task owns in a model that declares no roles: its heads, wherever they sit
DEFAULT_TASK_SPECIFIC = (r"(^|\.)heads\.",)


def task_specific_patterns(model: nn.Module) -> tuple[str, ...]:
    """Regexes of the parameters a task owns in `model` (through a peft or DDP wrapper)."""
    roles = parameter_roles_of(model)
    return DEFAULT_TASK_SPECIFIC if roles is UNDECLARED else roles.task_specific_patterns


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
