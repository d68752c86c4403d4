"""What every family's config shares: `TaskConfigMixin` (the task list checked and stored as JSON dicts, field
errors as `ValueError`, the dense model's views) and the check that refuses an option no family of this config takes
(`check_config_options`: a misspelt one with the closest valid name, another family's naming that family), which
`from_dense` runs too."""

from __future__ import annotations

import contextvars
import dataclasses
import difflib
import functools
import inspect
import json
import weakref

import torch
from huggingface_hub.errors import StrictDataclassError

from ..problem_types.registry import problem_type_names
from ..tasks import TaskSpec, parse_tasks
from .registry import FAMILIES

#: set while a saved config loads (`TaskConfigMixin.from_dict`): its keys are not checked as options
_LOADING = contextvars.ContextVar("hf_taskmoe_config_loading", default=False)

#: fields the build itself sets (`from_dense`: the tasks, the dense config, the checkpoint's name; the script: the
#: recipe of text task representations): never options
BUILD_FIELDS = frozenset({"tasks", "dense_config", "upcycled_from", "task_representation_source"})


def own_config_fields(config_class: type) -> list[dataclasses.Field]:
    """The dataclass fields `config_class` adds to those of the transformers configs it derives from."""
    inherited: set[str] = set()
    for base in config_class.__mro__[1:]:
        if dataclasses.is_dataclass(base) and base.__module__.split(".")[0] == "transformers":
            inherited |= {f.name for f in dataclasses.fields(base)}
    return [f for f in dataclasses.fields(config_class) if f.name not in inherited and f.name not in BUILD_FIELDS]


_SPEC_CACHE: dict[int, tuple[str, tuple[TaskSpec, ...]]] = {}


#: keys transformers writes into a config.json from outside `PreTrainedConfig` (`auto_map`, `custom_pipelines`:
#: `transformers.dynamic_module_utils.custom_object_save`; `quantization_config`: the quantizers) or pops from one
#: for compatibility with earlier releases (`_commit_hash`, `rope_theta`)
_TRANSFORMERS_WRITTEN_KEYS = frozenset({"auto_map", "custom_pipelines", "quantization_config", "_commit_hash",
                                        "rope_theta"})


@functools.cache
def transformers_config_keys() -> frozenset[str]:
    """The keyword arguments transformers' own `PreTrainedConfig` takes, read from the class: its fields, its
    properties (`num_labels`, `name_or_path`, `torch_dtype`, `_attn_implementation`, ...) and the attributes it
    sets, each also without its leading underscore (`attn_implementation`), the keys it writes to a config.json
    (`model_type`, `_name_or_path`, `transformers_version`, ...), the generation settings it moves to the generation
    config (every `GenerationConfig` key), and `_TRANSFORMERS_WRITTEN_KEYS`."""
    from transformers import GenerationConfig, PreTrainedConfig

    bare = PreTrainedConfig()
    names = {f.name for f in dataclasses.fields(PreTrainedConfig)} | set(vars(bare))
    names |= {name for name, _ in inspect.getmembers(PreTrainedConfig, lambda v: isinstance(v, property))}
    names |= {name.lstrip("_") for name in names}
    names |= set(bare.to_dict()) | set(GenerationConfig().to_dict())
    return frozenset(names | _TRANSFORMERS_WRITTEN_KEYS)


def _own_options(config_class: type) -> list[str]:
    """The fields `config_class` adds to transformers' configs (its options)."""
    return [f.name for f in own_config_fields(config_class)]


def _option_owners(name: str) -> dict[str, list[str]]:
    """`{method: [config class names]}` of the registered families whose config or `from_dense` has option `name`."""
    owners: dict[str, list[str]] = {}
    for family in (m for f in FAMILIES.values() for m in f.members):
        takes = set(_own_options(family.config_class))
        from_dense = getattr(family.model_class, "from_dense", None)
        if from_dense is not None:
            takes |= set(inspect.signature(from_dense).parameters) - {"cls", "dense", "tasks", "config_kwargs"}
        if name in takes:
            owners.setdefault(family.method or family.name, []).append(family.config_class.__name__)
    return owners


def check_config_options(config_class: type, given, also=(), where: str | None = None) -> None:
    """Refuse the names in `given` that are neither options of `config_class` (its fields, its properties, the
    dense-config fields it takes flat: `accepted_options`), nor transformers' own config keywords
    (`transformers_config_keys`), nor in `also` (a `from_dense`'s own parameters): a misspelt `num_expert=8` must not
    build the default 4 experts. One paragraph naming the option, the closest valid one, and the family that takes
    it when it is another family's option (`pal_size` given to MT-TaG)."""
    accepted = transformers_config_keys() | config_class.accepted_options() | set(also) | BUILD_FIELDS
    accepted |= {f.name for f in dataclasses.fields(config_class)}
    unknown = [name for name in given if name not in accepted and not isinstance(
        getattr(config_class, name, None), property)]
    if not unknown:
        return
    own = _own_options(config_class)
    views = {name for name, _ in inspect.getmembers(config_class, lambda v: isinstance(v, property))}
    valid = sorted((set(own) | set(also) | config_class.accepted_options() | views)
                   - {"self", "cls", "config_kwargs", "kwargs"})
    where = where or config_class.__name__
    parts = []
    for name in unknown:
        owners = {method: names for method, names in _option_owners(name).items()
                  if config_class.__name__ not in names}
        close = difflib.get_close_matches(name, valid, n=1)
        text = f"`{name}`"
        if owners:
            text += " is an option of " + " and of ".join(
                f"the {method} family ({', '.join(f'`{n}`' for n in names)})" for method, names in owners.items()
            ) + ", not of this one"
        elif close:
            text += f" (did you mean `{close[0]}`?)"
        parts.append(text)
    raise ValueError(
        f"{where} got unknown option(s): {'; '.join(parts)}. {config_class.__name__}'s own options are {own} "
        f"(besides transformers' config keywords); nothing was built."
    )


