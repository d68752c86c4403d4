"""How each task's gate spreads its weight over the experts (MMoE paper, Figure 6)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import _pyplot, _save_figure


@dataclass
class GateDistribution:
    """`weights[task]`: `(rows, experts)` softmax gate weights of that task on the rows given."""

    task_names: list[str]
    weights: dict[str, np.ndarray]

    def mean(self) -> dict[str, list[float]]:
        """Mean gate weight of each expert, per task."""
        return {t: self.weights[t].astype(np.float64).mean(0).round(4).tolist() for t in self.task_names}

    def to_dict(self) -> dict:
        return {
            "mean": self.mean(),
            "top_expert_share": {  # how often each expert has the largest weight
                t: (np.bincount(self.weights[t].argmax(1), minlength=self.weights[t].shape[1]) / len(self.weights[t]))
                .round(4)
                .tolist()
                for t in self.task_names
            },
        }

    def plot(self, path: str, title: str = "Gate weights per expert") -> str:
        """One box plot per task: the distribution over rows of each expert's gate weight. Returns `path`."""
        tasks = self.task_names
        fig, axes = _pyplot().subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.4), sharey=True, squeeze=False)
        for ax, task in zip(axes[0], tasks):
            w = self.weights[task]
            ax.boxplot([w[:, e] for e in range(w.shape[1])], showfliers=False)
            ax.set_xticks(range(1, w.shape[1] + 1), [str(e) for e in range(w.shape[1])])
            ax.set_title(task)
            ax.set_xlabel("expert")
        axes[0][0].set_ylabel("gate weight")
        fig.suptitle(title)
        return _save_figure(fig, path)


@torch.no_grad()
def gate_distribution(model, inputs: dict[str, torch.Tensor], batch_size: int = 4096) -> GateDistribution:
    """Gate weights of every task of an `MMoEModel` (MMoE or OMoE) on `inputs` (`numeric_features`,
    `categorical_features`; labels are ignored), computed in eval mode in batches."""
    if model.config.architecture == "shared_bottom":
        raise ValueError("A Shared-Bottom model has no gates; use architecture 'mmoe' or 'omoe'.")
    was_training = model.training
    model.eval()
    features = {k: v for k, v in inputs.items() if k in ("numeric_features", "categorical_features")}
    rows = next(iter(features.values())).shape[0]
    chunks = []
    for start in range(0, rows, batch_size):
        part = {k: v[start : start + batch_size].to(model.device) for k, v in features.items()}
        chunks.append(model(**part, output_gates=True).gate_weights.float().cpu())  # (b, tasks, experts)
    model.train(was_training)
    gates = torch.cat(chunks).numpy()
    names = model.config.task_names
    return GateDistribution(names, {t: gates[:, k] for k, t in enumerate(names)})
