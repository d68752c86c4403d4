"""`examples/run_multitask.py`'s family settings are read from the families' configs
(`hf_taskmoe.cli.family_options`): every option users had before still parses and reaches the config, every
settable config field is an option, and a new family's setting is one without an edit to the script."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import HfArgumentParser

from hf_taskmoe.cli import train
from hf_taskmoe.cli.errors import UsageError
from hf_taskmoe.cli.family_options import (
    config_kwargs,
    config_options,
    family_options,
    options_dataclass,
    own_config_fields,
)
from hf_taskmoe.models import FAMILIES, get_family
from hf_taskmoe.models.task_moe import TaskMoEConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import run_multitask  # noqa: E402

# (option, command-line values, family whose config takes it, the config value): the 25 family options the script
# listed by hand before issue 45
EARLIER = [
    ("num_experts", ["2"], "bert_taskmoe", 2),
    ("gating", ["shared"], "bert_taskmoe", "shared"),
    ("top_k", ["2"], "bert_taskmoe", 2),
    ("expert_weighting", ["gate"], "bert_taskmoe", "gate"),
    ("moe_layers", ["0", "1"], "bert_taskmoe", [0, 1]),
    ("router_aux_loss_coef", ["0.01"], "bert_taskmoe", 0.01),
    ("router_z_loss_coef", ["0.001"], "bert_taskmoe", 0.001),
    ("scale_loss_by_num_classes", [], "bert_taskmoe", True),
    ("classifier_pooling", ["cls"], "bert_taskmoe", "cls"),
    ("pal_size", ["24"], "bert_pals", 24),
    ("pal_num_heads", ["2"], "bert_pals", 2),
    ("pal_layers", ["1"], "bert_pals", [1]),
    ("pal_attention_dropout", ["0.1"], "bert_pals", 0.1),
    ("pal_task_groups", ["a,b", "c"], "bert_pals", [["a", "b"], ["c"]]),
    ("num_frozen_layers", ["1"], "camtl", 1),
    ("task_embedding_dim", ["16"], "camtl", 16),
    ("conditional_attention", [], "camtl", True),
    ("conditional_alignment", [], "camtl", True),
    ("conditional_layer_norm", [], "camtl", True),
    ("conditional_bottleneck", ["large"], "camtl", "large"),
    ("conditional_attention_max_length", ["64"], "camtl", 64),
    ("selection", ["hard"], "bart_routed", "hard"),
    ("router_type", ["lstm"], "bart_routed", "lstm"),
    ("freeze_task_embeddings", [], "bart_routed", True),
]


@pytest.mark.parametrize("name, values, family, expected", EARLIER, ids=[e[0] for e in EARLIER])
def test_every_earlier_option_parses_and_reaches_the_family_config(name, values, family, expected):
    model_args, *_ = run_multitask.parse_args(["--model_family", family, f"--{name}", *values])
    kwargs, ignored = config_kwargs(model_args, get_family(family), train.family_settings())
    assert kwargs == {name: expected} and ignored == []
    tasks = [{"name": n, "num_labels": 2} for n in "abc"] if name == "pal_task_groups" else None
    config = get_family(family).config_class(tasks=tasks, **kwargs)  # a value the config takes
    assert getattr(config, name) == expected


def test_unset_options_leave_the_family_defaults_and_switches_turn_off():
    model_args, *_ = run_multitask.parse_args([])
    assert config_kwargs(model_args, get_family("bert_taskmoe"), train.family_settings()) == ({}, [])
    model_args, *_ = run_multitask.parse_args(["--model_family", "camtl", "--no_conditional_attention"])
    kwargs, ignored = config_kwargs(model_args, get_family("camtl"), train.family_settings())
    assert kwargs == {"conditional_attention": False} and ignored == []


@pytest.mark.parametrize("family, foreign, values, owner", [
    ("mt-tag", "pal_size", ["64"], "pals"),
    ("camtl", "pal_size", ["8"], "pals"),
    ("bert_pals", "num_experts", ["8"], "mt-tag"),
    ("bert_taskmoe", "conditional_attention", [], "ca-mtl"),
])
def test_a_setting_of_another_method_is_refused_while_parsing(family, foreign, values, owner):
    """`--pal_size 64 --model_family mt-tag` was dropped with a warning; it is refused, naming the method that takes
    it, before any data or checkpoint is read. Left unset (its default, None) the same setting passes."""
    with pytest.raises(UsageError) as caught:
        run_multitask.parse_args(["--model_family", family, f"--{foreign}", *values])
    message = str(caught.value)
    assert f"--{foreign} (a setting of {owner}" in message and f"--model_family {family}" in message
    assert "\n" not in message  # one paragraph
    model_args, *_ = run_multitask.parse_args(["--model_family", family])
    assert getattr(model_args, foreign) is None


def test_every_settable_config_field_of_every_family_is_an_option():
    parser = train.build_parser()
    options = {s for a in parser._actions for s in a.option_strings}
    for family in FAMILIES.values():
        if not family.buildable_from_dense:
            continue
        own = family_options(family)
        for field in own_config_fields(family.config_class):
            declared = field.type if isinstance(field.type, str) else str(field.type)
            if "dict" in declared or "PreTrainedConfig" in declared:
                assert field.name not in own  # a command line cannot say it
                continue
            assert field.name in own and f"--{field.name}" in options, (family.name, field.name)
        assert "tasks" not in own and "upcycled_from" not in own  # set by the build itself


def test_a_new_familys_setting_is_an_option_without_editing_the_script():
    class KnobConfig(TaskMoEConfig):
        r"""
        Args:
            knob_size (`int`, *optional*, defaults to 3):
                How big each knob is. Not in any other family.
            knob_layers (`list[int]`, *optional*):
                Layers with knobs.
        """

        model_type = "taskmoe_knob"
        knob_size: int = 3
        knob_layers: list | None = None

    family = SimpleNamespace(name="knob", method="knobs", config_class=KnobConfig)
    options = config_options([family])
    assert options["knob_size"].help == "How big each knob is." and options["knob_size"].methods == ("knobs",)
    assert options["knob_layers"].is_list and options["num_experts"].kind is int  # inherited settings too
    arguments_class = options_dataclass(options)
    (parsed,) = HfArgumentParser(arguments_class).parse_args_into_dataclasses(
        ["--knob_size", "5", "--knob_layers", "0", "2"]
    )
    assert config_kwargs(parsed, family, options) == ({"knob_size": 5, "knob_layers": [0, 2]}, [])
    assert {f.name for f in dataclasses.fields(arguments_class)} == set(options)


def test_short_help_lists_each_methods_settings():
    text = train.short_help([])
    settings = text.split("method settings")[1].split("\n\n")[0].splitlines()[1:]
    by_method: dict[str, str] = {}  # a method -> every option listed under it (alone or shared with others)
    for line in settings:
        if not line.startswith("    "):  # "  mt-tag, task-routing: --num_experts ..."; wrapped lines are indented 4
            methods, line = line.split(": ", 1)
            methods = [m.strip() for m in methods.split(",")]
        for method in methods:
            by_method[method] = by_method.get(method, "") + " " + line
    assert "--num_experts" in by_method["mt-tag"] and "--pal_size" in by_method["pals"]
    assert "--selection" in by_method["task-routing"] and "--num_frozen_layers" in by_method["ca-mtl"]
    assert "--num_experts" in by_method["task-routing"] and "--pal_size" not in by_method["mt-tag"]
