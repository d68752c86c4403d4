"""The options a family offers a training script, read from its config class.

A family's config is a dataclass (transformers 5); the fields it adds to transformers' own (`BertConfig`'s,
`PreTrainedConfig`'s) are the method's settings: `num_experts`, `pal_size`, `conditional_attention`, ... Each one that a
command line can express (a number, a string, a switch, a list of numbers or names) is an option of
`examples/run_multitask.py`, named as the field, described by the `Args:` entry of the config's docstring, unset by
default (unset: the family's own default). A new family's settings are options without an edit to the script.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Iterable

from ..models.configuration import own_config_fields

_SCALARS = {"int": int, "float": float, "str": str, "bool": bool}
# an `Args:` entry: `name (`type`, ...):` then its description, on the same line or indented on the next ones
_ARG = re.compile(r"^ {4}(\w+) \((.*?)\):(.*)\n((?:(?: {8}.*)?\n)*)", re.M)


@dataclasses.dataclass(frozen=True)
class ConfigOption:
    """One config field as a command-line option.

    Args:
        name: the field (and option) name.
        kind: `int`, `float`, `str` or `bool` (a switch: `--x` on, `--no_x` off); for a list, its items' type.
        is_list: a list of `kind` (`--moe_layers 0 2`).
        groups: a list of lists of names, given as comma-separated groups (`--pal_task_groups qqp,stsb mnli`).
        help: the first sentence of the field's docstring entry.
        methods: the methods (or families, where a family names none) whose configs have the field.
    """

    name: str
    kind: type
    is_list: bool = False
    groups: bool = False
    help: str = ""
    methods: tuple[str, ...] = ()

    @property
    def annotation(self):
        """The type an `HfArgumentParser` dataclass field takes (None: unset)."""
        if self.is_list or self.groups:
            return list[str] | None if self.groups else list[self.kind] | None
        return self.kind | None

    def config_value(self, value):
        """The config's value for the option's parsed `value` (groups: `"a,b"` -> `["a", "b"]`)."""
        return [group.split(",") for group in value] if self.groups and value is not None else value


def _documented(config_class: type) -> dict[str, tuple[str, str]]:
    """`{field: (type text, description)}` from the `Args:` entries of the docstrings along the class's MRO."""
    found: dict[str, tuple[str, str]] = {}
    for klass in config_class.__mro__:
        text = inspect.cleandoc(klass.__dict__.get("__doc__") or "") + "\n"
        for match in _ARG.finditer(text):
            description = " ".join(f"{match.group(3)} {match.group(4)}".split())
            found.setdefault(match.group(1), (match.group(2), description))
    return found


def _first_sentence(text: str) -> str:
    match = re.match(r"(.+?\.)(\s|$)", text)
    return (match.group(1) if match else text).replace("`", "")


def _option(field: dataclasses.Field, doc: tuple[str, str] | None) -> ConfigOption | None:
    """The option of a field, or None when a command line cannot express its type (a dict, a config)."""
    declared = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
    names = [n.strip() for n in declared.split("|") if n.strip() not in ("None", "")]
    if not names:
        return None
    doc_type = doc[0].split("`")[1] if doc and doc[0].count("`") >= 2 else ""
    help_text = _first_sentence(doc[1]) if doc else ""
    if names[0].startswith("list"):
        if doc_type.startswith("list[list["):
            return ConfigOption(field.name, str, groups=True, help=help_text)
        item = re.match(r"list\[(\w+)\]", doc_type)
        kind = _SCALARS.get(item.group(1)) if item else int
        return None if kind in (None, bool) else ConfigOption(field.name, kind, is_list=True, help=help_text)
    kind = _SCALARS.get(names[0])
    return None if kind is None else ConfigOption(field.name, kind, help=help_text)


def family_options(family) -> dict[str, ConfigOption]:
    """`{name: ConfigOption}` of one family (`hf_taskmoe.models.registry.Family`): its config's own fields that a
    command line can set."""
    docs = _documented(family.config_class)
    options = {}
    for field in own_config_fields(family.config_class):
        option = _option(field, docs.get(field.name))
        if option is not None:
            options[field.name] = dataclasses.replace(option, methods=(family.method or family.name,))
    return options


def config_options(families: Iterable) -> dict[str, ConfigOption]:
    """The options of all `families`, each once (in the order the families and their fields come): its help from
    the first family whose config documents the field, its `methods` every method that has it."""
    merged: dict[str, ConfigOption] = {}
    for family in families:
        for name, option in family_options(family).items():
            known = merged.get(name)
            if known is None:
                merged[name] = option
                continue
            methods = tuple(dict.fromkeys((*known.methods, *option.methods)))
            merged[name] = dataclasses.replace(known, methods=methods, help=known.help or option.help)
    return merged


def options_dataclass(options: dict[str, ConfigOption], name: str = "MethodArguments", base: type | None = None):
    """A dataclass with one field per option (default None: the family's value), for `HfArgumentParser`, deriving
    from the dataclass `base` (its fields first) when given; each field's help names the methods that take it."""
    fields = [
        (o.name, o.annotation, dataclasses.field(default=None, metadata={
            "help": f"{', '.join(o.methods)}: {o.help or 'see the config class.'}"
            + (" Comma-separated groups." if o.groups else ""),
        }))
        for o in options.values()
    ]
    return dataclasses.make_dataclass(name, fields, bases=(base,) if base is not None else ())


def config_kwargs(arguments, family, options: dict[str, ConfigOption]) -> tuple[dict, list[str]]:
    """`(kwargs, ignored)`: the values of `options` set in `arguments` (an `options_dataclass` instance) that
    `family`'s config takes, as config values, and the names of those set that it does not take."""
    own = family_options(family)
    kwargs, ignored = {}, []
    for name in options:
        value = getattr(arguments, name, None)
        if value is None:
            continue
        if name in own:
            kwargs[name] = own[name].config_value(value)
        else:
            ignored.append(name)
    return kwargs, ignored
