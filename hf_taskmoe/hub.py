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

from .tasks import TaskSpec

# the Hub's task types
HUB_TASK_TYPES = {
    "single_label_classification": "text-classification",
    "multi_label_classification": "text-classification",
    "regression": "text-classification",
    "multiple_choice": "multiple-choice",
    "span_classification": "text-classification",
    "token_classification": "token-classification",
    "seq2seq": "text2text-generation",
}

METHODS = {
    "taskmoe_bert": lambda c: (
        "MT-Dense (one FFN per layer)" if c.num_experts == 1
        else f"{'MT-TaG (task-aware gates)' if c.gating == 'task' else 'MT-Switch (one shared gate)'}: "
        f"{c.num_experts} experts per MoE layer, top-{c.top_k} routing, expert weighting `{c.expert_weighting}`, "
        f"MoE layers {c.moe_layer_indices}"
    ),
    "taskmoe_mmoe": lambda c: (
        {"mmoe": "MMoE (one softmax gate per task)", "omoe": "OMoE (one gate shared by the tasks)"}.get(c.architecture, "Shared-Bottom")
        + (f": {c.num_experts} experts of {c.expert_hidden_sizes}" if c.architecture != "shared_bottom" else f": bottom {c.bottom_hidden_sizes}")
        + f", towers {c.tower_hidden_sizes}"
    ),
    "taskmoe_camtl": lambda c: (
        f"CA-MTL: task embeddings of size {c.task_dim}; conditional attention "
        f"{'on (' + str(c.attention_blocks) + ' blocks, L=' + str(c.conditional_attention_max_length) + ')' if c.conditional_attention else 'off'}, "
        f"alignment {'on' if c.conditional_alignment else 'off'}, CLN {'on' if c.conditional_layer_norm else 'off'}, "
        f"bottleneck {c.conditional_bottleneck}; conditional layers {c.conditional_layer_indices}; bottom "
        f"{c.frozen_layers} layers{' and the embeddings' if c.freeze_embeddings else ''} frozen"
    ),
    "taskmoe_bart_routed": lambda c: (
        f"Task-level MoE over BART layers: {c.num_experts} experts per routed layer ({c.num_routed_layers} routed "
        f"layers), {c.router_type} router, selection `{c.selection}`, task representations of size {c.task_dim}"
        f"{' (frozen)' if c.freeze_task_embeddings else ''}"
    ),
    "taskmoe_bert_pals": lambda c: (
        f"BERT + Projected Attention Layers: PAL size s={c.pal_size}, {c.pal_num_heads} PAL heads, PAL layers "
        f"{c.pal_layer_indices}, PAL groups {c.pal_groups}"
    ),
}


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


