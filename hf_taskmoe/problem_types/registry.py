"""The registry of problem types: every registered type by name, the capabilities a family may require of one, and
the lookups. The lowest module of the package (it imports no type, no task): `TaskSpec` checks its problem type here,
and the types (`.base`, `.classification`, ...) register themselves here when the package is imported."""

from __future__ import annotations

from typing import Any

from ..utils import lookup

# A type is a `.base.ProblemType`, a spec a `hf_taskmoe.tasks.TaskSpec`; both modules stand above this one, so they
# are not imported here, not even for annotations (`Any` below).

#: capabilities a family may require of a task's problem type
ENCODER = "encoder"  # a head over an encoder's token states and pooled representation (`head_class`)
TABULAR = "tabular"  # a tower's output over one feature vector (MMoE): `num_outputs` logits per row
TEXT_TO_TEXT = "text_to_text"  # the target is a text a decoder generates

#: every registered problem type by name, in registration order
PROBLEM_TYPES: dict[str, Any] = {}
#: the name of the type a `TaskSpec` that names none has (`register_problem_type(..., default=True)`)
_DEFAULT: list[str] = []


def register_problem_type(problem_type: Any, exist_ok: bool = False, default: bool = False) -> Any:
    """Register an instance of a `ProblemType` subclass under its `name`; returns it. `default`: the type of a task
    that names none (`default_problem_type`)."""
    # an instance of a `ProblemType` subclass (`.base`, above this module: told by its hooks, not imported)
    if (isinstance(problem_type, type) or not callable(getattr(problem_type, "compute_metrics", None))
            or not isinstance(getattr(problem_type, "name", None), str) or not problem_type.name):
        raise ValueError(
            f"register_problem_type takes an instance of a ProblemType subclass with a `name`, got {problem_type!r}."
        )
    known = PROBLEM_TYPES.get(problem_type.name)
    if known is not None and not exist_ok and type(known) is not type(problem_type):
        raise ValueError(
            f"A problem type named {problem_type.name!r} is already registered; pass exist_ok=True to replace it."
        )
    PROBLEM_TYPES[problem_type.name] = problem_type
    if default:
        _DEFAULT[:] = [problem_type.name]
    return problem_type


def default_problem_type() -> str:
    """The name of the type of a `TaskSpec` that names none: single-label classification, registered as the default
    when the package is imported (`.classification`)."""
    if not _DEFAULT:
        raise RuntimeError("No problem type is registered as the default; import hf_taskmoe.problem_types first.")
    return _DEFAULT[0]


def get_problem_type(name: str) -> Any:
    """The registered problem type `name`; a `ValueError` listing the registered ones otherwise."""
    return lookup(PROBLEM_TYPES, name, "problem_type")


def problem_type_of(spec: Any) -> Any:
    """The problem type of a task."""
    return get_problem_type(spec.problem_type)


def problem_type_names(capability: str | None = None) -> tuple[str, ...]:
    """Names of the registered types (with `capability`, only those that have it)."""
    return tuple(n for n, t in PROBLEM_TYPES.items() if capability is None or capability in t.capabilities)
