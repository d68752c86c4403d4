"""Covariance similarity between tasks' inputs (CA-MTL eq. 7, after Wu et al. 2020).

For task i with inputs `X_i (m_i, d)`: take `X_i^T X_i`, keep its best rank-`r_i` approximation
`U D U^T` with `r_i` the fewest singular values holding `energy` (99%) of their sum, and let
`A_i = U_{r_i} D_{r_i}^{1/2}`. Eq. 7 is

    CovSim_ij = ||A_i^T A_j||_F / (||A_i||_F ||A_j||_F) = sqrt(<S_i, S_j>_F / (tr S_i tr S_j)),

with `S_i = A_i A_i^T` the rank-`r_i` covariance. As printed, eq. 7 of identical inputs is
`||S||_F / tr S`, which is 1 only for rank one. `normalized=True` (default) divides by the two
self-similarities, giving `sqrt(<S_i, S_j>_F / (||S_i||_F ||S_j||_F))`: 1 for identical inputs, 0 for
inputs in orthogonal subspaces. `normalized=False` returns eq. 7 as printed.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch


def _factor(x: torch.Tensor, energy: float) -> torch.Tensor:
    """`U_r D_r^{1/2}` of `X^T X`, `(d, r)`."""
    x = x.detach().double()
    cov = x.T @ x  # (d, d)
    eigenvalues, vectors = torch.linalg.eigh(cov)  # ascending; symmetric PSD: singular values = eigenvalues
    eigenvalues, vectors = eigenvalues.flip(0).clamp(min=0), vectors.flip(1)
    total = eigenvalues.sum()
    if total <= 0:
        raise ValueError("Covariance similarity of an all-zero input is undefined.")
    rank = (
        int(torch.searchsorted(torch.cumsum(eigenvalues, 0) / total, torch.tensor(energy, dtype=total.dtype)).item())
        + 1
    )
    rank = min(rank, len(eigenvalues))
    return vectors[:, :rank] * eigenvalues[:rank].sqrt()


def covariance_similarity(x_i: torch.Tensor, x_j: torch.Tensor, energy: float = 0.99, normalized: bool = True) -> float:
    """Eq. 7 between two input matrices `(m_i, d)` and `(m_j, d)` (see the module doc for `normalized`)."""
    if x_i.dim() != 2 or x_j.dim() != 2 or x_i.shape[1] != x_j.shape[1]:
        raise ValueError(
            f"Inputs must be (examples, features) matrices with the same features, got {tuple(x_i.shape)} and "
            f"{tuple(x_j.shape)}."
        )
    if not 0.0 < energy <= 1.0:
        raise ValueError(f"`energy` must be in (0, 1], got {energy}.")
    a_i, a_j = _factor(x_i, energy), _factor(x_j, energy)
    value = torch.linalg.matrix_norm(a_i.T @ a_j) / (torch.linalg.matrix_norm(a_i) * torch.linalg.matrix_norm(a_j))
    if normalized:
        self_i = torch.linalg.matrix_norm(a_i.T @ a_i) / torch.linalg.matrix_norm(a_i) ** 2
        self_j = torch.linalg.matrix_norm(a_j.T @ a_j) / torch.linalg.matrix_norm(a_j) ** 2
        value = value / (self_i * self_j).sqrt()
    return float(value.clamp(max=1.0))


def task_covariance_similarity(
    inputs: Mapping[str, torch.Tensor], energy: float = 0.99, normalized: bool = True
) -> tuple[list[str], np.ndarray, dict[str, float]]:
    """Pairwise covariance similarity of every task's inputs (`{task: (m_t, d)}`), and each task's average
    over the others (`CovSim_i`, eq. 7). Returns `(task names, matrix (T, T), {task: CovSim_i})`."""
    names = list(inputs)
    if len(names) < 2:
        raise ValueError("Covariance similarity compares tasks: give at least two.")
    matrix = np.ones((len(names), len(names)))
    for a in range(len(names)):
        for b in range(a + 1, len(names)):
            matrix[a, b] = matrix[b, a] = covariance_similarity(inputs[names[a]], inputs[names[b]], energy, normalized)
    if not normalized:
        for a, name in enumerate(names):
            matrix[a, a] = covariance_similarity(inputs[name], inputs[name], energy, normalized=False)
    average = {name: float((matrix[a].sum() - matrix[a, a]) / (len(names) - 1)) for a, name in enumerate(names)}
    return names, matrix, average


@torch.no_grad()
def first_layer_inputs(model, batches: Mapping[str, dict], pooling: str = "tokens") -> dict[str, torch.Tensor]:
    """What each task's examples feed the first transformer layer (after CA-MTL's conditional alignment, when
    the model has one): `{task: (m_t, d)}`. `batches[task]` holds `input_ids` (and `attention_mask`,
    `token_type_ids`) of that task's examples. `pooling="tokens"` keeps every real token as a row,
    `"mean"` one mean vector per example."""
    if pooling not in ("tokens", "mean"):
        raise ValueError(f"`pooling` must be 'tokens' or 'mean', got {pooling!r}.")
    was_training = model.training
    model.eval()
    try:
        out = {}
        for task, batch in batches.items():
            input_ids = batch["input_ids"]
            mask = batch.get("attention_mask")
            mask = torch.ones_like(input_ids) if mask is None else mask
            task_ids = torch.full((input_ids.shape[0],), model.task_id(task), dtype=torch.long, device=input_ids.device)
            # the model's own forward up to its first layer (`TaskEncoderMixin.first_layer_inputs`)
            hidden = model.first_layer_inputs(input_ids, mask, batch.get("token_type_ids"), task_ids)
            if pooling == "tokens":
                out[task] = hidden[mask.bool()]  # (real tokens, d)
            else:
                weights = mask.unsqueeze(-1).to(hidden.dtype)
                out[task] = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)  # (examples, d)
        return out
    finally:
        model.train(was_training)
