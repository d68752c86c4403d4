"""`MultiTaskTrainer`: the transformers `Trainer` on a dict of per-task datasets.

Overridden public hooks only: the training dataloader (task sampler + mixed-task collation), the loss
(model-aware sampling, per-task loss tracking), the prediction step (per-example labels), `evaluate`
(every task with its own metrics, plus aggregates), `log` (per-task training losses) and `train`
(sampler state on resume). The task sampler's state goes into every checkpoint through a callback; the checkpoint
folders are read and checked in `checkpoints.py`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import ProcessorMixin, ProgressCallback, Trainer, TrainingArguments
from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import EvalPrediction, speed_metrics

from ..contract import UNDECLARED, parameter_roles_of
from ..layers.heads import PresentTasks
from ..layers.task_head import IGNORE_INDEX
from ..metrics import aggregate_scores, check_metric_names, task_score
from ..problem_types import TEXT_TO_TEXT, compute_task_metrics, problem_type_of
from ..problem_types.base import mixture_label_width
from ..problem_types.seq2seq import CAUSAL_LAYOUT, text_to_text_layout
from ..tasks import TaskSpec
from .arguments import MultiTaskTrainingArguments
from .batches import BatchChecker, HostCheckedCollator, MultiTaskCollator
from .callbacks import ReleaseFreedMemoryCallback, RoutingAnalyticsCallback, glibc_malloc_trim
from .checkpoints import (
    SAMPLER_STATE_NAME,
    TRAINER_STATE_NAME,
    TaskSamplerCheckpointCallback,
    latest_complete_checkpoint,
    missing_checkpoint_files,
    unreadable_checkpoint_files,
)
from .data import MultiTaskDataset, read_rows
from .freezing import freeze_shared_parameters
from .samplers import TaskBatchSampler, build_task_sampling
from .sharding import enable_fsdp_on_cpu, is_sharded, prepare_sharding, zero_unused_gradients_under_fsdp

logger = logging.getLogger(__name__)


class TaskView(torch.utils.data.Dataset):
    """One task's dataset with its `task_ids` filled in on every row (so user datasets need no such column)."""

    def __init__(self, dataset, task_id: int):
        self.dataset = dataset
        self.task_id = task_id

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        return {**self.dataset[index], "task_ids": self.task_id}

    def __getitems__(self, indices):
        return [{**row, "task_ids": self.task_id} for row in read_rows(self.dataset, indices)]


class TaskLossTracker:
    """Running per-task training losses between two logging steps (kept on device until logged).

    Under DDP each rank sees other tasks; the sums and counts of *all* tasks are reduced as one vector in
    task order, so every rank takes part in the same single collective."""

    def __init__(self, task_names: list[str]):
        self.task_names = list(task_names)
        self.sums: torch.Tensor | None = None  # (tasks,)
        self.counts: torch.Tensor | None = None  # (tasks,)

    def update(self, task_losses: dict[str, torch.Tensor] | PresentTasks) -> None:
        """Add one step's per-task losses: a dict of the tasks present, or the `PresentTasks` of a sync-free forward
        (a loss for every task and which are present, added on the device without reading back which)."""
        if isinstance(task_losses, PresentTasks):
            losses, present = task_losses.stacked()  # (tasks,) each, in the model's task order
            self._start(losses.device)
            order = torch.tensor([self.task_names.index(n) for n in task_losses.names], device=losses.device)
            self.sums.index_add_(0, order, losses.detach().float() * present)
            self.counts.index_add_(0, order, present.float())
            return
        if not task_losses:
            return
        self._start(next(iter(task_losses.values())).device)
        for name, loss in task_losses.items():
            i = self.task_names.index(name)
            self.sums[i] += loss.detach().float()
            self.counts[i] += 1

    def _start(self, device) -> None:
        if self.sums is None:
            self.sums = torch.zeros(len(self.task_names), device=device)
            self.counts = torch.zeros(len(self.task_names), device=device)

    def pop_means(self, accelerator=None) -> dict[str, float]:
        sums, counts = self.sums, self.counts
        if accelerator is not None and accelerator.num_processes > 1:
            if sums is None:  # this rank logged no loss yet: still join the collective
                sums = torch.zeros(len(self.task_names), device=accelerator.device)
                counts = torch.zeros_like(sums)
            sums, counts = accelerator.reduce(torch.stack([sums, counts]), "sum")
        self.sums = self.counts = None
        if sums is None:
            return {}
        return {
            name: round((sums[i] / counts[i]).item(), 4) for i, name in enumerate(self.task_names) if counts[i] > 0
        }


SPECIAL_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")


