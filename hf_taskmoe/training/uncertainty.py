"""MT-Uncertainty sampling (CA-MTL paper, section 2.2 and Algorithm 1), for every family with task heads.

Each training step the batch sampler draws `b` candidates of every task (`b x T` examples); the model
scores them without gradients in eval mode, and the `b` most uncertain examples are trained on:

    H_{t,i} = -sum_c p_c log p_c                  entropy of example i of task t
    H'_t    = log C_t                              entropy of the uniform distribution over task t's classes
    H^      = max_t mean_i H_{t,i}                 the largest average task entropy
    U_{t,i} = H_{t,i} / (H'_t * H^)                eq. 4-5; the batch is top_b(U)

`H^` divides every candidate by the same number, so it never changes which examples are chosen; it
keeps `U` on the paper's scale (reported in `last_uncertainty`).

Per problem type, `H` and `H'` are: single-label and span classification — softmax entropy, `log C`;
multiple choice — entropy over the choices, `log num_choices` (an example's rows stay together);
multi-label — sum of the labels' Bernoulli entropies, `C log 2`; token classification — mean entropy
over the example's real tokens, `log C`.

Regression has no predictive distribution, so no entropy. `regression_uncertainty` says what its
normalised uncertainty `H/H'` is:
- `"error"` (default): `min(1, (y - y_hat)^2 / var(y))`, the squared error relative to the variance of the
  task's candidate labels: high while the task is unlearned, falling as it is learned, like an entropy.
  It reads the labels, so it is a loss-based criterion, not a label-free one.
- `"mean"`: the mean `H/H'` of the pool's classification candidates (1.0 when the pool has none). Label
  free, but it starves the task: top-b keeps the most uncertain `1/T` of the pool, and an example at the
  pool's mean is rarely among them (measured: 0% of the chosen examples over a 200-step run with 5 tasks;
  docs/camtl.md).

Scoring costs one forward pass over `b x T` examples per step. `score_every = k` scores every k-th step
only; the steps in between keep the task composition of the last scored batch (the first examples of
each task's candidates, which arrive in random order).
"""

from __future__ import annotations

import numpy as np
import torch

from ..problem_types import problem_type_of
from ..utils import check_choice, check_int
from .samplers import ModelAwareSampling, register_task_sampler

REGRESSION_UNCERTAINTY = ("mean", "error")


def example_layout(task_ids: torch.Tensor, specs) -> tuple[np.ndarray, np.ndarray]:
    """Rows -> examples: `(example index of each row, task of each example)`. A multiple-choice example
    spans `num_choices` consecutive rows; every other example is one row."""
    tasks = task_ids.tolist()
    example_of_row, example_task = [], []
    row = 0
    while row < len(tasks):
        t = tasks[row]
        span = problem_type_of(specs[t]).rows_per_example(specs[t])
        example_of_row.extend([len(example_task)] * span)
        example_task.append(t)
        row += span
    return np.asarray(example_of_row[: len(tasks)]), np.asarray(example_task)


