"""The family registry: a family is the unit of the library's design.

There is one family per method (MT-TaG, PALs, CA-MTL, task-level routing, MMoE). Each `models/<method>/` package
declares, in one `register_family(Family(...))` call next to its code, everything the rest of the library needs: its
config and model classes (registered with the Auto classes here; a method with more than one model -- task-level
routing's causal LM and seq2seq LM, the papers' BERT / BART classes -- lists the others as `variants`), the names
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
        name: the family's name (`run_multitask.py --model_family <name>`), e.g. `"taskmoe"`.
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
            type into one `from_dense` takes (task-level routing's BART: a BERT is warm-started into a BART).
        script_defaults: optional `(values) -> {config field: value}`: config values the example script derives
            from its own options when the user sets none (CA-MTL: conditional attention as long as the inputs).
        method: the method the family implements (`"mt-tag"`, `"pals"`, `"ca-mtl"`, `"task-routing"`), another name
            `--model_family` takes for it.
        export_kind: the programs `hf_taskmoe.export_onnx` / `export_program` make of the family's models:
            `"text"` (the default: token inputs and task ids -> each row's task logits, `ServingLogits`), `"tabular"`
            (feature rows -> every task's logits) or `"encoder_decoder"` (two programs, `part="encoder"` and
            `part="decoder_step"`).
        variants: the family's other models, each a `Family` of the same name and method (`replace(family, ...)`)
            with its own config and model classes and what differs with them (Auto classes, dense model types,
            `describe`, `export_kind`, ...). A variant whose config has the family's `model_type` is a class with
            other defaults (`BertForTaskMoE`: a BERT, BERT's pooler): registered with the Auto classes by its config
            class, it saves as the family's model and loads back as one (`AutoModel`), or as itself through its own
            `from_pretrained`. `members` is the family followed by its variants; `family_for` builds from a dense
            checkpoint with the first member naming its `model_type` in `dense_model_types`, else the first taking it
            (`accepted_model_types`).
        aliases: other names `run_multitask.py --model_family` takes for the family (the names of the families that
            were folded into it: `bert_taskmoe`, `bart_routed`, ...).
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
    variants: tuple[Family, ...] = ()
    aliases: tuple[str, ...] = ()

    @property
    def members(self) -> tuple[Family, ...]:
        """The family, then its variants (`variants`)."""
        return (self, *self.variants)

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
    """Register `family`: check its names, register each member's config with `AutoConfig` (one class per
    `model_type`) and model with the Auto classes, keep it in `FAMILIES`. Returns the family (a package's `__init__`
    keeps it as `FAMILY`)."""
    import transformers
    from transformers import AutoConfig

    if family.name in FAMILIES and not exist_ok and FAMILIES[family.name] != family:
        raise ValueError(f"A family named {family.name!r} is already registered; pass exist_ok=True to replace it.")
    others = {n: f for f in FAMILIES.values() if f.name != family.name for n in (f.name, *f.aliases)}
    taken = sorted(n for n in (family.name, *family.aliases) if n in others)
    if taken:
        raise ValueError(f"The name(s) {taken} of family {family.name!r} are already another family's.")
    registered = {}
    for member in family.members:
        model_type = member.config_class.model_type
        if not isinstance(model_type, str) or not model_type.startswith("taskmoe_"):
            raise ValueError(f"model_type {model_type!r} of family {family.name!r} must start with 'taskmoe_'.")
        clash = next((f for f in FAMILIES.values() if f.name != family.name
                      and any(m.model_type == model_type for m in f.members)), None)
        if clash is not None:
            raise ValueError(f"model_type {model_type!r} is already the family {clash.name!r}'s.")
        if member.config_class is not getattr(member.model_class, "config_class", None):
            raise ValueError(f"{member.model_class.__name__}.config_class must be {member.config_class.__name__}.")
        # one config class per model_type (the first member's): a variant with other defaults only (the same
        # model_type, listed after it) is its subclass
        if model_type in registered and not issubclass(member.config_class, registered[model_type]):
            raise ValueError(f"{member.config_class.__name__} has the model_type {model_type!r} of "
                             f"{registered[model_type].__name__} without being its subclass.")
        if model_type not in registered:
            AutoConfig.register(model_type, member.config_class, exist_ok=True)
            registered[model_type] = member.config_class
        for auto in member.auto_classes:
            getattr(transformers, auto).register(member.config_class, member.model_class, exist_ok=True)
    FAMILIES[family.name] = family
    return family


def get_family(name: str) -> Family:
    """The family registered as `name` (`run_multitask.py --model_family`): its name, one of its `aliases` or its
    method."""
    for family in FAMILIES.values():
        if name in (family.aliases + ((family.method,) if family.method else ())):
            return family
    return lookup(FAMILIES, name, "model_family")


def dense_choices() -> tuple[list[str], list[str]]:
    """`(families, other names)`: the names `family_for` takes -- the families built from a dense checkpoint, and
    their methods' names and aliases (`run_multitask.py --model_family`)."""
    buildable = [f for f in FAMILIES.values() if f.buildable_from_dense]
    others = {n for f in buildable for n in (*f.aliases, f.method) if n and n != f.name}
    return sorted(f.name for f in buildable), sorted(others)


def check_dense_family(name: str) -> str:
    """`name` if it names a family built from a dense checkpoint (its name, method or an alias); else a `ValueError`
    listing them (a family such as MMoE, built from its config, is not one)."""
    families, others = dense_choices()
    if name not in families and name not in others:
        raise ValueError(
            f"`model_family` must be one of the families built from a dense checkpoint {families} or another name of "
            f"one {others}, got {name!r}."
        )
    return name


def family_for(name: str, model_type: str) -> Family:
    """The member of the family `name` (`check_dense_family`) that builds it from a dense checkpoint of `model_type`:
    the first member naming that type in its `dense_model_types` (the paper's BERT / BART class), else the first that
    takes it (`accepted_model_types`). A `ValueError` lists the model types the family takes when none does."""
    check_dense_family(name)
    family = get_family(name)
    member = next((m for m in family.members if model_type in m.dense_model_types), None) or next(
        (m for m in family.members if model_type in m.accepted_model_types), None)
    if member is not None:
        return member
    supported = sorted({t for m in family.members for t in m.accepted_model_types})
    raise ValueError(
        f"The {family.method or family.name} method ({name!r}) cannot be built from a {model_type!r} checkpoint; it "
        f"supports the model types {supported}."
    )


def family_of(config_or_model_type) -> Family:
    """The family member of a config, model or `model_type`: the member whose config class the config is, else the
    first whose `model_type` it has."""
    config = getattr(config_or_model_type, "config", config_or_model_type)
    model_type = getattr(config, "model_type", config)
    members = [m for f in FAMILIES.values() for m in f.members if m.model_type == model_type]
    if members:
        return next((m for m in members if type(config) is m.config_class), members[0])
    raise ValueError(f"No hf_taskmoe family has model_type {model_type!r}; the families are "
                     f"{ {f.name: [m.model_type for m in f.members] for f in FAMILIES.values()} }.")
