"""Small helpers shared by every module: registry look-ups and value checks.

Every check raises a one-line ``ValueError`` that names the field, what is allowed and what was given,
so a bad value is reported where it enters, not halfway through ``forward``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

V = TypeVar("V")


def is_capturing() -> bool:
    """Whether the forward is being captured into a program whose shapes may not depend on tensor values
    (`torch.export`, ONNX export through it, `torch.jit.trace`): layers then take their paths without data-dependent
    shapes (masked dense experts, PALs batched across groups, every head on every row)."""
    import torch

    from .compat import is_exporting

    return is_exporting() or torch.jit.is_tracing()


def compute_dtype(tensor, default=None):
    """The dtype an operation on `tensor` computes in: autocast's on the tensor's device where autocast is on, else
    `default` (the tensor's own dtype when None)."""
    import torch

    device = tensor.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return tensor.dtype if default is None else default


def one_hot(index, n: int, dtype, classes=None):
    """`index` `(...,)` as one-hot rows `(..., n)` of `dtype`, for products that select rows of a table (a task's gate,
    a slot's expert bias, a row's PAL weights): their backward is a product too, where `index_select`'s scatters with
    `index_add_` (contended atomic adds on a GPU, serialised in bf16). A comparison, not `F.one_hot`, which reads the
    indices' minimum back to the host on a CPU. `classes`: `arange(n)` on `index`'s device (best in its dtype), when
    the caller keeps one (one operation fewer), else made here. The comparison writes `dtype` itself (`out=`: one
    kernel on an accelerator, which casts as it stores, where a bool result and its cast are two)."""
    import torch

    classes = torch.arange(n, device=index.device) if classes is None else classes
    return torch.eq(index.unsqueeze(-1), classes, out=index.new_empty((*index.shape, n), dtype=dtype))


def inverse_permutation(order):
    """The inverse of the permutation `order` (a 1-D index tensor): `inverse[order[i]] = i`, one scatter on `order`'s
    device (no sort, nothing read back)."""
    import torch

    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def lookup(registry: Mapping[str, V], key: Any, field: str) -> V:
    """Return ``registry[key]``; on a miss, raise a ``ValueError`` listing the valid keys."""
    try:
        return registry[key]
    except (KeyError, TypeError):
        raise ValueError(f"`{field}` must be one of {sorted(registry)}, got {key!r}.") from None


def check_choice(value: Any, allowed, field: str) -> Any:
    if value not in allowed:
        raise ValueError(f"`{field}` must be one of {sorted(allowed)}, got {value!r}.")
    return value


def check_int(value: Any, field: str, minimum: int | None = None, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"`{field}` must be an integer, got {value!r}.")
    if minimum is not None and value < minimum:
        raise ValueError(f"`{field}` must be >= {minimum}, got {value}.")
    if maximum is not None and value > maximum:
        raise ValueError(f"`{field}` must be <= {maximum}, got {value}.")
    return value


def check_float(value: Any, field: str, minimum: float | None = None, maximum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"`{field}` must be a number, got {value!r}.")
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"`{field}` must be a finite number, got {value}.")
    if minimum is not None and value < minimum:
        raise ValueError(f"`{field}` must be >= {minimum}, got {value}.")
    if maximum is not None and value > maximum:
        raise ValueError(f"`{field}` must be <= {maximum}, got {value}.")
    return float(value)


def check_str_list(value: Any, field: str, allow_empty: bool = False) -> list[str]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"`{field}` must be a list of strings, got {value!r}.")
    if not allow_empty and len(value) == 0:
        raise ValueError(f"`{field}` must not be empty.")
    for item in value:
        if not isinstance(item, str) or not item:
            raise ValueError(f"`{field}` must hold non-empty strings, got {item!r}.")
    return list(value)


def check_layer_list(value: Any, field: str, num_layers: int) -> list[int] | None:
    """An optional list of distinct layer indices in [0, num_layers), returned sorted."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"`{field}` must be a list of layer indices or None, got {value!r}.")
    layers = [check_int(i, f"{field}[]", 0, num_layers - 1) for i in value]
    if len(set(layers)) != len(layers):
        raise ValueError(f"`{field}` must not repeat a layer, got {layers}.")
    return sorted(layers)