class MTUncertaintySampling(ModelAwareSampling):
    """CA-MTL's Algorithm 1 as a model-aware task sampler (`task_sampling="uncertainty"`); see the module doc.

    Args:
        candidates_per_task: `b`, candidates drawn per task each step (default: the batch size, as in the paper).
        score_every: score the candidates every `score_every` steps (1 = every step, Algorithm 1).
        regression_uncertainty: `"error"` (default) or `"mean"` (module doc).
        seed: seeds the random order among equally uncertain candidates.
    """

    name = "uncertainty"

    def __init__(
        self,
        candidates_per_task: int | None = None,
        score_every: int = 1,
        regression_uncertainty: str = "error",
        seed: int = 0,
    ):
        super().__init__(
            None if candidates_per_task is None else check_int(candidates_per_task, "candidates_per_task", minimum=1)
        )
        self.score_every = check_int(score_every, "score_every", minimum=1)
        self.regression_uncertainty = check_choice(
            regression_uncertainty, REGRESSION_UNCERTAINTY, "regression_uncertainty"
        )
        self.seed = int(seed)
        self.last_counts: np.ndarray | None = None  # examples per task of the last scored batch
        self.last_uncertainty: np.ndarray | None = None  # U of every candidate at the last scoring
        self._window: np.ndarray | None = None  # examples chosen per task since the last log

    def config(self) -> dict:
        return {
            "name": self.name, "candidates_per_task": self.candidates_per_task, "score_every": self.score_every,
            "regression_uncertainty": self.regression_uncertainty,
        }

    # ------------------------------------------------------------------ Algorithm 1
    def uncertainty(self, model: torch.nn.Module, inputs: dict, specs, example_of_row, example_task) -> np.ndarray:
        """`U_{t,i}` of every candidate example (eq. 4-5), from one forward pass without gradients in eval mode
        (`H^` of this process's candidates; `select` uses the `H^` of all processes)."""
        ratio, h_hat = self._normalised_entropy(model, inputs, specs, example_of_row, example_task)
        return ratio / h_hat

    def _normalised_entropy(self, model, inputs, specs, example_of_row, example_task) -> tuple[np.ndarray, float]:
        """`H/H'` of every candidate and this process's `H^` (the largest average task entropy, 1.0 if none)."""
        task_ids = inputs["task_ids"]
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                out = model(**{k: v for k, v in inputs.items() if k != "labels"})
        finally:
            model.train(was_training)
        if getattr(out, "task_logits", None) is None:
            raise ValueError(
                f"MT-Uncertainty sampling needs per-task logits (`task_logits` in the output); {type(model).__name__} "
                "returns none."
            )
        ratio = np.full(len(example_task), np.nan)  # H / H'
        average_entropy = []  # mean H of each scored task (for H^)
        regression = []
        for t, spec in enumerate(specs):
            rows = torch.nonzero(task_ids == t).flatten()
            if not len(rows):
                continue
            examples = np.unique(example_of_row[rows.cpu().numpy()])  # in pool order, as the heads keep rows
            mask = inputs.get("attention_mask")
            # `H` of each example and `H'` (`ProblemType.entropy`); None for regression, scored after the others
            # against their mean entropy (`regression_uncertainty`)
            scored = problem_type_of(spec).entropy(spec, out.task_logits[spec.name],
                                                   None if mask is None else mask.index_select(0, rows))
            if scored is None:
                regression.append((t, spec, rows, examples))
                continue
            h, h_uniform = scored
            h = h.cpu().numpy()
            ratio[examples] = h / h_uniform
            average_entropy.append(h.mean())
        scored = ~np.isnan(ratio)
        for _t, spec, rows, examples in regression:
            if self.regression_uncertainty == "mean":
                ratio[examples] = ratio[scored].mean() if scored.any() else 1.0
            else:
                labels = inputs.get("labels")
                if labels is None:
                    raise ValueError("`regression_uncertainty='error'` needs the candidates' labels.")
                y = labels.index_select(0, rows).float()
                y = y[:, 0] if y.dim() > 1 else y
                pred = out.task_logits[spec.name].float().reshape(len(rows), -1)[:, 0]
                variance = y.var(unbiased=False).item() if len(rows) > 1 else 0.0
                error = ((y - pred) ** 2 / (variance if variance > 1e-12 else 1.0)).clamp(max=1.0)
                ratio[examples] = error.cpu().numpy()
        h_hat = max(average_entropy) if average_entropy and max(average_entropy) > 0 else 1.0
        return ratio, float(h_hat)

    def _top(self, model, inputs, specs, example_of_row, example_task, batch_size: int, step: int) -> np.ndarray:
        """Indices (pool order) of this process's candidates among the most uncertain.

        One process: its `batch_size` most uncertain. Under DDP/DeepSpeed (`torch.distributed` initialised, world
        size `W`), the paper's global selection: `H^` is the largest average task entropy over all processes, every
        process's `U` is gathered, and each process trains on its own candidates among the `W x batch_size` most
        uncertain of all `W` pools. Batch sizes then differ between processes (their sum stays `W x batch_size`);
        a process none of whose candidates is chosen trains on its single most uncertain one, so that no rank
        runs an empty step."""
        ratio, h_hat = self._normalised_entropy(model, inputs, specs, example_of_row, example_task)
        world = _world_size()
        rank = torch.distributed.get_rank() if world > 1 else 0
        tie_break = np.random.default_rng([self.seed, step] + ([rank] if world > 1 else [])).random(len(ratio))
        if world == 1:
            u = ratio / h_hat
            self.last_uncertainty = u
            return np.sort(np.lexsort((tie_break, -u))[:batch_size])  # top_b, pool order kept
        # one collective per scored step (the selection is host-side: numpy arrays, pickled by all_gather_object)
        gathered: list = [None] * world
        torch.distributed.all_gather_object(gathered, (ratio, tie_break, h_hat))
        h_hat = max(h for _, _, h in gathered)
        u = np.concatenate([r for r, _, _ in gathered]) / h_hat
        ties = np.concatenate([t for _, t, _ in gathered])
        owner = np.concatenate([np.full(len(r), k) for k, (r, _, _) in enumerate(gathered)])
        index = np.concatenate([np.arange(len(r)) for r, _, _ in gathered])
        top = np.lexsort((index, owner, ties, -u))[: batch_size * world]
        mine = np.sort(index[top[owner[top] == rank]])
        self.last_uncertainty = u[owner == rank]
        if not len(mine):
            mine = np.asarray([int(np.lexsort((tie_break, -self.last_uncertainty))[0])])
        return mine

    def select(self, model: torch.nn.Module, inputs: dict, batch_size: int, step: int) -> dict:
        core = getattr(model, "module", model)  # DDP / DataParallel wrap the model
        specs = core.config.task_specs
        example_of_row, example_task = example_layout(inputs["task_ids"], specs)
        num_tasks = len(specs)
        if len(example_task) <= batch_size and _world_size() == 1:
            return inputs  # (under DDP every process takes part in the gathered selection, even with a small pool)
        if self.last_counts is None or step % self.score_every == 0:
            chosen = self._top(model, inputs, specs, example_of_row, example_task, batch_size, step)
            self.last_counts = np.bincount(example_task[chosen], minlength=num_tasks)
        else:  # keep the task composition of the last scored batch
            chosen = np.concatenate(
                [np.nonzero(example_task == t)[0][: self.last_counts[t]] for t in range(num_tasks)]
            )
            if len(chosen) < batch_size:  # a task had fewer candidates than last time: fill from the rest
                rest = np.setdiff1d(np.arange(len(example_task)), chosen)
                chosen = np.concatenate([chosen, rest[: batch_size - len(chosen)]])
            chosen = np.sort(chosen)
        counts = np.bincount(example_task[chosen], minlength=num_tasks)
        self._window = counts if self._window is None or len(self._window) != num_tasks else self._window + counts
        rows = torch.as_tensor(np.nonzero(np.isin(example_of_row, chosen))[0], device=inputs["task_ids"].device)
        n = len(example_of_row)
        return {
            k: v.index_select(0, rows) if torch.is_tensor(v) and v.dim() and v.shape[0] == n else v
            for k, v in inputs.items()
        }

    # ------------------------------------------------------------------ logging and checkpoints
    def pop_metrics(self, task_names: list[str]) -> dict[str, float]:
        """Share of each task among the examples chosen since the last call (`sampled/<task>`)."""
        if self._window is None or not self._window.sum():
            return {}
        shares = self._window / self._window.sum()
        self._window = None
        return {f"sampled/{name}": round(float(s), 4) for name, s in zip(task_names, shares)}

    def state_dict(self) -> dict:
        return {"last_counts": None if self.last_counts is None else self.last_counts.tolist()}

    def load_state_dict(self, state: dict) -> None:
        counts = state.get("last_counts")
        self.last_counts = None if counts is None else np.asarray(counts)


def _world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


register_task_sampler("uncertainty", MTUncertaintySampling, exist_ok=True)