def carry_dense_special_tokens(model, tokenizer) -> None:
    """Give a backbone-generic family's config each PAD/BOS/EOS id that its dense config (`dense_config`) and the
    tokenizer agree on, where the family's config names none itself.

    `Trainer.train` aligns the tokenizer's special token ids with `model.config.get_text_config()` and warns ("The
    tokenizer has new PAD/BOS/EOS tokens ...") wherever that config does not hold them. Ours does not: the ids live
    in the dense config, so the warning would report as new the ids the tokenizer and the dense model already share,
    on every non-BERT run, and there would be nothing for the user to do. Only agreed ids are copied: where the
    tokenizer differs from the dense model (or defines no such token, which transformers before 5.24 also reports),
    the family's config stays as it was and transformers aligns and warns as it would."""
    if isinstance(tokenizer, ProcessorMixin):
        tokenizer = tokenizer.tokenizer
    config = getattr(model, "config", None)
    dense = getattr(config, "dense_config", None)
    if tokenizer is None or dense is None or not hasattr(config, "get_text_config"):
        return
    text = config.get_text_config()
    for name in SPECIAL_TOKEN_IDS:
        ours = getattr(dense, name, None)
        if getattr(text, name, None) is None and ours is not None and ours == getattr(tokenizer, name, None):
            setattr(text, name, ours)


