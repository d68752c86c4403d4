"""Task sampling: which task each row (or batch) of a multi-task batch comes from.

Strategies (`TASK_SAMPLERS`, one factory `build_task_sampling`):

| name | probability of task t at epoch e (1-based, of E) | source |
|---|---|---|
| `proportional` / `natural` | N_t / sum N | MT-TaG 3.3 |
| `temperature` | N_t^alpha / sum N^alpha (`alpha`, default 0.5) | |
| `sqrt` | temperature with alpha = 0.5 | PALs 3.3 |
| `uniform` | 1 / T | |
| `round_robin` | deterministic cycle over tasks | PALs 3.3 |
| `annealed` | temperature with alpha_e = 1 - (1 - min_alpha) (e - 1)/(E - 1), min_alpha 0.2 | PALs eq. 9 |

`TaskBatchSampler` turns a strategy into batches of dataset indices. `batching="heterogeneous"` draws the
task of every row (rows of several tasks in a batch, the MT-TaG choice); `"homogeneous"` draws one task
per batch. Within a task, examples are visited in a seeded random order, reshuffled when exhausted.

A batch sequence is a pure function of `(seed, epoch)`: resuming from a checkpoint regenerates the
epoch and the Trainer skips the batches already trained on, so the run continues with exactly the
batches it would have seen. A model-aware strategy (`model_aware = True`, e.g. MT-Uncertainty) gets
candidate pools of `candidates_per_task` examples of every task and chooses the rows to train on with
the model, in the trainer's loss step (`select`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Sampler

from ..utils import check_choice, check_float, check_int, lookup

BATCHING = ("heterogeneous", "homogeneous")


class TaskSamplingStrategy:
    """Base strategy: subclasses define `probabilities`; the row/batch draws follow from them."""

    name = "base"
    model_aware = False

    def probabilities(self, sizes: np.ndarray, epoch: int, num_epochs: int) -> np.ndarray:
        raise NotImplementedError

    def row_tasks(self, rng: np.random.Generator, batch_size: int, probs: np.ndarray, batch_index: int) -> np.ndarray:
        return rng.choice(len(probs), size=batch_size, p=probs)

    def batch_task(self, rng: np.random.Generator, probs: np.ndarray, batch_index: int) -> int:
        return int(rng.choice(len(probs), p=probs))

    def config(self) -> dict:
        """JSON-able description (saved in checkpoints, compared on resume)."""
        return {"name": self.name}


class ProportionalSampling(TaskSamplingStrategy):
    name = "proportional"

    def probabilities(self, sizes, epoch, num_epochs):
        return sizes / sizes.sum()


class TemperatureSampling(TaskSamplingStrategy):
    """p_t ∝ N_t^alpha: alpha = 1 is proportional, 0 is uniform, 0.5 is square-root sampling."""

    name = "temperature"

    def __init__(self, alpha: float = 0.5):
        self.alpha = check_float(alpha, "sampling_alpha", minimum=0.0)

    def probabilities(self, sizes, epoch, num_epochs):
        weights = sizes.astype(np.float64) ** self.alpha
        return weights / weights.sum()

    def config(self):
        return {"name": self.name, "alpha": self.alpha}


class SquareRootSampling(TemperatureSampling):
    name = "sqrt"

    def __init__(self):
        super().__init__(alpha=0.5)


class UniformSampling(TaskSamplingStrategy):
    name = "uniform"

    def probabilities(self, sizes, epoch, num_epochs):
        return np.full(len(sizes), 1.0 / len(sizes))


class RoundRobinSampling(UniformSampling):
    """Tasks in turn: row r of batch b is task (b * batch + r) mod T (heterogeneous), batch b is task b mod T."""

    name = "round_robin"

    def row_tasks(self, rng, batch_size, probs, batch_index):
        return (batch_index * batch_size + np.arange(batch_size)) % len(probs)

    def batch_task(self, rng, probs, batch_index):
        return batch_index % len(probs)


class AnnealedSampling(TaskSamplingStrategy):
    """PALs eq. 9: p_t ∝ N_t^alpha_e with alpha_e = 1 - (1 - min_alpha)(e - 1)/(E - 1) (min_alpha = 0.2 in the
    paper): proportional in the first epoch, close to uniform in the last."""

    name = "annealed"

    def __init__(self, min_alpha: float = 0.2):
        self.min_alpha = check_float(min_alpha, "annealed_min_alpha", minimum=0.0, maximum=1.0)

    def alpha(self, epoch: int, num_epochs: int) -> float:
        """`epoch` is 0-based here (the paper's e - 1)."""
        if num_epochs <= 1:
            return 1.0
        progress = min(epoch, num_epochs - 1) / (num_epochs - 1)
        return 1.0 - (1.0 - self.min_alpha) * progress

    def probabilities(self, sizes, epoch, num_epochs):
        weights = sizes.astype(np.float64) ** self.alpha(epoch, num_epochs)
        return weights / weights.sum()

    def config(self):
        return {"name": self.name, "min_alpha": self.min_alpha}


class ModelAwareSampling(TaskSamplingStrategy):
    """Base of strategies that choose training rows with the model (e.g. MT-Uncertainty, CA-MTL Algorithm 1).

    The batch sampler yields a candidate pool of `candidates_per_task` examples of every task (in task
    order); `select(model, inputs)` returns the batch to train on. Subclasses implement `select`.
    """

    model_aware = True

    def __init__(self, candidates_per_task: int | None = None):
        self.candidates_per_task = candidates_per_task

    def probabilities(self, sizes, epoch, num_epochs):
        return np.full(len(sizes), 1.0 / len(sizes))

    def select(self, model: torch.nn.Module, inputs: dict, batch_size: int, step: int) -> dict:
        raise NotImplementedError

    def state_dict(self) -> dict:
        """Whatever the strategy carries across steps (saved in checkpoints)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


TASK_SAMPLERS: dict[str, type[TaskSamplingStrategy]] = {
    "proportional": ProportionalSampling,
    "natural": ProportionalSampling,
    "temperature": TemperatureSampling,
    "sqrt": SquareRootSampling,
    "uniform": UniformSampling,
    "round_robin": RoundRobinSampling,
    "annealed": AnnealedSampling,
}


def register_task_sampler(name: str, cls: type[TaskSamplingStrategy], exist_ok: bool = False) -> None:
    """Add a strategy to the registry (what the CA-MTL family does for `uncertainty`)."""
    if not isinstance(cls, type) or not issubclass(cls, TaskSamplingStrategy):
        raise ValueError(f"A task sampler must subclass TaskSamplingStrategy, got {cls!r}.")
    if name in TASK_SAMPLERS and not exist_ok and TASK_SAMPLERS[name] is not cls:
        raise ValueError(f"Task sampler {name!r} is already registered ({TASK_SAMPLERS[name].__name__}).")
    TASK_SAMPLERS[name] = cls


def build_task_sampling(name: str, **options) -> TaskSamplingStrategy:
    """Instantiate strategy `name` with the options its constructor takes (others are ignored)."""
    cls = lookup(TASK_SAMPLERS, name, "task_sampling")
    import inspect

    accepted = inspect.signature(cls.__init__).parameters
    return cls(**{k: v for k, v in options.items() if k in accepted and v is not None})


class TaskBatchSampler(Sampler):
    """Yields lists of indices into the concatenation of the tasks' training sets (task 0 first).

    Args:
        task_sizes: examples per task, in task-id order.
        batch_size: rows per batch (examples; a multiple-choice example becomes several rows when collated).
        strategy: a `TaskSamplingStrategy`.
        batching: `"heterogeneous"` or `"homogeneous"`.
        num_batches: batches per epoch; defaults to one pass over all examples (`ceil(sum N / batch_size)`).
        seed: base seed; epoch e draws from `np.random.default_rng([seed, e])`.
        num_epochs: epochs the run will take (the annealed schedule needs it).
        task_names: for error messages.
    """

    def __init__(
        self,
        task_sizes: Sequence[int],
        batch_size: int,
        strategy: TaskSamplingStrategy,
        batching: str = "heterogeneous",
        num_batches: int | None = None,
        seed: int = 0,
        num_epochs: int = 1,
        task_names: Sequence[str] | None = None,
    ):
        names = list(task_names) if task_names is not None else [f"task {i}" for i in range(len(task_sizes))]
        if len(task_sizes) == 0:
            raise ValueError("The task sampler needs at least one task with training data.")
        for name, size in zip(names, task_sizes):
            if size <= 0:
                raise ValueError(f"Task {name!r} is in the sampler but has no training examples.")
        self.task_sizes = np.asarray(task_sizes, dtype=np.int64)
        self.task_names = names
        self.offsets = np.concatenate([[0], np.cumsum(self.task_sizes)[:-1]])
        self.batch_size = check_int(batch_size, "batch_size", minimum=1)
        self.strategy = strategy
        self.batching = check_choice(batching, BATCHING, "batching")
        total = int(self.task_sizes.sum())
        self.num_batches = (
            check_int(num_batches, "num_batches", minimum=1) if num_batches else math.ceil(total / batch_size)
        )
        self.seed = int(seed)
        self.num_epochs = max(1, int(num_epochs))
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.num_batches

    def probabilities(self, epoch: int | None = None) -> np.ndarray:
        epoch = self.epoch if epoch is None else epoch
        return self.strategy.probabilities(self.task_sizes, epoch, self.num_epochs)

    def epoch_batches(self, epoch: int):
        """The batches of `epoch` (a generator of index lists); depends on nothing but seed and epoch."""
        rng = np.random.default_rng([self.seed, epoch])
        probs = self.probabilities(epoch)
        orders: list[np.ndarray | None] = [None] * len(self.task_sizes)
        cursors = np.zeros(len(self.task_sizes), dtype=np.int64)

        def take(task: int, count: int) -> np.ndarray:
            out = []
            while count:
                if orders[task] is None or cursors[task] == self.task_sizes[task]:
                    orders[task] = rng.permutation(self.task_sizes[task])
                    cursors[task] = 0
                n = min(count, self.task_sizes[task] - cursors[task])
                out.append(orders[task][cursors[task] : cursors[task] + n])
                cursors[task] += n
                count -= n
            return self.offsets[task] + np.concatenate(out)

        num_tasks = len(self.task_sizes)
        for b in range(self.num_batches):
            if self.strategy.model_aware:
                per_task = self.strategy.candidates_per_task or self.batch_size
                tasks = np.repeat(np.arange(num_tasks), per_task)
            elif self.batching == "heterogeneous":
                tasks = np.asarray(self.strategy.row_tasks(rng, self.batch_size, probs, b))
            else:
                tasks = np.full(self.batch_size, self.strategy.batch_task(rng, probs, b))
            batch = np.empty(len(tasks), dtype=np.int64)
            for t in np.unique(tasks):
                where = np.nonzero(tasks == t)[0]
                batch[where] = take(int(t), len(where))
            yield batch.tolist()

    def __iter__(self):
        epoch = self.epoch
        yield from self.epoch_batches(epoch)
        # Advance by itself after a full pass; the Trainer's set_epoch (when it reaches us) agrees.
        self.epoch = epoch + 1

    def config(self) -> dict:
        """Everything that determines the batch sequence (saved in checkpoints, compared on resume)."""
        return {
            "strategy": self.strategy.config(),
            "batching": self.batching,
            "batch_size": self.batch_size,
            "num_batches": self.num_batches,
            "num_epochs": self.num_epochs,
            "seed": self.seed,
            "task_names": self.task_names,
            "task_sizes": self.task_sizes.tolist(),
        }
