"""Routing analytics during training (BertForTaskMoE's token routing, BartTaskRouted's task routing).

`RoutingAnalyticsCallback` keeps two `RoutingStatistics` of the training batches: a window since the last
log and the whole run. At every logging step `MultiTaskTrainer.log` adds the window's figures to the logs,
so they reach every `report_to` integration (TensorBoard, W&B, ...):

- `routing/<task>/L<layer>/expert<e>`: share of the task's tokens that expert e received in that layer
  (BartTaskRouted: `routing/<task>/E0/expert<e>`, `.../D0/...`, shares of the task's examples' routing weight),
- `routing/<task>/entropy`: routing entropy / log(experts), mean over layers (1 = even, 0 = one expert),
- `routing/<task>/unused_experts`: (layer, expert) pairs that received none of the task's tokens.

At each checkpoint and at the end of training it writes the whole run's `routing_train.json` and
`routing_train_heatmap.png` (into the checkpoint folder / `output_dir`); the model card links the heatmap.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import sys
import time
from collections.abc import Callable

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..analysis.routing import RoutingStatistics, layer_label, normalised_entropy, routed_layers

ROUTING_JSON = "routing_train.json"
ROUTING_HEATMAP = "routing_train_heatmap.png"


class RoutingAnalyticsCallback(TrainerCallback):
    """Per-task routing figures of the training batches in the logs, and a summary with every checkpoint."""

    def __init__(self, model, reduce=None):
        if routed_layers(model.config) is None:
            raise ValueError(
                "Routing analytics need a model with MoE layers, routed layers or gates (num_experts > 1); this model "
                "routes nothing."
            )
        self.window = RoutingStatistics(model)
        self.total = RoutingStatistics(model)
        # sums counts over ranks (the trainer passes accelerate's reduce); once per log, not once per step
        self.reduce = reduce or (lambda counts: counts)
        self._in_total = None
        self._hooks = []  # set by `add_to` (a plain Trainer): this callback records and logs by itself

    def add_to(self, trainer) -> RoutingAnalyticsCallback:
        """Use with a plain `transformers.Trainer` (e.g. for MMoEModel; `MultiTaskTrainer` does this itself
        with `log_routing=True`): forward hooks ask the model for `routing_counts` in training and record
        them, each training log gets the figures before the `report_to` integrations see it, and the summaries
        are written with the checkpoints. Returns the callback."""
        if self._hooks:
            raise ValueError("This RoutingAnalyticsCallback is already added to a trainer.")
        model = trainer.model

        def ask(module, args, kwargs):
            return (args, {**kwargs, "output_router_logits": True}) if module.training else None

        def record(module, args, kwargs, output):
            if module.training:
                self.record(output["routing_counts"])

        self._hooks = [model.register_forward_pre_hook(ask, with_kwargs=True),
                       model.register_forward_hook(record, with_kwargs=True)]
        self.reduce = lambda counts: trainer.accelerator.reduce(counts, "sum")
        trainer.callback_handler.callbacks.insert(0, self)  # before the integrations' on_log
        return self

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._hooks and logs is not None and "loss" in logs:  # a training log of a plain Trainer
            figures = self.pop_metrics()
            logs.update(figures)
            if state.log_history:
                state.log_history[-1].update(figures)

    def record(self, routing_counts) -> None:
        """Add one training batch's `(layers, tasks, experts)` counts of this rank."""
        self.window.update(routing_counts)

    def _sync_total(self):
        """Sum the window over ranks and bring the run's total up to date with it; return the summed window
        (None when nothing was recorded). Every rank must call it: the sum is a collective."""
        if self.window.counts is None:
            return None
        summed = self.reduce(self.window.counts).cpu()
        added = self._in_total if self._in_total is not None else 0  # part of this window a checkpoint already added
        self.total.update(summed - added)
        self._in_total = summed
        return summed

    def pop_metrics(self) -> dict[str, float]:
        """The window's figures (summed over ranks) as flat log keys; the window starts afresh."""
        summed = self._sync_total()
        if summed is None:
            return {}
        stats = self.window
        stats.counts = summed
        shares, unused, tokens = stats.shares, stats.unused_experts, stats.tokens
        entropy = normalised_entropy(stats)
        logs = {}
        for t, task in enumerate(stats.task_names):
            if float(tokens[:, t].sum()) == 0:
                continue  # the task had no batch in this window
            for i, layer in enumerate(stats.layers):
                for e in range(stats.num_experts):
                    logs[f"routing/{task}/{layer_label(layer)}/expert{e}"] = round(float(shares[i, t, e]), 4)
            logs[f"routing/{task}/entropy"] = round(float(entropy[:, t].mean()), 4)
            logs[f"routing/{task}/unused_experts"] = int(unused[:, t].sum())
        stats.reset()
        self._in_total = None
        return logs

    def write_summary(self, folder: str) -> str | None:
        """`routing_train.json` and the heatmap of the whole run so far into `folder`; returns the PNG name."""
        if self.total.counts is None or not os.path.isdir(folder):
            return None
        self.total.save_json(os.path.join(folder, ROUTING_JSON))
        self.total.plot(
            os.path.join(folder, ROUTING_HEATMAP), title=f"Share of each task's training {self.total.unit} per expert"
        )
        return ROUTING_HEATMAP

    def on_save(self, args, state, control, **kwargs):
        self._sync_total()  # the steps since the last log belong in the summary too
        if state.is_world_process_zero:
            self.write_summary(os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"))

    def on_train_end(self, args, state, control, **kwargs):
        self._sync_total()  # the steps since the last log belong in the summary too
        if state.is_world_process_zero:
            os.makedirs(args.output_dir, exist_ok=True)
            self.write_summary(args.output_dir)


PROGRESS_JSON = "training_progress.json"


class TrainingProgressCallback(TrainerCallback):
    """Training examples per task and training seconds counted over the whole run, across resumes.

    `Trainer` restarts its clock and the trainer's per-task counts on resume, so a resumed run would report only the
    part after the checkpoint. This callback writes the totals so far into every checkpoint (`training_progress.json`)
    and `resume_from(checkpoint)` reads them back before `train(resume_from_checkpoint=...)`, so `totals()` covers
    the run from its first step. `examples_seen` is a function giving this run's counts
    (`MultiTaskTrainer.examples_seen`)."""

    def __init__(self, examples_seen: Callable[[], dict[str, int]]):
        self.examples_seen = examples_seen
        self.examples_before: dict[str, int] = {}
        self.seconds_before = 0.0
        self.resumed_from: str | None = None
        self.complete = True  # False when a checkpoint resumed from holds no totals (older or cut-off checkpoint)
        self._started: float | None = None
        self._seconds = 0.0

    def resume_from(self, checkpoint: str) -> bool:
        """Start from the totals recorded in `checkpoint`; returns False (and counts from the checkpoint on) when it
        holds none."""
        self.resumed_from = checkpoint
        path = os.path.join(checkpoint, PROGRESS_JSON)
        try:
            with open(path) as f:
                saved = json.load(f)
            self.examples_before = {str(k): int(v) for k, v in saved["examples_seen"].items()}
            self.seconds_before = float(saved["train_seconds"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            self.complete = False
            return False
        return True

    def _this_run_seconds(self) -> float:
        return self._seconds + (time.time() - self._started if self._started is not None else 0.0)

    def totals(self) -> dict:
        """`{"examples_seen": {task: n}, "train_seconds": s, "train_seconds_this_run": s, "resumed_from": path or
        None, "complete": bool}`; `complete` is False when a resumed checkpoint held no totals (the figures then
        start at that checkpoint)."""
        now = self.examples_seen()
        this_run = self._this_run_seconds()
        return {
            "examples_seen": {t: self.examples_before.get(t, 0) + n for t, n in now.items()},
            "train_seconds": round(self.seconds_before + this_run, 3),
            "train_seconds_this_run": round(this_run, 3),
            "resumed_from": self.resumed_from,
            "complete": self.complete,
        }

    def on_train_begin(self, args, state, control, **kwargs):
        self._started = time.time()

    def on_train_end(self, args, state, control, **kwargs):
        if self._started is not None:
            self._seconds += time.time() - self._started
            self._started = None

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            if os.path.isdir(folder):
                totals = self.totals()
                with open(os.path.join(folder, PROGRESS_JSON), "w") as f:
                    json.dump({"examples_seen": totals["examples_seen"], "train_seconds": totals["train_seconds"]}, f)


def glibc_malloc_trim():
    """glibc's `malloc_trim`, or None where the C library is not glibc (macOS, musl, Windows)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


class ReleaseFreedMemoryCallback(TrainerCallback):
    """Every `every` optimizer steps, `malloc_trim(0)`: glibc returns the free pages of its heaps to the OS.

    MT-TaG's sorted-loop dispatch allocates each expert's activations at that step's token count (0.4-1.5 MB
    blocks of a different size every step); glibc keeps such freed blocks in its heap, and on the demo the peak
    resident memory grew to 1.9x MT-Dense's. Trimming keeps it near what the tensors need, but the next step
    faults the returned pages back in (`benchmarks/memory.py` measures both). CPU training only
    (`release_freed_memory_every`, off by default)."""

    def __init__(self, trim, every: int):
        self.trim = trim
        self.every = every

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0:
            self.trim(0)
