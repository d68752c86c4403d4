"""`TaskSpec`: everything the library needs to know about one task.

A task has a name (used as the key of its head, its gate and its metrics), a problem type (which head
and loss it gets), its labels, the metrics it is evaluated with and the fields of a data row that hold
its inputs. Specs round-trip through JSON so that a saved model config carries its task list.

Problem types use transformers' words where they exist (`single_label_classification`, `regression`, ...); each
is a class in `hf_taskmoe.problem_types` (head, loss, label format, metrics): `PROBLEM_TYPES` holds them by name.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .problem_types.registry import (
    PROBLEM_TYPES,  # noqa: F401 (the registered problem types by name; re-exported)
    default_problem_type,
    get_problem_type,
)
from .utils import check_choice, check_float, check_str_list

# the spec fields a problem type owns (`ProblemType.own_spec_fields`): any other type refuses them
_TYPE_FIELDS = ("choice_fields", "span_fields", "target_range")

# No '.': the name keys `nn.ModuleDict`s (heads, gates), whose keys cannot hold dots.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-]*")

# Names a task cannot take: attributes of the `nn.ModuleDict`s keyed by task name (`MultiTaskHeads` and the families'
# own dicts, e.g. MMoE's heads), which `ModuleDict` refuses as keys ("attribute 'training' already exists") or
# shadows (`heads.keys`). Written out rather than read from torch so that a name valid today stays valid with
# another torch; `tests/test_tasks.py` checks that it covers torch's `nn.ModuleDict` and `MultiTaskHeads`.
RESERVED_TASK_NAMES = frozenset({
    "T_destination", "add_module", "apply", "bfloat16", "buffers", "call_super_init", "children", "clear", "compile",
    "cpu", "cuda", "double", "dump_patches", "eval", "extra_repr", "float", "forward", "get_buffer", "get_extra_state",
    "get_parameter", "get_submodule", "half", "ipu", "items", "keys", "load_state_dict", "modules", "mtia",
    "named_buffers", "named_children", "named_modules", "named_parameters", "parameters", "pop",
    "register_backward_hook", "register_buffer", "register_forward_hook", "register_forward_pre_hook",
    "register_full_backward_hook", "register_full_backward_pre_hook", "register_load_state_dict_post_hook",
    "register_load_state_dict_pre_hook", "register_module", "register_parameter", "register_state_dict_post_hook",
    "register_state_dict_pre_hook", "requires_grad_", "set_extra_state", "set_submodule", "share_memory", "state_dict",
    "to", "to_empty", "train", "training", "type", "update", "values", "xpu", "zero_grad",
    # added to nn.Module at run time by transformers' `PreTrainedModel.initialize_weights`
    "smart_apply",
    # MultiTaskHeads' own attributes and methods
    "add_task", "check_exportable", "check_inputs", "dropout", "every_row_ready", "forward_every_row", "hidden_size",
    "logit_widths", "runs_every_task", "scale_loss_by_num_classes", "split_rows", "tasks",
})


@dataclass(frozen=True)
class TaskSpec:
    """Describes one task of a multi-task model.

    Args:
        name (`str`):
            Unique task name: letters, digits, `_` and `-`. It keys the task's head, gate and metrics
            (`eval_<name>_<metric>`); the attribute names of `nn.ModuleDict` (`training`, `keys`, ...: see
            `RESERVED_TASK_NAMES`) cannot be task names.
        problem_type (`str`, *optional*, defaults to `"single_label_classification"`):
            One of `PROBLEM_TYPES` (`hf_taskmoe.problem_types`: head, loss and label format of each).
        num_labels (`int`, *optional*):
            Number of classes (classification), of outputs (regression, defaults to 1) or of choices
            (multiple choice, taken from `choice_fields`). Derived from `label_names` when those are given.
        label_names (`list[str]`, *optional*):
            Names of the classes, in label-index order. Defaults to `LABEL_0`, `LABEL_1`, ...
        label_values (`list[int | str]`, *optional*):
            The labels as the data files write them, in the order of the classes (e.g. ratings `[1, 2, 3, 4, 5]`
            beside five `label_names`): a row's label `v` is class `label_values.index(v)`. Without it a data label
            is a class name or a class position (0-based); integers that could be either are refused.
        metrics (`list[str]`, *optional*):
            Metric names; defaults depend on the problem type (its `default_metrics`).
        text_fields (`list[str]`, *optional*, defaults to `["sentence"]`):
            Fields of a data row holding the text: one field (single text) or two (text pair). For multiple
            choice these are the context fields; for token classification the single field holds a list of words.
        label_field (`str`, *optional*, defaults to `"label"`):
            Field of a data row holding the label.
        choice_fields (`list[str]`, *optional*):
            Multiple choice only: the fields holding the candidate answers, one row per choice is built.
        span_fields (`list[list[str]]`, *optional*):
            Span classification only: `[start_field, end_field]` character offsets of each span, the i-th span
            inside the i-th text field (WiC: `[["start1", "end1"], ["start2", "end2"]]`).
        target_range (`list[float]`, *optional*):
            Regression only: `[low, high]`, the scale of the targets (e.g. `[-4, 4]` for VADER ratings). Pipelines
            return it with each score and model cards show it; `run_multitask.py` fills it from the training
            targets when the task file does not give it.
        loss_weight (`float`, *optional*, defaults to 1.0):
            Multiplies the task's loss in the total loss.
        dataset (`str`, *optional*):
            Dataset id for model cards (e.g. `"nyu-mll/glue"`).
        dataset_config (`str`, *optional*):
            Dataset configuration or subset name (e.g. `"sst2"`).
        description (`str`, *optional*):
            Free text shown in model cards.
    """

    name: str
    problem_type: str | None = None  # None: the default type (single-label classification), set on creation
    num_labels: int | None = None
    label_names: list[str] | None = None
    label_values: list[int | str] | None = None
    metrics: list[str] | None = None
    text_fields: list[str] = field(default_factory=lambda: ["sentence"])
    label_field: str = "label"
    choice_fields: list[str] | None = None
    span_fields: list[list[str]] | None = None
    target_range: list[float] | None = None
    loss_weight: float = 1.0
    dataset: str | None = None
    dataset_config: str | None = None
    description: str | None = None

    def __post_init__(self):
        prefix = f"TaskSpec({self.name!r})" if isinstance(self.name, str) else "TaskSpec"
        if not isinstance(self.name, str) or not _NAME_RE.fullmatch(self.name):  # fullmatch: `$` lets "sst2\n" through
            raise ValueError(
                f"{prefix}: `name` must be a non-empty string of letters, digits, '_' or '-' starting with a "
                f"letter or digit, got {self.name!r}."
            )
        if self.name in RESERVED_TASK_NAMES:
            raise ValueError(
                f"{prefix}: `name` {self.name!r} is reserved: the task name keys torch `nn.ModuleDict`s (the heads, "
                f"the gates), where {self.name!r} is already an attribute. Rename the task (e.g. "
                f"{self.name.rstrip('_') + '_task'!r}); reserved names are {sorted(RESERVED_TASK_NAMES)}."
            )
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        if self.problem_type is None:  # the registry names the default (the types register when the package loads)
            set_("problem_type", default_problem_type())
        check_choice(self.problem_type, PROBLEM_TYPES, f"{prefix}.problem_type")
        kind = get_problem_type(self.problem_type)

        set_("text_fields", check_str_list(self.text_fields, f"{prefix}.text_fields"))
        if not isinstance(self.label_field, str) or not self.label_field:
            raise ValueError(f"{prefix}: `label_field` must be a non-empty string, got {self.label_field!r}.")
        if self.label_names is not None:
            set_("label_names", check_str_list(self.label_names, f"{prefix}.label_names"))
            if len(set(self.label_names)) != len(self.label_names):
                raise ValueError(f"{prefix}: `label_names` must be unique, got {self.label_names}.")

        for name in _TYPE_FIELDS:  # fields one problem type owns (choices, spans, a target range)
            if name not in kind.own_spec_fields and getattr(self, name) is not None:
                owners = [n for n, t in PROBLEM_TYPES.items() if name in t.own_spec_fields]
                raise ValueError(
                    f"{prefix}: `{name}` is only used by problem_type {' or '.join(map(repr, owners))}, not "
                    f"{self.problem_type!r}."
                )
        for name, value in kind.check_spec(self, prefix).items():
            set_(name, value)
        set_("num_labels", kind.resolve_num_labels(self, prefix))
        if self.label_names is not None and len(self.label_names) != self.num_labels:
            raise ValueError(
                f"{prefix}: `label_names` has {len(self.label_names)} names but `num_labels` is {self.num_labels}."
            )
        if self.label_values is not None:
            self._check_label_values(prefix, kind)
        if self.metrics is None:
            set_("metrics", list(kind.default_metrics))
        else:
            set_("metrics", check_str_list(self.metrics, f"{prefix}.metrics"))
        set_("loss_weight", check_float(self.loss_weight, f"{prefix}.loss_weight", minimum=0.0))
        for name in ("dataset", "dataset_config", "description"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{prefix}: `{name}` must be a string or None, got {value!r}.")

    def _check_label_values(self, prefix: str, kind) -> None:
        values = self.label_values
        if not kind.has_classes:
            raise ValueError(
                f"{prefix}: `label_values` maps class labels; problem_type {self.problem_type!r} has none."
            )
        if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)) or not all(
            isinstance(v, (int, str)) and not isinstance(v, bool) for v in values
        ):
            raise ValueError(f"{prefix}: `label_values` must be a list of integers or strings, got {values!r}.")
        if len({str(v) for v in values}) != len(values):
            raise ValueError(f"{prefix}: `label_values` must be unique, got {values!r}.")
        if len(values) != self.num_labels:
            raise ValueError(
                f"{prefix}: `label_values` has {len(values)} values but the task has {self.num_labels} classes."
            )
        object.__setattr__(self, "label_values", list(values))

    # ------------------------------------------------------------------ derived views
    @property
    def num_choices(self) -> int | None:
        return len(self.choice_fields) if self.choice_fields is not None else None

    @property
    def num_spans(self) -> int:
        return len(self.span_fields) if self.span_fields is not None else 0

    @property
    def id2label(self) -> dict[int, str]:
        return get_problem_type(self.problem_type).id2label(self)

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict; `TaskSpec.from_dict(spec.to_dict()) == spec`."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | TaskSpec) -> TaskSpec:
        if isinstance(data, TaskSpec):
            return data
        if not isinstance(data, dict):
            raise ValueError(f"A task must be a TaskSpec or a dict, got {type(data).__name__}: {data!r}.")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"Unknown TaskSpec field(s) {unknown} in {data!r}; valid fields are {sorted(known)}.")
        if "name" not in data:
            raise ValueError(f"A task needs a `name`, got {data!r}.")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TaskSpec:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"TaskSpec JSON could not be parsed: {err}") from None
        return cls.from_dict(data)


def parse_tasks(tasks, field_name: str = "tasks") -> list[TaskSpec]:
    """Turn a list of `TaskSpec`s or dicts into `TaskSpec`s, checking that names are unique."""
    if tasks is None or isinstance(tasks, (str, bytes, dict)) or not hasattr(tasks, "__iter__"):
        raise ValueError(f"`{field_name}` must be a non-empty list of TaskSpec or dicts, got {tasks!r}.")
    specs = []
    for i, task in enumerate(tasks):
        try:
            specs.append(TaskSpec.from_dict(task))
        except ValueError as err:
            raise ValueError(f"`{field_name}[{i}]`: {err}") from None
    if not specs:
        raise ValueError(f"`{field_name}` must name at least one task.")
    names = [s.name for s in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"`{field_name}` has duplicate task names {duplicates}; every task needs its own name.")
    return specs


# id(config) -> (the tasks' JSON, their parsed TaskSpecs): kept outside the config, whose attributes are all
# serialised to config.json; an entry goes when its config is garbage-collected
