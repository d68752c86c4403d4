"""Rows of a tensor permuted and put back without atomic adds: a permutation moves each row once, so neither way
needs `index_select`'s backward (`index_add_`, atomic adds on a GPU, serialised in bf16). Used by the MoE's top-1
dispatch (tokens sorted by expert) and the stacked task heads (rows grouped by task)."""

from __future__ import annotations

import torch

from ..utils import inverse_permutation


def _put_back(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """`rows` permuted by `order` put back: row `i` to row `order[i]`, without atomic adds (a permutation writes each
    row once). Off the CPU a copy to the rows (`index_copy_`: no inverse permutation to compute, a scatter and an
    `arange` fewer); on a CPU a gather by the inverse permutation, where `index_copy_` takes several times as long as
    the scatter and the gather together."""
    if copy_puts_back(rows):
        return torch.empty_like(rows).index_copy_(0, order, rows)
    return rows.index_select(0, inverse_permutation(order))


def copy_puts_back(rows: torch.Tensor) -> bool:
    """Whether `_put_back` copies the rows to their places (off the CPU) or gathers them (on a CPU)."""
    return rows.device.type != "cpu"


class _PermuteRows(torch.autograd.Function):
    """`x.index_select(0, order)` for a permutation `order`, whose gradient is put back (`_put_back`).

    `index_select`'s own backward scatters with `index_add_` (atomic adds on a GPU, serialised in bf16) because it
    must allow repeated indices; a permutation has none, so a copy (or a gather by the inverse) does: no atomics."""

    @staticmethod
    def forward(ctx, x, order):
        ctx.save_for_backward(order)
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        return _put_back(grad, order), None


class _PutBack(torch.autograd.Function):
    """`_put_back` on a CPU differentiable with a gather by the permutation for its gradient (the gather by the
    inverse would scatter its gradient with `index_add_`)."""

    @staticmethod
    def forward(ctx, rows, order):
        ctx.save_for_backward(order)
        return _put_back(rows, order)

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        return grad.index_select(0, order), None


def permute_rows(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Rows of `x` in the order `order` (a permutation), differentiable without a scatter of atomic adds: the
    gradient is put back (`_put_back`). Without a backward to record, the gather alone (no autograd Function call)."""
    return _PermuteRows.apply(x, order) if torch.is_grad_enabled() else x.index_select(0, order)


def put_back_rows(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """`rows` permuted by `order` put back (`_put_back`), differentiable with a gather for its gradient. Off the CPU
    the copy's own backward is that gather, so no autograd Function runs (host time on a launch-bound step); on a CPU
    the gather by the inverse takes `_PutBack` for it. Without a backward to record, `_put_back` alone."""
    if torch.is_grad_enabled() and not copy_puts_back(rows):
        return _PutBack.apply(rows, order)
    return _put_back(rows, order)