class MultiTaskTrainer(Trainer):
    """`Trainer` for multi-task models.

    Args:
        model: a multi-task model (its `config.tasks` gives task names and ids).
        args: `MultiTaskTrainingArguments`.
        train_dataset: `{task_name: tokenised dataset}`; rows need no `task_ids` column.
        eval_dataset: `{task_name: tokenised dataset}`; each is evaluated with its task's metrics.
        compute_metrics: optional `fn(task: TaskSpec, EvalPrediction) -> dict` adding metrics of your own.
        tasks: the `TaskSpec`s, when the model does not carry them (defaults to `model.config.task_specs`).
        Other arguments are `Trainer`'s.
    """

    def __init__(
        self,
        model=None,
        args: TrainingArguments | None = None,
        train_dataset: dict | None = None,
        eval_dataset: dict | None = None,
        data_collator: Callable | None = None,
        compute_metrics: Callable[[TaskSpec, EvalPrediction], dict] | None = None,
        tasks: list[TaskSpec] | None = None,
        **kwargs,
    ):
        if args is None:
            args = MultiTaskTrainingArguments(output_dir="trainer_output")
        elif not isinstance(args, MultiTaskTrainingArguments):
            raise ValueError(
                "MultiTaskTrainer needs `MultiTaskTrainingArguments` (TrainingArguments plus task sampling), got "
                f"{type(args).__name__}."
            )
        if tasks is None:
            config = getattr(model, "config", None)
            if config is None or not hasattr(config, "task_specs"):
                raise ValueError("Pass `tasks=[TaskSpec, ...]`: the model's config does not list its tasks.")
            tasks = config.task_specs
        self.tasks = [TaskSpec.from_dict(t) for t in tasks]
        self.task_ids = {t.name: i for i, t in enumerate(self.tasks)}
        check_metric_names(self.tasks, args.trust_remote_metrics)  # metric names are data: no code runs from them

        self.task_train_sets = self._check_task_dict(train_dataset, "train_dataset")
        self.task_eval_sets = self._check_task_dict(eval_dataset, "eval_dataset")
        train = None
        if self.task_train_sets:
            views = self._task_views(self.task_train_sets)
            train = MultiTaskDataset(list(views.values()), list(views))
        evals = self._task_views(self.task_eval_sets) or None

        if data_collator is None:
            pad = getattr(getattr(model, "config", None), "pad_token_id", None)
            # one labels dtype for every batch of the mixture, whatever its mix (a compiled step's graph keys on it)
            float_labels = any(problem_type_of(t).float_labels for t in self.tasks)
            # and one labels width: a batch without a multi-label row is padded to the multi-label task's width too
            data_collator = MultiTaskCollator(pad_token_id=pad if pad is not None else 0, float_labels=float_labels,
                                              label_width=mixture_label_width(self.tasks))
        #: every batch's task ids and labels are checked on the CPU by the collator, which marks the batch
        #: `values_checked=True` and gives its rows per task (`task_counts`): the forward passes skip the value
        #: checks' host syncs and split the batch among the heads without one (models of this library only). Not the
        #: counts under `nn.DataParallel` (`n_gpu > 1` without distributed training), which splits each batch again
        self._checked_on_host = hasattr(getattr(model, "config", None), "tasks") and hasattr(model, "task_ids_for")
        if self._checked_on_host and not isinstance(data_collator, HostCheckedCollator):
            data_collator = HostCheckedCollator(
                data_collator, BatchChecker.for_model(model, counts_tasks=args.n_gpu <= 1)
            )
        prepare_sharding(model, args)  # FSDP2's units from the family's declarations; ZeRO-3 checked
        super().__init__(
            model=model, args=args, train_dataset=train, eval_dataset=evals, data_collator=data_collator, **kwargs
        )
        self.task_compute_metrics = compute_metrics
        #: set to a `RoutingStatistics` to record expert use during evaluation (MoE families)
        self.routing_statistics = None
        self.routing_heatmap: str | None = None
        self._task_losses = TaskLossTracker([t.name for t in self.tasks])
        self._examples_seen: torch.Tensor | None = None  # (tasks,) training rows per task, kept on device
        self._trainable: list | None = None  # the parameters `_touch_every_parameter` keeps in the graph
        self.task_sampler = self._build_task_sampler() if train is not None else None
        self.add_callback(TaskSamplerCheckpointCallback(self))
        #: `RoutingAnalyticsCallback` when `args.log_routing` (routing of the training batches)
        self.routing_analytics = None
        if args.log_routing:
            self.routing_analytics = RoutingAnalyticsCallback(
                self.model, reduce=lambda t: self.accelerator.reduce(t, "sum")
            )
            self.add_callback(self.routing_analytics)
        trim = glibc_malloc_trim() if args.release_freed_memory_every > 0 and args.device.type == "cpu" else None
        if trim is not None:
            self.add_callback(ReleaseFreedMemoryCallback(trim, args.release_freed_memory_every))
        if args.train_task_specific_only:
            counts = freeze_shared_parameters(self.model)
            logger.info(f"Training task-specific parameters only: {counts}")

    def create_accelerator_and_postprocess(self):
        """`Trainer`'s, then FSDP2 on the CPU (gloo) where accelerate would fall back to DDP without a word: see
        `sharding.enable_fsdp_on_cpu`."""
        super().create_accelerator_and_postprocess()
        if enable_fsdp_on_cpu(self.accelerator, self.args):
            self.is_fsdp_enabled = True

    # ------------------------------------------------------------------ inputs
    def _check_task_dict(self, datasets: dict | None, field: str) -> dict:
        if datasets is None:
            return {}
        if not isinstance(datasets, dict):
            if len(self.tasks) == 1:
                return {self.tasks[0].name: datasets}
            raise ValueError(
                f"`{field}` must be a dict {{task_name: dataset}} for a model with {len(self.tasks)} tasks."
            )
        for name, dataset in datasets.items():
            if name not in self.task_ids:
                raise ValueError(f"`{field}` has unknown task {name!r}; the model's tasks are {list(self.task_ids)}.")
            if dataset is None or len(dataset) == 0:
                raise ValueError(f"`{field}[{name!r}]` is empty: task {name!r} has no examples.")
        # task-id order, so that the concatenation and the sampler list tasks like the model does
        return {name: datasets[name] for name in self.task_ids if name in datasets}

    def _task_views(self, datasets: dict) -> dict:
        """`{task: TaskView}`: each dataset with its task id filled in on every row."""
        return {name: TaskView(dataset, self.task_ids[name]) for name, dataset in datasets.items()}

    def _build_task_sampler(self) -> TaskBatchSampler:
        args = self.args
        names = list(self.task_train_sets)
        sizes = [len(self.task_train_sets[n]) for n in names]
        batch_size = args.per_device_train_batch_size * max(1, args.n_gpu)
        world = max(1, args.world_size)
        if args.steps_per_epoch:
            num_batches = args.steps_per_epoch * args.gradient_accumulation_steps * world
        elif args.training_proportion:
            num_batches = max(1, math.ceil(args.training_proportion * sum(sizes) / batch_size))
        else:
            num_batches = math.ceil(sum(sizes) / batch_size)
        if args.max_steps and args.max_steps > 0:
            num_epochs = math.ceil(args.max_steps * args.gradient_accumulation_steps * world / num_batches)
        else:
            num_epochs = math.ceil(args.num_train_epochs)
        seed = args.data_seed if args.data_seed is not None else args.seed
        strategy = build_task_sampling(
            args.task_sampling, alpha=args.sampling_alpha, min_alpha=args.annealed_min_alpha,
            candidates_per_task=args.uncertainty_candidates_per_task, score_every=args.uncertainty_score_every,
            regression_uncertainty=args.uncertainty_regression, seed=seed,
        )
        return TaskBatchSampler(
            task_sizes=sizes,
            batch_size=batch_size,
            strategy=strategy,
            batching=args.batching,
            num_batches=num_batches,
            seed=seed,
            num_epochs=num_epochs,
            task_names=names,
        )

    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError("MultiTaskTrainer: training needs `train_dataset={task_name: dataset}`.")
        dataloader = DataLoader(
            self.train_dataset,
            batch_sampler=self.task_sampler,
            collate_fn=self.data_collator,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
            persistent_workers=self.args.dataloader_persistent_workers and self.args.dataloader_num_workers > 0,
        )
        return self.accelerator.prepare(dataloader)

    # ------------------------------------------------------------------ training
    def create_optimizer(self, model=None):
        """`Trainer`'s optimizer, with one learning rate per parameter role when `args.group_learning_rates`
        is set (the roles of the model's `parameter_roles`, e.g. BartTaskRouted's router and task embeddings)."""
        rates = self.args.group_learning_rates
        if self.optimizer is not None or not rates:
            return super().create_optimizer(model)
        opt_model = self.model if model is None else model
        roles = parameter_roles_of(self.accelerator.unwrap_model(opt_model)).roles
        unknown = sorted(set(rates) - set(roles))
        if unknown:
            raise ValueError(
                f"`group_learning_rates` names {unknown}, which {type(opt_model).__name__} does not have; its "
                "parameter "
                f"roles are {sorted(roles)}."
            )
        patterns = {role: re.compile(roles[role]) for role in rates}
        decay = set(self.get_decay_parameter_names(opt_model))
        groups: dict[tuple[float, float], list] = {}
        for name, param in opt_model.named_parameters():
            if not param.requires_grad:
                continue
            role = next((r for r, pattern in patterns.items() if pattern.search(name)), None)
            key = (rates[role] if role else self.args.learning_rate, self.args.weight_decay if name in decay else 0.0)
            groups.setdefault(key, []).append(param)
        optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
        optimizer_kwargs.pop("lr", None)
        self.optimizer = optimizer_cls(
            [{"params": params, "lr": lr, "weight_decay": wd} for (lr, wd), params in groups.items()],
            lr=self.args.learning_rate,
            **optimizer_kwargs,
        )
        return self.optimizer

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training:  # step-dependent model state (BartTaskRouted: Gumbel temperature annealing)
            hook = getattr(self.accelerator.unwrap_model(model), "set_training_step", None)  # any module trains
            if hook is not None:
                hook(self.state.global_step)
        strategy = self.task_sampler.strategy if self.task_sampler is not None else None
        if model.training and strategy is not None and strategy.model_aware:
            # a sampler sees tensors only; the rows it keeps were checked with the pool (but counted anew: the pool's
            # task counts are not the kept rows')
            inputs.pop("task_counts", None)
            checked = {"values_checked": inputs.pop("values_checked")} if "values_checked" in inputs else {}
            inputs = {**strategy.select(model, inputs, self.args.per_device_train_batch_size, self.state.global_step),
                      **checked}
        if model.training:
            counts = torch.bincount(inputs["task_ids"], minlength=len(self.tasks))
            self._examples_seen = counts if self._examples_seen is None else self._examples_seen + counts
        record_routing = model.training and self.routing_analytics is not None
        outputs = model(**inputs, **({"output_router_logits": True} if record_routing else {}))
        if record_routing:
            self.routing_analytics.record(outputs.routing_counts)
        if model.training and getattr(outputs, "task_losses", None) is not None:  # (its truth would be a host read)
            self._task_losses.update(outputs.task_losses)
        loss = outputs.loss
        if model.training and loss is not None and self.args.world_size > 1 and is_sharded(self, model):
            # the parameters are shards here, not to be touched: FSDP2 reduce-scatters zeros for the idle ones;
            # under ZeRO-3 every head runs (`sharding.run_every_task`), and a family with other idle modules is refused
            zero_unused_gradients_under_fsdp(model)
        elif (
            model.training
            and loss is not None
            and self.args.world_size > 1
            and not self.args.ddp_find_unused_parameters
        ):
            # (with find_unused_parameters=True DDP marks the idle parameters ready itself; touching them too would
            # mark them twice: "Expected to mark a variable ready only once")
            loss = loss + self._touch_every_parameter(model)
        return (loss, outputs) if return_outputs else loss

    def _touch_every_parameter(self, model) -> torch.Tensor:
        """0 times one element of every trainable parameter that can sit out a step: the heads, PALs or routed
        experts of tasks absent from this rank's batch then take part in the backward pass (with zero gradients), so
        every rank reduces the same gradients each step -- what DDP with a static graph (`find_unused_parameters=False`)
        and DeepSpeed's gradient buckets require. Only with more than one process.

        Each touched parameter receives a full-size zero gradient in the backward pass, so only those a family
        declares possibly idle (the `possibly_idle` roles of its `parameter_roles`) are touched; a model that declares
        no roles has every trainable parameter touched."""
        if self._trainable is None:
            core = self.accelerator.unwrap_model(model)
            roles = parameter_roles_of(core)
            patterns = [re.compile(p) for p in ((r"",) if roles is UNDECLARED else roles.possibly_idle_patterns)]
            self._trainable = [
                p for n, p in core.named_parameters() if p.requires_grad and any(r.search(n) for r in patterns)
            ]
        if not self._trainable:
            return torch.zeros((), device=self.args.device)
        return 0.0 * torch.stack([p.view(-1)[0].float() for p in self._trainable]).sum()

    def examples_seen(self) -> dict[str, int]:
        """Training examples each task contributed so far on this process (multiple-choice tasks: rows / choices)."""
        if self._examples_seen is None:
            return {t.name: 0 for t in self.tasks}
        counts = self._examples_seen.tolist()
        return {t.name: counts[i] // (t.num_choices or 1) for i, t in enumerate(self.tasks)}

    def precision_used(self) -> str:
        """The precision training really ran in: fp16/bf16 only when the Trainer's accelerator applied it."""
        mixed = getattr(self.accelerator, "mixed_precision", "no")
        return {"fp16": "fp16 (mixed)", "bf16": "bf16 (mixed)"}.get(str(mixed), "fp32")

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # a training log: add each task's mean loss since the last one
            logs.update(
                {f"{name}_loss": value for name, value in self._task_losses.pop_means(self.accelerator).items()}
            )
            if self.routing_analytics is not None:
                logs.update(self.routing_analytics.pop_metrics())
            strategy = self.task_sampler.strategy if self.task_sampler is not None else None
            if hasattr(strategy, "pop_metrics"):  # MT-Uncertainty: each task's share of the chosen examples
                logs.update(strategy.pop_metrics(list(self.model.config.task_names)))
        super().log(logs, start_time)

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs):
        """`Trainer.train`; `resume_from_checkpoint` may be a folder, True or `"latest"` (the last checkpoint in
        `output_dir`). A checkpoint without its optimizer, scheduler or RNG state would not continue the same run
        (the optimizer would restart): it is refused, naming what is missing, unless
        `args.resume_incomplete_checkpoint`."""
        checkpoint = resume_from_checkpoint
        if checkpoint is True or (isinstance(checkpoint, str) and checkpoint.lower() == "latest"):
            checkpoint = latest_complete_checkpoint(self.args.output_dir)
            if checkpoint is None:
                raise ValueError(f"No complete checkpoint found in output_dir ({self.args.output_dir}) to resume from.")
        if checkpoint:
            self._check_checkpoint(checkpoint)
        if checkpoint and self.task_sampler is not None:
            self._restore_task_sampler(checkpoint)
        carry_dense_special_tokens(self.model, self.processing_class)
        return super().train(resume_from_checkpoint=checkpoint or None, **kwargs)

    def _check_checkpoint(self, checkpoint: str) -> None:
        if not os.path.isdir(checkpoint):
            raise ValueError(f"Checkpoint folder {checkpoint} does not exist.")
        broken = unreadable_checkpoint_files(checkpoint)
        if broken:
            raise ValueError(
                f"Checkpoint {checkpoint} cannot be resumed: {'; '.join(broken)}. Resume from an earlier checkpoint "
                f"(--resume_from_checkpoint latest takes the newest complete one), or start the run afresh."
            )
        missing = missing_checkpoint_files(checkpoint)
        essential = {"model weights", TRAINER_STATE_NAME}
        if missing and not (self.args.resume_incomplete_checkpoint and not essential & set(missing)):
            raise ValueError(
                f"Checkpoint {checkpoint} is incomplete: {', '.join(missing)} missing, so training would not continue "
                "the "
                "same run (the optimizer and learning-rate schedule would restart). Resume from a complete checkpoint, "
                "or "
                "set `resume_incomplete_checkpoint=True` (--resume_incomplete_checkpoint) to continue anyway."
            )
        if missing:
            logger.warning(
                f"Resuming from the incomplete checkpoint {checkpoint} ({', '.join(missing)} missing), as asked."
            )

    def _restore_task_sampler(self, checkpoint: str) -> None:
        """Check the checkpoint's sampler matches this run and put the sampler on the epoch training resumes in."""
        path = os.path.join(checkpoint, SAMPLER_STATE_NAME)
        if os.path.exists(path):
            with open(path) as f:
                saved = json.load(f)
            current = self.task_sampler.config()
            differs = sorted(k for k in set(saved["config"]) | set(current) if saved["config"].get(k) != current.get(k))
            if differs:
                raise ValueError(
                    f"Checkpoint {checkpoint} was trained with another task sampler configuration ({differs} differ: "
                    f"saved {[saved['config'].get(k) for k in differs]}, now {[current.get(k) for k in differs]}); "
                    "resuming would not continue the same batch sequence."
                )
            if hasattr(self.task_sampler.strategy, "load_state_dict"):
                self.task_sampler.strategy.load_state_dict(saved.get("strategy_state", {}))
        else:
            logger.warning(f"{checkpoint} holds no {SAMPLER_STATE_NAME}; the resumed batch sequence may differ.")
        state = TrainerState.load_from_json(os.path.join(checkpoint, TRAINER_STATE_NAME))
        batches = len(self.get_train_dataloader())
        ga = self.args.gradient_accumulation_steps
        updates_per_epoch = max(batches // ga + int(batches % ga > 0), 1)  # as Trainer counts them
        self.task_sampler.set_epoch(state.global_step // updates_per_epoch)

    # ------------------------------------------------------------------ evaluation
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        labels = inputs.get("labels")
        task = self.tasks[int(inputs["task_ids"][0])]
        kind = problem_type_of(task)
        if TEXT_TO_TEXT in kind.capabilities and not prediction_loss_only:
            return self._seq2seq_prediction_step(model, inputs, labels)
        with torch.no_grad(), self.compute_loss_context_manager():
            outputs = model(**inputs, **self._routing_flags())
        self._record_eval_routing(outputs)
        loss = outputs.loss.detach() if labels is not None and outputs.loss is not None else None
        if prediction_loss_only:
            return loss, None, None
        logits = outputs.logits
        by_task = getattr(outputs, "task_logits", None)
        if logits is None and by_task is not None and set(by_task) == {task.name}:
            logits = by_task[task.name]  # a sync-free forward gives no `logits` when its tasks' logit shapes differ
        if logits is None:
            raise ValueError("An evaluation batch must hold rows of one task (evaluate each task's set on its own).")
        if labels is not None:
            labels = kind.own_labels(task, labels)  # without the mixture's -100 columns (`label_width`)
            labels = kind.eval_labels(task, labels)  # e.g. multiple choice: one label per example, not per choice row
        return loss, logits.detach(), labels

    def _seq2seq_prediction_step(self, model, inputs, labels):
        """Loss (teacher-forced) and predicted target tokens: `generate()`'s with `predict_with_generate`, else the
        arg-max of the teacher-forced logits at the target positions (ids, not logits: evaluation gathers them over
        the whole set), lined up with the targets.

        How they line up depends on the layout the model declares (`text_to_text_layout`): an encoder-decoder's
        generated tokens follow the decoder start token, its logit at position t predicts label t; a causal LM's
        rows hold prompt and target (labels -100 on the prompt), so it generates from the prompt alone (the target's
        positions masked out; its `generate` left-aligns the rows), its predictions are the tokens generated after
        the input, and its logit at position t predicts label t + 1 (the labels returned are shifted to match)."""
        flags = self._routing_flags()
        causal = text_to_text_layout(self.accelerator.unwrap_model(model)) == CAUSAL_LAYOUT
        if causal and labels is not None and labels.shape[1] < inputs["input_ids"].shape[1]:
            # inputs padded further than their labels (`pad_to_multiple_of`): no target there
            labels = torch.nn.functional.pad(labels, (0, inputs["input_ids"].shape[1] - labels.shape[1]),
                                             value=IGNORE_INDEX)
        with torch.no_grad(), self.compute_loss_context_manager():
            needed = labels is not None or flags or not self.args.predict_with_generate
            outputs = model(**inputs, **flags) if needed else None
            if self.args.predict_with_generate:
                unwrapped = self.accelerator.unwrap_model(model)
                length = {"max_new_tokens": self.args.generation_max_length} if self.args.generation_max_length else {}
                attention_mask = inputs.get("attention_mask")
                if causal and labels is not None:  # the prompt alone: the target the row carries is masked out
                    if attention_mask is None:
                        attention_mask = torch.ones_like(inputs["input_ids"])
                    attention_mask = attention_mask * (labels == IGNORE_INDEX).to(attention_mask.dtype)
                generated = unwrapped.generate(
                    input_ids=inputs["input_ids"],
                    attention_mask=attention_mask,
                    task_ids=inputs["task_ids"],
                    num_beams=self.args.generation_num_beams,
                    do_sample=False,
                    **length,
                )
                # a causal LM returns its input first; an encoder-decoder's position 0 is the decoder start token
                predictions = generated[:, inputs["input_ids"].shape[1]:] if causal else generated[:, 1:]
            else:
                logits = outputs.logits[:, :-1] if causal else outputs.logits
                if causal and labels is not None:
                    labels = labels[:, 1:]  # the token each position predicts
                predictions = logits.argmax(-1)
                if labels is not None:
                    predictions = predictions.masked_fill(labels == IGNORE_INDEX, IGNORE_INDEX)
        if outputs is not None:
            self._record_eval_routing(outputs)
        loss = outputs.loss.detach() if outputs is not None and outputs.loss is not None else None
        return loss, predictions, labels

    def _routing_flags(self) -> dict:
        return {"output_router_logits": True} if self.routing_statistics is not None else {}

    def _record_eval_routing(self, outputs) -> None:
        """Add an evaluation batch's routing to `routing_statistics` (when set and the model routes)."""
        if self.routing_statistics is not None and getattr(outputs, "routing_counts", None) is not None:
            self.routing_statistics.update(self.accelerator.reduce(outputs.routing_counts, "sum"))

    def _eval_sets(self, eval_dataset) -> dict:
        if eval_dataset is None:
            if not self.eval_dataset:
                raise ValueError("MultiTaskTrainer: evaluation needs `eval_dataset={task_name: dataset}`.")
            return self.eval_dataset
        if isinstance(eval_dataset, str):
            if eval_dataset not in self.eval_dataset:
                raise ValueError(f"No evaluation set for task {eval_dataset!r}; there are {list(self.eval_dataset)}.")
            return {eval_dataset: self.eval_dataset[eval_dataset]}
        return self._task_views(self._check_task_dict(eval_dataset, "eval_dataset"))

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Evaluate every task on its own set with its own metrics (`{prefix}_{task}_{metric}`), then the
        aggregates `{prefix}_average` and `{prefix}_small_tasks_average`.

        With `bf16_full_eval` / `fp16_full_eval` transformers casts the model itself to half precision for the
        evaluation and leaves it so; here the weights are put back as they were afterwards (kept on the CPU during
        the evaluation), so training and saving go on in the training dtype."""
        with self._restore_weights_after_half_precision_eval():
            return self._evaluate_tasks(eval_dataset, ignore_keys, metric_key_prefix)

    @contextlib.contextmanager
    def _restore_weights_after_half_precision_eval(self):
        model = self.model
        if not (self.args.bf16_full_eval or self.args.fp16_full_eval) or model is None:
            yield
            return
        saved = {
            name: t.detach().to("cpu", copy=True) for name, t in model.state_dict().items() if t.is_floating_point()
        }
        dtypes = {t.dtype for t in saved.values()}
        try:
            yield
        finally:
            with torch.no_grad():
                if len(dtypes) == 1:
                    model.to(dtype=dtypes.pop())  # the half-precision cast is undone, then the exact values return
                state = model.state_dict()
                for name, original in saved.items():
                    state[name].copy_(original)

    def _evaluate_tasks(self, eval_dataset, ignore_keys, metric_key_prefix) -> dict[str, float]:
        sets = self._eval_sets(eval_dataset)
        start, num_samples = time.time(), 0
        metrics: dict[str, float] = {}
        scores: dict[str, float] = {}
        for name, dataset in sets.items():
            output, task_metrics = self._run_task(
                name, dataset, f"{metric_key_prefix}_{name}", "Evaluation", ignore_keys
            )
            num_samples += output.num_samples
            metrics.update(output.metrics)
            if task_metrics and not self._teacher_forced(self.tasks[self.task_ids[name]]):
                scores[name] = task_score(task_metrics)  # teacher-forced scores are not results: no average takes them
        train_sizes = {n: len(d) for n, d in self.task_train_sets.items()} or None
        metrics.update(
            {
                f"{metric_key_prefix}_{k}": v
                for k, v in aggregate_scores(scores, train_sizes, self.args.small_task_threshold).items()
            }
        )
        metrics.update(speed_metrics(metric_key_prefix, start, num_samples=num_samples))
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    # ------------------------------------------------------------------ model card
    def training_summary(self) -> dict[str, Any]:
        """The training set-up as it goes into model cards."""
        args = self.args
        runtime = next((h["train_runtime"] for h in reversed(self.state.log_history) if "train_runtime" in h), None)
        summary = {
            "optimizer steps": self.state.global_step,
            "batch size per device": args.per_device_train_batch_size,
            "gradient accumulation": args.gradient_accumulation_steps,
            "learning rate": args.learning_rate,
            "warm-up": f"{args.warmup_steps:g} of steps"
            if 0 < args.warmup_steps < 1
            else f"{int(args.warmup_steps)} steps",
            "task sampling": args.task_sampling
            + (f" (alpha {args.sampling_alpha})" if args.task_sampling == "temperature" else ""),
            "batching": args.batching,
            "precision": self.precision_used(),
            "weight decay": args.weight_decay,
            "epochs" if args.max_steps <= 0 else "max steps": args.num_train_epochs
            if args.max_steps <= 0
            else args.max_steps,
            "seed": args.seed,
            "device": str(args.device) + (f" x {args.world_size}" if args.world_size > 1 else ""),
        }
        if runtime is not None:
            summary["training time"] = f"{runtime:.0f} s"
        return summary

    def create_model_card(
        self,
        license: str | None = None,
        model_name: str | None = None,
        base_model: str | None = None,
        data_provenance: list[str] | None = None,
        repo_id: str | None = None,
        **kwargs,
    ) -> None:
        """Write hf_taskmoe's card (`hf_taskmoe.hub.render_model_card`) as `README.md` in `output_dir`;
        `push_to_hub` uploads it. Set `trainer.routing_statistics` / `trainer.routing_heatmap` to include routing.
        `model_name` defaults to `hub_model_id` or the output folder's name; `base_model` (repo id or path) to the
        config's `upcycled_from`. Other keywords go to `render_model_card` (`training`: default this run's set-up,
        None when it trained nothing; `model_path`: what the usage snippet loads, default `output_dir`)."""
        from ..hub import render_model_card

        if not self.is_world_process_zero():
            return
        # every evaluation metric logged, the latest value of each
        metrics = {k: v for entry in self.state.log_history for k, v in entry.items() if k.startswith("eval_")}
        routing, heatmap, source = self.routing_statistics, self.routing_heatmap, "evaluation"
        if routing is None and self.routing_analytics is not None and self.routing_analytics.total.counts is not None:
            # no evaluation routing recorded: summarise the training batches' routing instead
            routing, heatmap, source = (
                self.routing_analytics.total,
                self.routing_analytics.write_summary(self.args.output_dir),
                "training",
            )
        # a run that trained nothing (evaluation only) has no training set-up to show
        training = kwargs.pop("training", self.training_summary() if self.state.global_step > 0 else None)
        card = render_model_card(
            self.accelerator.unwrap_model(self.model),
            metrics=metrics,
            training=training,
            train_sizes={n: len(d) for n, d in self.task_train_sets.items()},
            routing=routing,
            heatmap=heatmap,
            routing_source=source,
            repo_id=repo_id or (self.args.hub_model_id if self.args.push_to_hub else None),
            model_name=model_name or self.args.hub_model_id or os.path.basename(os.path.normpath(self.args.output_dir)),
            license=license or "apache-2.0",
            base_model=base_model,
            label_ranges=self._regression_ranges(),
            data_provenance=data_provenance,
            model_path=kwargs.pop("model_path", self.args.output_dir),  # the folder the card is saved in
            **kwargs,
        )
        card.save(os.path.join(self.args.output_dir, "README.md"))

    def _close_prediction_bars(self) -> None:
        """One progress bar per task's evaluation: transformers' ProgressCallback sizes its bar by the first loop's
        batches and closes it at the end of `evaluate`; with one loop per task it would count on past its total."""
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, ProgressCallback) and callback.prediction_bar is not None:
                callback.prediction_bar.close()
                callback.prediction_bar = None

    def _regression_ranges(self) -> dict[str, tuple[float, float]]:
        """Lowest and highest training target of each regression task (the card's task table)."""
        ranges = {}
        for task in self.tasks:
            dataset = self.task_train_sets.get(task.name)
            if ("target_range" not in problem_type_of(task).own_spec_fields or dataset is None
                    or "labels" not in getattr(dataset, "column_names", [])):
                continue
            values = torch.tensor(dataset["labels"], dtype=torch.float64).reshape(-1)
            ranges[task.name] = (round(values.min().item(), 4), round(values.max().item(), 4))
        return ranges

    def predict_tasks(self, test_dataset: dict, ignore_keys=None, metric_key_prefix: str = "test") -> dict[str, Any]:
        """`{task: PredictionOutput}` for `{task: dataset}` (metrics filled in when the sets have labels)."""
        return {
            name: self._run_task(name, dataset, f"{metric_key_prefix}_{name}", "Prediction", ignore_keys)[0]
            for name, dataset in self._eval_sets(test_dataset).items()
        }

    def _teacher_forced(self, task: TaskSpec) -> bool:
        """Whether `task`'s scores come from teacher-forced arg-max tokens rather than generated text."""
        return TEXT_TO_TEXT in problem_type_of(task).capabilities and not self.args.predict_with_generate

    def _open_prediction_bar(self, dataloader, description: str) -> None:
        """Open the evaluation progress bar with the task's name (transformers' ProgressCallback opens an unnamed one
        on the first step; it updates the one found here)."""
        if self.args.disable_tqdm or not self.is_world_process_zero():
            return
        from tqdm.auto import tqdm

        for callback in self.callback_handler.callbacks:
            if isinstance(callback, ProgressCallback) and callback.prediction_bar is None:
                try:
                    total = len(dataloader)
                except TypeError:
                    return
                callback.prediction_bar = tqdm(total=total, desc=description, leave=callback.training_bar is None,
                                               dynamic_ncols=True)

    def _run_task(self, name: str, dataset, prefix: str, description: str, ignore_keys=None):
        """One task's evaluation loop; its metrics (`{prefix}_{metric}`) are added to the output's. Seq2seq scores of
        teacher-forced tokens (`predict_with_generate=False`) are named `{prefix}_{metric}_teacher_forced`."""
        task = self.tasks[self.task_ids[name]]
        dataloader = self.get_eval_dataloader(dataset)
        self._open_prediction_bar(dataloader, f"{description} [{name}]")
        output = self.evaluation_loop(
            dataloader, description=f"{description} [{name}]", prediction_loss_only=False,
            ignore_keys=ignore_keys, metric_key_prefix=prefix,
        )
        self._close_prediction_bars()
        if output.label_ids is None:
            return output, {}
        eos = getattr(
            getattr(self.accelerator.unwrap_model(self.model), "generation_config", None), "eos_token_id", None
        )
        task_metrics = compute_task_metrics(task, output.predictions, output.label_ids, tokenizer=self.processing_class,
                                            eos_token_id=eos, trust_remote_metrics=self.args.trust_remote_metrics,
                                            dataset=dataset)
        if self.task_compute_metrics is not None:
            task_metrics.update(self.task_compute_metrics(task, EvalPrediction(output.predictions, output.label_ids)))
        if self._teacher_forced(task):
            task_metrics = {f"{k}_teacher_forced": v for k, v in task_metrics.items()}
        output.metrics.update({f"{prefix}_{k}": v for k, v in task_metrics.items()})
        return output, task_metrics
