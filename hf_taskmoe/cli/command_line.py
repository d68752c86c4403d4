"""Command-line helpers of a training script over `HfArgumentParser`: options layered over a preset, `--x`/`--no_x`
switches, and the lines of a short help that shows the value each option runs with."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

from transformers import HfArgumentParser


def given_options(argv: list[str]) -> set[str]:
    """The option names `argv` gives (`--no_x` gives `x`)."""
    names = set()
    for token in argv:
        if token.startswith("--"):
            name = token[2:].split("=", 1)[0]
            names.add(name[3:] if name.startswith("no_") else name)
    return names


def preset_argv(preset: dict, given: set[str]) -> list[str]:
    """The command line that sets each value of `preset` not in `given` (None: not set; True: a bare flag; a list:
    its items)."""
    argv = []
    for name, value in preset.items():
        if name in given or value is None:
            continue
        argv.append(f"--{name}")
        if isinstance(value, list):
            argv.extend(str(v) for v in value)
        elif value is not True:
            argv.append(str(value))
    return argv


def add_switches(parser: HfArgumentParser, names: Iterable[str]) -> None:
    """Make each optional boolean option of `names` (`bool | None`: None = unset) a flag: `--x` turns it on (`--x
    false` still works), `--no_x` off."""
    names = set(names)
    for action in list(parser._actions):
        if action.dest in names and action.option_strings[0] == f"--{action.dest}":
            action.nargs, action.const = "?", True
            parser.add_argument(f"--no_{action.dest}", dest=action.dest, action="store_const", const=False,
                                help=f"Turn {action.dest} off.")


def option_line(field: dataclasses.Field, values: dict, help_text: str | None = None,
                secret: re.Pattern | None = None) -> str:
    """One line of a short help: `--name`, the first line of its help (`help_text` or the field's own) and, in
    brackets, the value a run uses (`values[name]`, else the field's default; an enum by its value, a list space
    separated; nothing for an unset, false or `secret`-named one)."""
    if secret is not None and secret.search(field.name):
        value = None  # a secret is never shown
    elif field.name in values:
        value = getattr(values[field.name], "value", values[field.name])  # enums (save_strategy, ...) by their value
    elif field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        value = None
    if isinstance(value, list):
        value = " ".join(map(str, value))
    text = (help_text or field.metadata.get("help", "")).split("\n")[0]
    return f"  --{field.name:<34} {text}" + (f" [{value}]" if value not in (None, False, "") else "")
