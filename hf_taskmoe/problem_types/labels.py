"""Reading labels as data files write them: numbers and class labels, never guessed (shared by the problem types)."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..tasks import TaskSpec

# a number as a data file writes it: ASCII digits, one optional sign, point and exponent (no "1_000", no "²")
_NUMBER_RE = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_INTEGER_RE = re.compile(r"-?[0-9]+")


def number(value: Any) -> float | None:
    """A regression target as a float, or None: numbers, and text that is a plain decimal number (spaces around
    allowed, as a CSV cell may have them); never a boolean."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        if _NUMBER_RE.fullmatch(text) or text.lower().lstrip("+-") in ("nan", "inf", "infinity"):
            return float(text)
    return None


def class_index(spec: TaskSpec, value: Any, where: str) -> int:
    """A class label as written in a file -> the class position.

    With `label_values` a label is one of those values. Otherwise a label is a class name or a 0-based position;
    an integer that is also the name of another class (names "1".."5") could be either, so it is refused."""
    names, num_classes = spec.label_names or [], spec.num_labels
    if spec.label_values is not None:
        by_text = {str(v): i for i, v in enumerate(spec.label_values)}
        if isinstance(value, bool):  # JSON true/false match the label values "true"/"false" (or "True"/"False")
            key = next((k for k in ((json.dumps(value), str(value))) if k in by_text), json.dumps(value))
        else:
            key = str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)
        if key not in by_text:
            raise ValueError(f"{where}: label {value!r} is not one of the task's `label_values` {spec.label_values}.")
        return by_text[key]
    if isinstance(value, bool):  # JSON true/false: the class of that name, never position 1/0
        for name in (("True", "true") if value else ("False", "false")):
            if name in names:
                return names.index(name)
        allowed = names if names else list(range(num_classes))
        raise ValueError(
            f"{where}: label {json.dumps(value)} is a boolean, matched by name, and no class of the task's labels "
            f"{allowed} is named {str(value)!r}; name the classes in `label_names` (e.g. [\"False\", \"True\"]) or "
            "write class names in the file."
        )
    if isinstance(value, str):
        if value in names:
            return names.index(value)
        if not _INTEGER_RE.fullmatch(value):  # ASCII digits only: "²".isdigit() is True but int("²") fails
            allowed = names if names else list(range(num_classes))
            raise ValueError(f"{where}: label {value!r} is not one of the task's labels {allowed}.")
        value = int(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or not 0 <= value < num_classes:
        allowed = names if names else list(range(num_classes))
        hint = ""
        if isinstance(value, int) and value == num_classes:
            hint = (f" If the file counts classes from 1, say so in the task-config: \"label_values\": "
                    f"{list(range(1, num_classes + 1))}.")
        raise ValueError(
            f"{where}: label {value!r} is outside the task's label set {allowed} (positions "
            f"0..{num_classes - 1}).{hint}"
        )
    if str(value) in names and names.index(str(value)) != value:
        raise ValueError(
            f"{where}: label {value!r} could be class position {value} ({names[value]!r}) or the class named "
            f"{str(value)!r}; add \"label_values\" (the file's labels in the order of `label_names`) to the "
            "task-config."
        )
    return value