class TaskConfigMixin:
    """For the families' `PreTrainedConfig` subclasses, which hold `tasks`: field errors as `ValueError`, the
    task list checked and stored as JSON dicts, and the views every family reads. An unknown keyword (a misspelt
    option, another family's) is refused by name (`check_config_options`)."""

    tasks: list | None

    def __post_init__(self, **kwargs):
        if not _LOADING.get():
            check_config_options(type(self), kwargs)
        super().__post_init__(**kwargs)

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        """transformers' `from_dict`, which loads a saved config with every attribute it was saved with: transformers
        writes any attribute set on a config (`config.x = ...`, as its own model tests set the norms' epsilons under
        every name), so the unknown-option check is for the options one passes when building a config, not for what
        a saved one holds."""
        token = _LOADING.set(True)
        try:
            return super().from_dict(config_dict, **kwargs)
        finally:
            _LOADING.reset(token)

    @classmethod
    def accepted_options(cls) -> frozenset[str]:
        """Keywords the config takes besides its fields and properties (the dense config's fields given flat, where
        the config takes them: `FlatDenseFields`)."""
        return frozenset()

    def __setattr__(self, key, value):
        if self._set_dense_view(key, value):
            return
        # transformers' configs are huggingface_hub strict dataclasses, which raise their own error class on a
        # wrongly typed field; the contract of this library is a ValueError naming the field.
        try:
            super().__setattr__(key, value)
        except StrictDataclassError as err:
            raise ValueError(f"`{key}`: {str(err).splitlines()[-1].strip()}") from None

    def _set_dense_view(self, key: str, value) -> bool:
        """Set a read-only view of the dense model's config (`hidden_size`, `vocab_size`, `layer_norm_eps`, ...: a
        property without a setter) on the dense config, where the model reads it; False where `key` is no such view.

        transformers sets these on the outer config (`resize_token_embeddings` sets `vocab_size`; its tests set the
        norms' epsilon), which a bare property refuses. The value is written to the dense config's field of that
        name (the architecture's own name: `Backbone.config_fields`) only if the view then reads it back; otherwise
        the field is restored and the assignment fails as before."""
        view = getattr(type(self), key, None)
        dense = self.__dict__.get("dense_config")
        if not isinstance(view, property) or view.fset is not None or not hasattr(dense, "to_dict"):
            return False
        try:
            names = self.backbone.config_fields
        except (AttributeError, ValueError):  # no declared architecture: the field keeps its name
            names = {}
        name = names.get(key, key)
        if not hasattr(dense, name):
            return False
        before = getattr(dense, name)
        setattr(dense, name, value)
        try:
            if view.fget(self) == value:
                return True
        except Exception:  # noqa: BLE001 (a view that cannot read the new value: restored below)
            pass
        setattr(dense, name, before)
        return False

    def _validate_tasks(self, allowed: str | tuple[str, ...], refusal: str) -> list[TaskSpec]:
        """Parse `tasks`, refuse problem types outside `allowed` ("Task 'x': problem_type 'y' <refusal> [...]"):
        a capability the types must have (`hf_taskmoe.problem_types.ENCODER`, ...) or problem-type names."""
        if isinstance(allowed, str):
            allowed = problem_type_names(allowed)
        if self.tasks is None:  # a config without tasks describes the architecture only (transformers builds
            return []  # default configs to compare against); a model needs tasks (`task_specs` says so)
        specs = parse_tasks(self.tasks)
        for spec in specs:
            if spec.problem_type not in allowed:
                raise ValueError(f"Task {spec.name!r}: problem_type {spec.problem_type!r} {refusal} {list(allowed)}.")
        self.tasks = [s.to_dict() for s in specs]  # stored as plain dicts: the config is JSON
        self.task_specs  # noqa: B018  (parsed and cached now, for a compiled forward: see `task_specs`)
        return specs

    def __setstate__(self, state):
        """A copy (`copy.deepcopy`, pickle) has its specs parsed too, as a built config (see `task_specs`)."""
        self.__dict__.update(state)
        if getattr(self, "tasks", None) is not None:
            self.task_specs  # noqa: B018

    def _tasks_or_raise(self) -> list:
        if self.tasks is None:
            raise ValueError("`tasks` is required: a list of TaskSpec (or their dicts), one per task.")
        return self.tasks

    @property
    def task_specs(self) -> list[TaskSpec]:
        """`tasks` as `TaskSpec`s, parsed once per content of `tasks` (forward passes read them every step)."""
        tasks = self._tasks_or_raise()
        cached = _SPEC_CACHE.get(id(self))
        if cached is not None and torch.compiler.is_compiling():
            # dynamo traces neither `json.dumps` nor the parse (a graph break in every forward that reads the specs):
            # a compiled forward takes the specs last parsed eagerly. Every config has them: parsed when it is built
            # (`_validate_tasks`) or copied (`__setstate__`); an edit of `tasks` is re-parsed by the next eager read
            # (`add_task`'s), whose new entry fails the compiled graph's guards.
            return list(cached[1])
        key = json.dumps(tasks, sort_keys=True)
        if cached is None or cached[0] != key:
            if cached is None:
                weakref.finalize(self, _SPEC_CACHE.pop, id(self), None)
            cached = _SPEC_CACHE[id(self)] = (key, tuple(TaskSpec.from_dict(t) for t in tasks))
        return list(cached[1])

    @property
    def task_names(self) -> list[str]:
        return [t["name"] for t in self._tasks_or_raise()]

    @property
    def num_tasks(self) -> int:
        return len(self._tasks_or_raise())
