"""Two-stage protocols after joint multi-task training.

- MT-TaG section 4.5: fine-tune the multi-task model on each task separately, with early stopping on
  that task's dev set (`finetune_each_task`).
- PALs section 4.2: keep training, but only the task-specific parameters (heads, task gates, PALs):
  `train_task_specific`, `freeze_shared_parameters` (or `MultiTaskTrainingArguments(train_task_specific_only=True)`).

Each family names its task-specific parameters once, in its `parameter_roles` (`hf_taskmoe.contract`).
"""

from __future__ import annotations

import copy
import os

from torch import nn

from .freezing import freeze_shared_parameters, task_specific_patterns  # noqa: F401  (public here too)


def finetune_each_task(
    model: nn.Module,
    args,
    train_datasets: dict,
    eval_datasets: dict,
    early_stopping_patience: int = 3,
    **trainer_kwargs,
) -> dict[str, dict[str, float]]:
    """MT-TaG's second stage: a copy of the multi-task model per task, trained on that task alone with early
    stopping on its dev set (its first metric). Returns `{task: best dev metrics}`; the fine-tuned models are
    saved under `<args.output_dir>/finetune-<task>`.

    `args` are `MultiTaskTrainingArguments` for one task's run (eval and save strategies are set to `epoch`
    when they are `no`, as early stopping needs them).
    """
    from transformers import EarlyStoppingCallback

    from .trainer import MultiTaskTrainer

    results = {}
    for name, train_set in train_datasets.items():
        if name not in eval_datasets:
            raise ValueError(f"Task {name!r} has no dev set: early stopping needs one.")
        task = next(t for t in model.config.task_specs if t.name == name)
        run_args = copy.deepcopy(args)
        run_args.output_dir = os.path.join(args.output_dir, f"finetune-{name}")
        if str(run_args.eval_strategy) in ("no", "IntervalStrategy.NO"):
            run_args.eval_strategy = run_args.save_strategy = "epoch"
        run_args.load_best_model_at_end = True
        run_args.metric_for_best_model = f"eval_{name}_{task.metrics[0]}"
        run_args.greater_is_better = True
        trainer = MultiTaskTrainer(
            model=copy.deepcopy(model),
            args=run_args,
            train_dataset={name: train_set},
            eval_dataset={name: eval_datasets[name]},
            callbacks=[EarlyStoppingCallback(early_stopping_patience=early_stopping_patience)],
            **trainer_kwargs,
        )
        trainer.train()
        results[name] = trainer.evaluate()
        trainer.save_model(run_args.output_dir)
    return results


def train_task_specific(model: nn.Module, args, steps: int, train_datasets: dict, eval_datasets: dict | None = None,
                        **trainer_kwargs) -> None:
    """PALs' second stage: `steps` more steps on the task-specific parameters only (`train_task_specific_only`), with
    `args` otherwise as the joint run's (`MultiTaskTrainingArguments`), writing under `<args.output_dir>/task_specific`;
    every parameter is trainable again afterwards."""
    from .arguments import MultiTaskTrainingArguments
    from .trainer import MultiTaskTrainer

    stage = MultiTaskTrainingArguments(**{**args.to_dict(), "max_steps": steps, "train_task_specific_only": True,
                                          "output_dir": os.path.join(args.output_dir, "task_specific")})
    MultiTaskTrainer(model=model, args=stage, train_dataset=train_datasets, eval_dataset=eval_datasets,
                     **trainer_kwargs).train()
    for p in model.parameters():
        p.requires_grad_(True)
