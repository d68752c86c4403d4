"""Multi-task training: arguments, trainer, task samplers, data loading and collation. Each name loads its module
on first use (the trainer brings in `datasets` and transformers' `Trainer`)."""

from .. import _lazy_exports
from . import uncertainty  # noqa: F401  registers the model-aware `uncertainty` sampler before any `task_sampling` check

_EXPORTS: dict[str, tuple[str, ...]] = {
    ".uncertainty": ("MTUncertaintySampling", "example_layout"),
    ".arguments": ("MultiTaskTrainingArguments",),
    ".callbacks": ("RoutingAnalyticsCallback",),
    ".batches": ("MultiTaskCollator",),
    ".data": (
        "TASK_PRESETS",
        "MultiTaskDataset",
        "TaskData",
        "TaskPreset",
        "check_task_split",
        "load_preset",
        "load_task_config",
        "load_tasks",
        "tokenize_task",
    ),
    ".protocol": ("finetune_each_task", "freeze_shared_parameters", "train_task_specific"),
    ".samplers": (
        "TASK_SAMPLERS",
        "ModelAwareSampling",
        "TaskBatchSampler",
        "TaskSamplingStrategy",
        "build_task_sampling",
        "register_task_sampler",
    ),
    ".tabular": ("TabularCollator", "TabularData", "encode_tabular", "load_census_income", "synthetic_task_pair"),
    ".trainer": ("MultiTaskTrainer", "TaskView"),
}

__all__ = [name for names in _EXPORTS.values() for name in names]

__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)
