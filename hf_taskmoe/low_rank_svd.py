"""Truncated SVDs of batches of float64 matrices, on the CPU or an accelerator: the LoRA factors
`export_task_adapters` (`hf_taskmoe.lora_export`) makes of each `W_task - W_base`. Plain tensors in and out: nothing
here knows of models or peft's files.

`truncated_svds(deltas, rank, svd)` gives each matrix's rank-`rank` factors `(A, B, ||delta - B A||)`: the exact float64
SVD (LAPACK's, cuSOLVER's), or a float64 subspace iteration batched over the matrices of one shape (`svd="subspace"`;
`"auto"` on an accelerator where the rank leaves most of a matrix out). The iteration reaches the exact SVD's
reconstruction where the spectrum decays and comes within 5e-7 of the optimum's truncation error where it is flat
(docs/serving-adapters.md, `benchmarks/lora_export_svd.py`).
"""

from __future__ import annotations

import torch

__all__ = ["SUBSPACE_MAX_ITERS", "SUBSPACE_TOL", "SVD_METHODS", "truncated_svds", "uses_subspace"]


def _svd(delta: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """`(A (rank, in), B (out, rank), ||delta - B A||)`: the truncated SVD split evenly, padded with zeros (the exact
    path: LAPACK's / cuSOLVER's SVD of the whole float64 matrix)."""
    out_f, in_f = delta.shape
    if not bool(delta.any()):
        zeros = delta.new_zeros
        return zeros(rank, in_f), zeros(out_f, rank), 0.0
    u, s, vh = torch.linalg.svd(delta, full_matrices=False)
    k = min(rank, s.numel())
    root = s[:k].sqrt()
    a = delta.new_zeros(rank, in_f)
    b = delta.new_zeros(out_f, rank)
    a[:k] = root[:, None] * vh[:k]
    b[:, :k] = u[:, :k] * root[None, :]
    return a, b, float(s[k:].norm())


#: `export_task_adapters(svd=...)`: "auto" (on an accelerator, the subspace iteration where the rank leaves most of a
#: matrix out; the exact SVD elsewhere and on the CPU), "exact" (the float64 SVD of every matrix), "subspace" (the
#: iteration wherever the rank is below the matrix's own, on any device)
SVD_METHODS = ("auto", "exact", "subspace")
#: the subspace iteration: its block is `rank + max(rank, 16)` columns; it stops when the rank-r reconstruction moved by
#: less than `SUBSPACE_TOL` (relative, Frobenius) between two checks (after 4, 8, 16, 24, ... iterations), or after
#: `SUBSPACE_MAX_ITERS`
SUBSPACE_TOL = 1e-7
SUBSPACE_MAX_ITERS = 64
_EPS64 = torch.finfo(torch.float64).eps


def _block(rank: int, small: int) -> int:
    return min(small, rank + max(rank, 16))


def uses_subspace(svd: str, rank: int, shape, device: torch.device | str = "cpu") -> bool:
    """Whether a `shape` matrix at `rank` takes the subspace iteration: never where the rank carries the whole matrix
    (the export must then be exact); under "auto" only on an accelerator (on the CPU, LAPACK's float64 SVD of a
    1024 x 1024 matrix took 0.8 s on one thread, about what 64 iterations' float64 matmuls take) and where the block
    leaves part of the matrix out (else the exact SVD of a small matrix is as cheap)."""
    small = min(shape)
    if svd == "exact" or rank >= small:
        return False
    if svd == "subspace":
        return True
    return torch.device(device).type != "cpu" and _block(rank, small) < small


def _orthonormalize(y: torch.Tensor) -> torch.Tensor:
    """A basis of the span of `y`'s columns (batched), orthonormal to about 1e-9: three passes of Cholesky QR, each
    with a small shift of its Gram matrix (shifted CholeskyQR3, after Fukaya et al., SIAM J. Sci. Comput. 2020). Batched
    matmuls, Cholesky factorisations and triangular solves only: on a GPU these run as batched kernels, where
    torch's batched QR and eigen solvers loop over the batch. The shift keeps every factorisation positive definite
    (a rank-deficient `y` gives small columns, which the Rayleigh-Ritz step drops)."""
    n, k = y.shape[-2:]
    eye = torch.eye(k, dtype=y.dtype, device=y.device)
    for _ in range(3):
        gram = y.mT @ y
        norm2 = gram.diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min(torch.finfo(y.dtype).tiny)
        shift = 11 * (n * k + k * (k + 1)) * _EPS64 * norm2
        factor, _ = torch.linalg.cholesky_ex(gram + shift[..., None, None] * eye, upper=True)
        y = torch.linalg.solve_triangular(factor, y, upper=True, left=False)
    return y


def _rayleigh_ritz(x: torch.Tensor, q: torch.Tensor, rank: int) -> torch.Tensor:
    """The `rank` leading right singular vectors of `x` (batched, `(B, n, rank)`) within the span of `q`'s columns
    (which need not be exactly orthonormal): the small `(k, k)` eigenproblems run in float64 on the CPU, one thread
    (LAPACK on matrices this small loses time to threads)."""
    xq = x @ q
    grams = torch.stack([q.mT @ q, xq.mT @ xq]).cpu()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        lam, vec = torch.linalg.eigh(grams[0])
        keep = lam > lam[..., -1:] * 1e-12  # directions q does not span (rank-deficient x) are dropped
        basis = vec * torch.where(keep, lam.clamp_min(torch.finfo(lam.dtype).tiny).rsqrt(), 0.0)[..., None, :]
        _, w = torch.linalg.eigh(basis.mT @ grams[1] @ basis)
        coef = basis @ w[..., -rank:].flip(-1)  # descending
    finally:
        torch.set_num_threads(threads)
    return q @ coef.to(q.device)


def _subspace_svd(deltas: torch.Tensor, rank: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                            int]:
    """The rank-`rank` truncated SVD of a batch of same-shape float64 matrices `(B, out, in)` by subspace iteration
    (Halko, Martinsson, Tropp 2011, algorithm 4.4, with Rayleigh-Ritz): `(A (B, rank, in), B (B, out, rank),
    ||delta - B A|| (B,), iterations)`. Only batched matmuls and Cholesky factorisations run on the matrices'
    device; the `(k, k)` eigenproblems run on the CPU.

    The reconstruction `B A = delta V V^T` is the projection of `delta` on the `rank` leading right singular vectors
    found; it converges to the exact SVD's at the rate `(s_(k+1) / s_rank)^2` per iteration (`k` the block's columns),
    fast where the spectrum decays and slow where it is flat, but there the truncation error `||delta - B A||` is
    already near the optimum (measured in docs/serving-adapters.md)."""
    transposed = deltas.shape[-2] < deltas.shape[-1]
    x = deltas.mT if transposed else deltas  # (B, m, n), n <= m: iterate on the n-dimensional side
    batch, _, n = x.shape
    k = _block(rank, n)
    if k >= n:
        q, iterations = torch.eye(n, dtype=x.dtype, device=x.device).expand(batch, n, n), 0
    else:
        generator = torch.Generator().manual_seed(seed)
        q = _orthonormalize(torch.randn(batch, n, k, generator=generator, dtype=x.dtype).to(x.device))
        previous, iterations = None, 0
        for iterations in range(1, SUBSPACE_MAX_ITERS + 1):
            q = _orthonormalize(x.mT @ (x @ q))
            if iterations != 4 and iterations % 8:  # check after 4, 8, 16, 24, ... iterations
                continue
            v = _rayleigh_ritz(x, q, rank)
            p = x @ v
            if previous is not None:  # relative change of the reconstruction p v^T since the last check
                pv, vv = previous
                cross = ((pv.mT @ p) * (vv.mT @ v)).sum((-2, -1))
                now, before = p.square().sum((-2, -1)), pv.square().sum((-2, -1))
                change = (now + before - 2 * cross).clamp_min(0).sqrt() / now.sqrt().clamp_min(1e-300)
                if float(change.max()) < SUBSPACE_TOL:
                    break
            previous = (p, v)
    v = _rayleigh_ritz(x, q, rank)
    p = x @ v  # (B, m, rank): U S
    error = (x - p @ v.mT).norm(dim=(-2, -1))
    s = p.norm(dim=-2)
    root = s.sqrt()
    left = torch.where(s[..., None, :] > 0, p / root.clamp_min(1e-300)[..., None, :], 0.0)  # U sqrt(S)
    right = v * root[..., None, :]  # V sqrt(S): x = left right^T
    if transposed:  # delta = x^T = right left^T
        left, right = right, left
    return right.mT, left, error, iterations


def truncated_svds(deltas: list[torch.Tensor], rank: int,
                   svd: str) -> tuple[list[tuple[torch.Tensor, torch.Tensor, float]], int]:
    """`(A (rank, in), B (out, rank), ||delta - B A||)` of each matrix (`_svd`'s; the subspace iteration where
    `uses_subspace` says so, batched over the matrices of one shape), and the most iterations a batch took (0: none
    iterated)."""
    results: list = [None] * len(deltas)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, delta in enumerate(deltas):
        if uses_subspace(svd, rank, delta.shape, delta.device) and bool(delta.any()):
            groups.setdefault(tuple(delta.shape), []).append(i)
        else:
            results[i] = _svd(delta, rank)
    most = 0
    for indices in groups.values():
        try:
            a, b, error, iterations = _subspace_svd(torch.stack([deltas[i] for i in indices]), rank)
        except torch.linalg.LinAlgError:  # a factorisation gone wrong (never seen): the exact SVDs instead
            for i in indices:
                results[i] = _svd(deltas[i], rank)
            continue
        most = max(most, iterations)
        finite = (torch.isfinite(a).flatten(1).all(1) & torch.isfinite(b).flatten(1).all(1) & torch.isfinite(error))
        for j, i in enumerate(indices):  # not finite (never seen): that matrix's exact SVD instead
            results[i] = (a[j], b[j], float(error[j])) if bool(finite[j]) else _svd(deltas[i], rank)
    return results, most
