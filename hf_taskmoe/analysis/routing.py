"""Routing statistics: which share of each task's tokens each expert receives, per MoE layer.

Token-level MoE (BertForTaskMoE) counts tokens. Task-level routing (BartTaskRouted) counts examples: each row
adds its routing decision over the experts, so a hard (Gumbel straight-through, or evaluation) route adds 1 to
the chosen expert and a soft one (softmax, average) spreads the row's weight; its layers are the routed-layer
names (`E0`, ..., `D0`, ...).

```python
out = model(**batch, output_router_logits=True)
stats = RoutingStatistics.from_output(out, model)    # or: stats = RoutingStatistics(model); stats.update(out)
stats.shares            # (layers, tasks, experts), rows sum to 1
stats.plot("routing.png")
```
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from . import _pyplot, _save_figure


def routed_layers(config) -> list[int | str] | None:
    """The layers a model routes between experts (None when it routes nothing): MoE layer indices
    (BertForTaskMoE with num_experts > 1) or routed-layer names (BartTaskRouted)."""
    layers = getattr(config, "moe_layer_indices", None) or getattr(config, "route_names", None)
    return list(layers) if layers and getattr(config, "num_experts", 1) > 1 else None


def layer_label(layer: int | str) -> str:
    """`L3` for an MoE layer index, the name itself (`E0`, `D2`) for a routed BART layer."""
    return f"L{layer}" if isinstance(layer, int) else str(layer)


class RoutingStatistics:
    """Token counts per (MoE layer, task, expert), accumulated over any number of forward passes.

    Args:
        task_names: names of the tasks, in task-id order (or a model, whose tasks and routed layers are read).
        layers: the MoE layers (indices, or names) the counts' first axis stands for.
        num_experts: experts per MoE layer.
        unit: what is counted, `"tokens"` or `"examples"` (read from a model's config `routing_unit`).
    """

    def __init__(self, task_names, layers: list[int | str] | None = None, num_experts: int | None = None,
                 unit: str = "tokens"):
        if hasattr(task_names, "config"):  # a model
            config = task_names.config
            layers = routed_layers(config)
            if layers is None:
                raise ValueError(f"{type(task_names).__name__} routes nothing (no MoE layers with num_experts > 1).")
            task_names, num_experts = config.task_names, config.num_experts
            unit = getattr(config, "routing_unit", "tokens")
        self.task_names = list(task_names)
        self.layers = list(layers) if layers is not None else None
        self.num_experts = num_experts
        self.unit = unit
        # (layers, tasks, experts) on CPU: int64 token counts, or float64 sums of soft routing weights
        self.counts: torch.Tensor | None = None

    @classmethod
    def from_dict(cls, data: dict) -> RoutingStatistics:
        """The statistics `to_dict` wrote (a `routing.json`, or the `routing` of a run summary): the counts are
        rebuilt from each layer's shares and the task's count, as float sums."""
        try:
            tasks = data["tasks"]
            names = list(tasks)
            layers = list(data["layers"])
            counts = torch.zeros(len(layers), len(names), int(data["num_experts"]), dtype=torch.float64)
            for t, name in enumerate(names):
                entries = tasks[name]["per_layer"]
                if [e["layer"] for e in entries] != layers:
                    raise ValueError(f"task {name!r} lists layers {[e['layer'] for e in entries]}, not {layers}")
                for i, entry in enumerate(entries):
                    counts[i, t] = torch.tensor(entry["shares"], dtype=torch.float64) * float(tasks[name][data["unit"]])
        except (KeyError, TypeError) as err:
            raise ValueError(
                f"not a routing-statistics dict (as RoutingStatistics.to_dict writes): missing {err}"
            ) from None
        stats = cls(names, layers, int(data["num_experts"]), unit=data["unit"])
        stats.counts = counts
        return stats

    @classmethod
    def from_output(cls, output, model) -> RoutingStatistics:
        stats = cls(model)
        stats.update(output)
        return stats

    def update(self, counts_or_output) -> RoutingStatistics:
        """Add the `routing_counts` of a forward pass (the output, or the tensor itself)."""
        counts = getattr(counts_or_output, "routing_counts", counts_or_output)
        if counts is None:
            raise ValueError("No routing counts: run the model with `output_router_logits=True`.")
        counts = counts.detach().to("cpu", torch.float64 if counts.is_floating_point() else torch.long)
        if counts.dim() != 3 or counts.shape[1] != len(self.task_names):
            raise ValueError(
                f"routing counts must have shape (layers, {len(self.task_names)} tasks, experts), got "
                f"{tuple(counts.shape)}."
            )
        self.counts = counts.clone() if self.counts is None else self.counts + counts
        if self.layers is None:
            self.layers = list(range(counts.shape[0]))
        self.num_experts = counts.shape[2]
        return self

    def reset(self) -> None:
        self.counts = None

    def _require(self) -> torch.Tensor:
        if self.counts is None:
            raise ValueError("No routing counts recorded yet; call `update` after a forward pass.")
        return self.counts

    @property
    def tokens(self) -> torch.Tensor:
        """`(layers, tasks)` tokens (or examples, see `unit`) routed per task and layer (all top-k slots)."""
        return self._require().sum(-1)

    @property
    def shares(self) -> torch.Tensor:
        """`(layers, tasks, experts)` share of each task's tokens per expert (0 for a task with no tokens)."""
        counts = self._require().double()
        return counts / counts.sum(-1, keepdim=True).clamp(min=1)

    @property
    def entropy(self) -> torch.Tensor:
        """`(layers, tasks)` entropy of the expert distribution, in nats (log(num_experts) = uniform)."""
        p = self.shares
        return (p * p.clamp(min=1e-12).log()).sum(-1).neg() + 0.0  # + 0.0: one expert gives 0.0, not -0.0

    @property
    def unused_experts(self) -> torch.Tensor:
        """`(layers, tasks)` experts that received none of a task's tokens (tasks with tokens only)."""
        counts = self._require()
        unused = (counts == 0).sum(-1)
        return torch.where(counts.sum(-1) > 0, unused, torch.zeros_like(unused))

    def shared_routes(self) -> torch.Tensor:
        """`(tasks, tasks)` number of routed layers in which both tasks send most (over half) of their tokens (or
        examples) to the same expert: how much of their route two tasks share (the diagonal counts each task's
        decided layers). Soft routes that decide nothing (no expert over half, e.g. average routing) share none."""
        shares = self.shares  # (layers, tasks, experts)
        top = shares.argmax(-1)
        decided = shares.max(-1).values > 0.5
        same = (top[:, :, None] == top[:, None, :]) & decided[:, :, None] & decided[:, None, :]
        return same.sum(0)

    def as_number(self, value: torch.Tensor) -> int | float:
        """A count as a plain number: an int for token counts, a float for sums of soft routing weights."""
        return round(float(value), 4) if value.is_floating_point() else int(value)

    def to_dict(self) -> dict:
        shares, entropy, unused, tokens = self.shares, self.entropy, self.unused_experts, self.tokens
        out = {"num_experts": self.num_experts, "layers": self.layers, "unit": self.unit, "tasks": {}}
        for t, name in enumerate(self.task_names):
            out["tasks"][name] = {
                self.unit: self.as_number(tokens[0, t]),  # every layer routes the same tokens (x top-k)
                "per_layer": [
                    {
                        "layer": layer,
                        "shares": [round(float(s), 4) for s in shares[i, t]],
                        "entropy": round(float(entropy[i, t]), 4),
                        "unused_experts": int(unused[i, t]),
                    }
                    for i, layer in enumerate(self.layers)
                ],
            }
        return out

    def save_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2))
        return path

    def figure_size(self) -> tuple[float, float]:
        """The size (inches) of `plot`'s heatmap: wide enough for every expert column, tall enough for every task."""
        return max(4.0, 0.35 * len(self.layers) * self.num_experts + 2.5), 0.45 * len(self.task_names) + 1.6

    def plot(self, path: str | Path | None, title: str | None = None, ax=None) -> Path | None:
        """Heatmap PNG: one row per task, one column block per MoE layer, one column per expert. With `ax` (a
        matplotlib axes) it draws there and saves nothing (`path` may be None)."""
        own = ax is None  # a figure of its own, saved to `path`
        title = title or f"Share of each task's {self.unit} per expert"
        shares = self.shares  # (layers, tasks, experts)
        num_layers, num_tasks, num_experts = shares.shape
        grid = shares.permute(1, 0, 2).reshape(num_tasks, num_layers * num_experts).numpy()
        if own:
            fig, ax = _pyplot().subplots(figsize=self.figure_size())
        else:
            fig = ax.figure
        im = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
        ax.set_yticks(range(num_tasks), self.task_names)
        ax.set_xticks(
            [i * num_experts + (num_experts - 1) / 2 for i in range(num_layers)],
            [layer_label(layer) for layer in self.layers],
        )
        for i in range(1, num_layers):
            ax.axvline(i * num_experts - 0.5, color="white", linewidth=1.5)
        ax.set_xlabel(
            f"{'MoE' if self.unit == 'tokens' else 'routed'} layer (each block: experts 0..{num_experts - 1})"
        )
        ax.set_title(title)
        fig.colorbar(im, ax=ax, fraction=0.03, label=f"share of {self.unit}")
        return _save_figure(fig, Path(path)) if own else None


def normalised_entropy(stats: RoutingStatistics) -> torch.Tensor:
    """Entropy divided by log(num_experts): 1 = uniform routing, 0 = one expert."""
    return stats.entropy / math.log(max(stats.num_experts, 2))
