"""The family registry: a family is the unit of the library's design.

Each `models/<family>/` package declares, in one `register_family(Family(...))` call next to its code, everything
the rest of the library needs: its config and model classes (registered with the Auto classes here), the name
`run_multitask.py --model_family` takes, how it is built from a dense checkpoint (upcycling rules, the dense
model types it starts from), the line a model card says of its method, the pipeline that serves it and the
problem types it supports. Central modules (upcycling, model cards, pipelines, the example script) ask this
registry and name no family; a new family is one new folder plus one line that imports it
(`hf_taskmoe/models/__init__.py`), or, outside the package, one `register_family` call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..utils import lookup


@dataclass(frozen=True)
class Family:
    """What the library knows of one model family.

    Args:
        name: the family's name (`run_multitask.py --model_family <name>`), e.g. `"bert_taskmoe"`.
        config_class / model_class: the `PreTrainedConfig` (its `model_type` starts with `taskmoe_`) and the model
            users train (with its heads); registered with `AutoConfig` and each of `auto_classes`.
        auto_classes: transformers Auto classes the model class is registered with (also an export's `auto_map`).
        problem_types: the `TaskSpec.problem_type`s the family supports, as a capability every such type has
            (`hf_taskmoe.problem_types.ENCODER`, `TABULAR`, `TEXT_TO_TEXT`: a type registered later is included)
            or as a tuple of names.
        pipeline_task: the pipeline that serves the family's models (`"multitask-text-classification"`, ...).
        describe: `config -> str`, the method line of a model card.
        upcycling: `UpcyclingRules` mapping a dense checkpoint's weights into the family (None: not built from one).
        dense_model_types: `model_type`s of the dense checkpoints `from_dense` accepts.
        backbone_kind: a backbone-generic family takes every architecture declared with this kind
            (`hf_taskmoe.backbones`, `"encoder"` / `"decoder"` / `"encoder-decoder"`), one declared later included
            (`accepted_model_types`).
        prepare_dense: optional `(path_or_model, dense_config) -> path_or_model`, turning a checkpoint of another
            type into one `from_dense` takes (BartTaskRouted: a BERT is warm-started into a BART).
        script_defaults: optional `(values) -> {config field: value}`: config values the example script derives
            from its own options when the user sets none (CA-MTL: conditional attention as long as the inputs).
        method: the method the family implements (`"mt-tag"`, `"pals"`, `"ca-mtl"`, `"task-routing"`, ...). Families
            of one method on different backbones share it: `family_for` picks the one that takes a checkpoint's
            `model_type` (`run_multitask.py --model_family bert_taskmoe` on a RoBERTa checkpoint builds the
            backbone-generic MT-TaG).
        export_kind: the programs `hf_taskmoe.export_onnx` / `export_program` make of the family's models:
            `"text"` (the default: token inputs and task ids -> each row's task logits, `ServingLogits`), `"tabular"`
            (feature rows -> every task's logits) or `"encoder_decoder"` (two programs, `part="encoder"` and
            `part="decoder_step"`).
    """

    name: str
    config_class: type
    model_class: type
    auto_classes: tuple[str, ...] = ("AutoModel",)
    problem_types: str | tuple[str, ...] = ()
    pipeline_task: str | None = None
    describe: Callable[[Any], str] | None = None
    upcycling: Any = None  # `hf_taskmoe.upcycling.UpcyclingRules` (upcycling asks the registry: not imported here)
    dense_model_types: tuple[str, ...] = ()
    backbone_kind: str | None = None
    prepare_dense: Callable[[Any, Any], Any] | None = None
    script_defaults: Callable[[dict], dict] | None = None
    method: str | None = None
    export_kind: str = "text"
    extras: dict = field(default_factory=dict)

    @property
    def model_type(self) -> str:
        return self.config_class.model_type

    @property
    def supported_problem_types(self) -> tuple[str, ...]:
        """The problem types the family's models take (every registered type with its capability)."""
        from ..problem_types import problem_type_names

        return (
            problem_type_names(self.problem_types) if isinstance(self.problem_types, str) else tuple(self.problem_types)
        )

    @property
    def accepted_model_types(self) -> tuple[str, ...]:
        """`dense_model_types`, plus every architecture declared with `backbone_kind` (read now, so an architecture
        declared after the family registered is included)."""
        if self.backbone_kind is None:
            return tuple(self.dense_model_types)
        from ..backbones import backbone_names

        return tuple(dict.fromkeys((*self.dense_model_types, *backbone_names(self.backbone_kind))))

    @property
    def buildable_from_dense(self) -> bool:
        return self.upcycling is not None and hasattr(self.model_class, "from_dense")


#: every registered family by name, in registration order
FAMILIES: dict[str, Family] = {}


def register_family(family: Family, exist_ok: bool = False) -> Family:
    """Register `family`: check its names, register its config and model with the Auto classes, keep it in
    `FAMILIES`. Returns the family (a package's `__init__` keeps it as `FAMILY`)."""
    import transformers
    from transformers import AutoConfig

    model_type = family.config_class.model_type
    if not isinstance(model_type, str) or not model_type.startswith("taskmoe_"):
        raise ValueError(f"model_type {model_type!r} of family {family.name!r} must start with 'taskmoe_'.")
    clash = next((f for f in FAMILIES.values() if f.model_type == model_type and f.name != family.name), None)
    if clash is not None:
        raise ValueError(f"model_type {model_type!r} is already the family {clash.name!r}'s.")
    if family.name in FAMILIES and not exist_ok and FAMILIES[family.name] != family:
        raise ValueError(f"A family named {family.name!r} is already registered; pass exist_ok=True to replace it.")
    if family.config_class is not getattr(family.model_class, "config_class", None):
        raise ValueError(f"{family.model_class.__name__}.config_class must be {family.config_class.__name__}.")
    AutoConfig.register(model_type, family.config_class, exist_ok=True)
    for auto in family.auto_classes:
        getattr(transformers, auto).register(family.config_class, family.model_class, exist_ok=True)
    FAMILIES[family.name] = family
    return family


def get_family(name: str) -> Family:
    """The family registered as `name` (`run_multitask.py --model_family`)."""
    return lookup(FAMILIES, name, "model_family")


def dense_choices() -> tuple[list[str], list[str]]:
    """`(families, methods)`: the names `family_for` takes -- the families built from a dense checkpoint, and their
    methods' names (`run_multitask.py --model_family`)."""
    buildable = [f for f in FAMILIES.values() if f.buildable_from_dense]
    return sorted(f.name for f in buildable), sorted({f.method for f in buildable if f.method})


def check_dense_family(name: str) -> str:
    """`name` if it names a family built from a dense checkpoint or a method of one; else a `ValueError` listing both
    (a family such as MMoE, built from its config, is not one)."""
    families, methods = dense_choices()
    if name not in families and name not in methods:
        raise ValueError(
            f"`model_family` must be one of the families built from a dense checkpoint {families} or a method name "
            f"{methods}, got {name!r}."
        )
    return name


def family_for(name: str, model_type: str) -> Family:
    """The family that builds `name`'s method (a family name or a method name, `check_dense_family`) from a dense
    checkpoint of `model_type`: the named family itself when it takes that type, else another family of its method
    that does. A `ValueError` lists the model types the method supports when none takes it."""
    check_dense_family(name)
    named = FAMILIES.get(name)
    method = named.method if named is not None else name
    if named is not None and (model_type in named.accepted_model_types or method is None):
        return named
    candidates = [f for f in FAMILIES.values() if f.method == method]
    for family in candidates:
        if model_type in family.accepted_model_types:
            return family
    supported = sorted({t for f in candidates for t in f.accepted_model_types})
    raise ValueError(
        f"The {method} method ({name!r}) cannot be built from a {model_type!r} checkpoint; it supports the model "
        f"types {supported}."
    )


def family_of(config_or_model_type) -> Family:
    """The family of a config, model or `model_type`."""
    model_type = getattr(
        getattr(config_or_model_type, "config", config_or_model_type), "model_type", config_or_model_type
    )
    for family in FAMILIES.values():
        if family.model_type == model_type:
            return family
    raise ValueError(f"No hf_taskmoe family has model_type {model_type!r}; the families are "
                     f"{ {f.name: f.model_type for f in FAMILIES.values()} }.")