def eval_results(tasks: list[TaskSpec], metrics: dict[str, float], prefix: str = "eval", split: str = "validation") -> list[EvalResult]:
    """One `EvalResult` per (task, dataset, metric) found as `{prefix}_{task}_{metric}` in `metrics`."""
    results = []
    for task in tasks:
        for metric in task.metrics:
            key = f"{prefix}_{task.name}_{metric}"
            if key not in metrics:
                continue
            results.append(
                EvalResult(
                    task_type=HUB_TASK_TYPES[task.problem_type],
                    task_name=task.name,
                    dataset_type=task.dataset or task.name,
                    dataset_name=task.dataset or task.name,
                    dataset_config=task.dataset_config or task.name,
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
        lines.append(f"| {name} | {stats.as_number(count)} | {entropy[:, t].mean().item():.3f} | {int(unused[:, t].sum())} |")
    return "\n".join(lines)


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
) -> ModelCard:
    """A `ModelCard` for a trained multi-task model (see module docstring)."""
    from . import __version__
    from .analysis import parameter_report

    config = model.config
    tasks = config.task_specs
    metrics = metrics or {}
    model_name = model_name or (repo_id.split("/")[-1] if repo_id else f"{config.model_type}-multitask")
    base_model = getattr(config, "upcycled_from", None)
    card_data = ModelCardData(
        model_name=model_name,
        license=license,
        library_name="transformers",
        tags=["hf_taskmoe", "multi-task", config.model_type],
        eval_results=eval_results(tasks, metrics) or None,
        base_model=base_model if base_model and "/" in base_model and not Path(base_model).exists() else None,
    )
    metric_names = list(dict.fromkeys(m for t in tasks for m in t.metrics))
    results = []
    for task in tasks:
        values = [metrics.get(f"eval_{task.name}_{m}") for m in metric_names]
        if any(v is not None for v in values):
            results.append({"task": task.name, "cells": " | ".join("" if v is None else f"{100 * v:.2f}" for v in values)})
    aggregates = {
        label: f"{100 * metrics[key]:.2f}"
        for key, label in (("eval_average", "average over tasks"), ("eval_small_tasks_average", "average over small tasks"))
        if key in metrics
    }
    report = parameter_report(model)
    method = METHODS.get(config.model_type, lambda c: c.model_type)(config)
    summary = routing_summary(routing, routing_source)
    if heatmap:
        summary += f"\n\n![routing heatmap]({heatmap})"
    return ModelCard.from_template(
        card_data,
        template_path=str(template_path()),
        model_name=model_name,
        summary=f"A multi-task model with {len(tasks)} tasks ({', '.join(t.name for t in tasks)}), built with hf_taskmoe.",
        family=config.model_type,
        model_class=type(model).__name__,
        method=method,
        base_model=base_model or "trained from the configuration",
        parameters=", ".join(f"{role} {n:,}" for role, n in report.by_role.items()) + f"; total {report.total:,}",
        tasks=[
            {
                "name": t.name,
                "problem_type": t.problem_type,
                "labels": ", ".join(t.label_names) if t.label_names else (t.num_labels if t.num_labels else "-"),
                "metrics": ", ".join(t.metrics),
                "dataset": t.dataset or "-",
                "train_size": (train_sizes or {}).get(t.name, "-"),
            }
            for t in tasks
        ],
        results=results,
        results_header="| task | " + " | ".join(metric_names) + " |\n|" + "---|" * (len(metric_names) + 1),
        aggregates=aggregates,
        eval_note=eval_note,
        routing_summary=summary,
        training=training or {"training": "not recorded"},
        repo_id=repo_id or "path/to/this/model",
        first_task=tasks[0].name,
        license=license,
        data_terms=data_terms or "see each dataset's licence.",
        library_version=__version__,
    )


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
        package = module.split(".")[: len(module.split(".")) - node.level]
        return ".".join(package + [node.module])
    if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "hf_taskmoe":
        return node.module
    if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "hf_taskmoe" for a in node.names):
        raise NotImplementedError(f"{module}: `import hf_taskmoe...` cannot be bundled; use `from ... import`.")
    return None


def _bundle_modules(root: str) -> list[str]:
    """`root` and every hf_taskmoe module it imports (also inside functions), dependencies first."""
    import ast

    order: list[str] = []

    def visit(name: str, stack: tuple[str, ...]) -> None:
        if name in order or name in stack:
            return
        tree = ast.parse(_module_path(name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                target = _internal_target(name, node)
                if target is not None:
                    visit(target, stack + (name,))
        order.append(name)

    visit(root, ())
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
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
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
                raise RuntimeError(f"Cannot bundle {model_cls.__name__}: `{name}` is defined in both {owner[name]} and {module}.")
            owner[name] = module
        parts.append(f"# {'-' * 20} {module} {'-' * 20}\n{code}\n")
    from . import __version__

    header = (
        f'"""{model_cls.__name__} for `trust_remote_code=True`: generated by hf_taskmoe {__version__} '
        f"(`hf_taskmoe.hub.export_for_remote_code`) from {', '.join(modules)}. Do not edit; regenerate.\"\"\"\n\n"
        "from __future__ import annotations\n\n"
    )
    return header + "\n".join(parts)


def export_for_remote_code(model, folder: str | Path, tokenizer=None, max_shard_size: str | int = "5GB", **card_kwargs) -> Path:
    """Write `folder` so that `AutoModel.from_pretrained(folder, trust_remote_code=True)` loads the model in a
    Python without hf_taskmoe: config (with `auto_map`), safetensors weights, the tokenizer, a model card
    and one modeling file holding the family's code. `card_kwargs` go to `render_model_card`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"modeling_{model.config.model_type}"
    code = bundle_source(type(model))
    compile(code, stem + ".py", "exec")  # a syntax error here, not on the user's machine
    (folder / f"{stem}.py").write_text(code)
    config = model.config
    previous = getattr(config, "auto_map", None)
    config.auto_map = {"AutoConfig": f"{stem}.{type(config).__name__}"}
    config.auto_map.update({auto: f"{stem}.{type(model).__name__}" for auto in getattr(type(model), "auto_classes", ("AutoModel",))})
    try:
        model.save_pretrained(folder, max_shard_size=max_shard_size)
    finally:
        config.auto_map = previous
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    render_model_card(model, **card_kwargs).save(folder / "README.md")
    return folder
