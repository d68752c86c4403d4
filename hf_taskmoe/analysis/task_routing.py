"""Analysis of task-level routes (Ye et al. 2022, sections 5.3, 6 and 7.2).

```python
decisions = model.task_routing()                       # (tasks, routed layers, experts)
plot_task_routing(decisions, model.config.task_names, model.config.route_names, "routes.png")   # Figure 3
r, p = route_feature_correlation(decisions, {"classification": [1, 1, 0, ...]})                  # Figure 4
with model.experts_disabled([("E1", 2)]): ...                                                    # Table 3
average_relative_gain(baseline={"a": 0.5, "b": 0.8}, method={"a": 0.8, "b": 0.6})                # ARG, 7.2
```
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from . import _pyplot, _save_figure


def _flat(decisions) -> np.ndarray:
    d = (
        decisions.detach().float().cpu().numpy()
        if isinstance(decisions, torch.Tensor)
        else np.asarray(decisions, dtype=float)
    )
    if d.ndim != 3:
        raise ValueError(f"`decisions` must have shape (tasks, routed layers, experts), got {d.shape}.")
    return d.reshape(d.shape[0], -1)  # (tasks, layers * experts): feature L{i}E{j} at column i * experts + j


def expert_names(route_names: Sequence[str], num_experts: int) -> list[str]:
    """`"E0e1"`: expert 1 of routed layer E0 (the paper's "L0E1"), in the column order of the flattened decisions."""
    return [f"{layer}e{j}" for layer in route_names for j in range(num_experts)]


def plot_task_routing(decisions, task_names: Sequence[str], route_names: Sequence[str], path: str | Path,
                      title: str = "Routing decisions per task") -> Path:
    """Heatmap of the decision matrix of every task (Figure 3): one row per task, one column per (layer, expert)."""
    flat = _flat(decisions)
    experts = flat.shape[1] // len(route_names)
    fig, ax = _pyplot().subplots(figsize=(max(6, 0.32 * flat.shape[1]), 1.2 + 0.45 * len(task_names)))
    image = ax.imshow(flat, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0)
    ax.set_yticks(range(len(task_names)), labels=list(task_names))
    ax.set_xticks(range(flat.shape[1]), labels=expert_names(route_names, experts), rotation=90, fontsize=7)
    for boundary in range(experts, flat.shape[1], experts):  # separate the layers
        ax.axvline(boundary - 0.5, color="white", linewidth=0.8)
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="D (weight of the expert)")
    return _save_figure(fig, Path(path))


def route_feature_correlation(decisions, features: Mapping[str, Sequence[float]]) -> tuple[np.ndarray, np.ndarray]:
    """Pearson correlation (section 6.1) between each learned feature `D_ij` (one value per task) and each
    hand feature (one value per task). Returns `(r, p)`, both `(layers * experts, features)`; NaN where a
    feature or a decision is constant over the tasks (no correlation is defined)."""
    from scipy.stats import pearsonr

    flat = _flat(decisions)
    tasks = flat.shape[0]
    if tasks < 3:
        raise ValueError(f"Correlation over tasks needs at least 3 tasks, got {tasks}.")
    r = np.full((flat.shape[1], len(features)), np.nan)
    p = np.full_like(r, np.nan)
    for k, (name, values) in enumerate(features.items()):
        values = np.asarray(values, dtype=float)
        if values.shape != (tasks,):
            raise ValueError(f"Hand feature {name!r} must have one value per task ({tasks}), got shape {values.shape}.")
        if np.ptp(values) == 0:
            continue
        for f in range(flat.shape[1]):
            if np.ptp(flat[:, f]) == 0:
                continue
            result = pearsonr(flat[:, f], values)
            r[f, k], p[f, k] = result.statistic, result.pvalue
    return r, p


def plot_route_feature_correlation(r: np.ndarray, p: np.ndarray, names: Sequence[str], feature_names: Sequence[str],
                                   path: str | Path, alpha: float = 0.01) -> Path:
    """Figure 4: correlations with p < `alpha` (others blank)."""
    shown = np.where(p < alpha, r, np.nan)
    fig, ax = _pyplot().subplots(figsize=(1.5 + 0.6 * len(feature_names), 1.0 + 0.22 * len(names)))
    image = ax.imshow(shown, aspect="auto", cmap="coolwarm", vmin=-1, vmax=1)
    ax.set_xticks(range(len(feature_names)), labels=list(feature_names), rotation=45, ha="right")
    ax.set_yticks(range(len(names)), labels=list(names), fontsize=7)
    ax.set_title(f"Pearson r (p < {alpha})")
    fig.colorbar(image, ax=ax)
    return _save_figure(fig, Path(path))


def average_relative_gain(baseline: Mapping[str, float], method: Mapping[str, float]) -> float:
    """ARG (section 7.2): the mean over tasks of `(method - baseline) / baseline`."""
    missing = sorted(set(baseline) ^ set(method))
    if missing:
        raise ValueError(f"ARG needs the same tasks on both sides; only on one side: {missing}.")
    if not baseline:
        raise ValueError("ARG needs at least one task.")
    zero = [t for t, v in baseline.items() if v == 0]
    if zero:
        raise ValueError(f"ARG divides by the baseline score, which is 0 for {zero}.")
    return float(np.mean([(method[t] - baseline[t]) / baseline[t] for t in baseline]))
