"""Multi-task training: arguments, trainer, task samplers, data loading and collation."""

# registers the model-aware `uncertainty` sampler before the arguments check `task_sampling` against the registry
from .uncertainty import MTUncertaintySampling, example_layout  # isort: skip
from .arguments import MultiTaskTrainingArguments
from .callbacks import RoutingAnalyticsCallback
from .data import (
    TASK_PRESETS,
    MultiTaskCollator,
    MultiTaskDataset,
    TaskData,
    TaskPreset,
    check_task_split,
    load_preset,
    load_task_config,
    load_tasks,
    tokenize_task,
)
from .protocol import finetune_each_task, freeze_shared_parameters
from .samplers import (
    TASK_SAMPLERS,
    ModelAwareSampling,
    TaskBatchSampler,
    TaskSamplingStrategy,
    build_task_sampling,
    register_task_sampler,
)
from .tabular import (
    TabularCollator,
    TabularData,
    encode_tabular,
    load_census_income,
    synthetic_task_pair,
)
from .trainer import MultiTaskTrainer, TaskView

__all__ = [
    "MTUncertaintySampling",
    "example_layout",
    "RoutingAnalyticsCallback",
    "TabularCollator",
    "TabularData",
    "encode_tabular",
    "load_census_income",
    "synthetic_task_pair",
    "MultiTaskTrainingArguments",
    "MultiTaskTrainer",
    "TaskView",
    "TASK_PRESETS",
    "TaskPreset",
    "TaskData",
    "MultiTaskCollator",
    "MultiTaskDataset",
    "check_task_split",
    "load_preset",
    "load_task_config",
    "load_tasks",
    "tokenize_task",
    "finetune_each_task",
    "freeze_shared_parameters",
    "TASK_SAMPLERS",
    "ModelAwareSampling",
    "TaskBatchSampler",
    "TaskSamplingStrategy",
    "build_task_sampling",
    "register_task_sampler",
]
