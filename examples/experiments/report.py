#!/usr/bin/env python
"""Tables and plots of experiments, made from their results files alone (see runner.py).

    python examples/experiments/report.py examples/experiments/configs/main.json [more experiment files]
        [--results FILE ...] [--out examples/experiments/results]

For each experiment: a markdown table (`<name>.md`: one row per method and variant, one column per task, then the
small-task and all-task averages; mean ± standard deviation over seeds, x100 (the mean alone for one seed); the best
mean of each column in bold; the number of seeds), a bar chart of the per-task scores with their standard deviations
(`<name>_scores.png`), the dev curves during training (`<name>_curves.png`, mean over seeds) and, where cells routed
between experts, each routed method's routes per task on the dev sets (`<name>_routes.png`, its lowest seed) with a
table of the layers each pair of tasks shares (mean over seeds), and where cells generated text, sample generations
(input, target and each method's output for the first dev examples of each task, lowest seed). A task's score is the
mean of its metrics. Single-task methods (one cell per task) make one row.

Comparisons use one rule everywhere (`verdict`): a difference of means counts only when it exceeds twice the
larger of the two standard deviations; otherwise it is reported as "no difference" ("inconclusive" with one seed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runner import RESULTS, load_experiment, read_results, read_spec, same_command  # noqa: E402


def load_records(path: Path) -> list[dict]:
    """The finished cells of a results file (the last record of each cell, status ok), in file order."""
    return [r for r in read_results(path).values() if r.get("status") == "ok"]


def current(records: list[dict], experiment_file: Path) -> tuple[list[dict], list[str]]:
    """The records that ran the command line the experiment file gives their cells now (options a runner added
    with `--set` allowed), and the keys of the others: a table never mixes a changed budget with the old one.
    Records without a command line (written by hand) are kept."""
    try:
        cells = {c.key: c for c in load_experiment(experiment_file)[1]}
    except (OSError, KeyError, ValueError):  # a file without runnable cells (tables written by hand)
        return records, []
    keep, stale = [], []
    for r in records:
        cell = cells.get(r.get("cell"))
        if "argv" in r and (cell is None or not same_command(r["argv"], cell.argv, extra_allowed=True)):
            stale.append(r.get("cell", "?"))
        else:
            keep.append(r)
    return keep, stale


def row_name(record: dict) -> str:
    return record["method"] + (f" ({record['variant']})" if record.get("variant") else "")


def ordered(records: list[dict], spec: dict | None) -> list[dict]:
    """Records in the experiment file's order of methods and variants (they finish in any order)."""
    if not spec:
        return records
    rank = {}
    for i, method in enumerate(spec.get("methods", [])):
        for j, variant in enumerate(method.get("variants") or {None: None}):
            rank[(method["name"], variant)] = (i, j)
    return sorted(records, key=lambda r: (*rank.get((r["method"], r.get("variant")), (len(rank), 0)), r["seed"]))


def per_seed(records: list[dict], tasks: list[str], small: list[str]) -> dict[str, dict[int, dict[str, float]]]:
    """`{row: {seed: {task: score, "small avg": x, "avg": y}}}`; single-task rows gather their tasks' cells."""
    rows: dict[str, dict[int, dict[str, float]]] = {}
    for r in records:
        seeds = rows.setdefault(row_name(r), {})
        scores = seeds.setdefault(r["seed"], {})
        scores.update({t: v for t, v in r["scores"].items() if t in tasks})
    for seeds in rows.values():
        for _seed, scores in list(seeds.items()):
            present = [t for t in tasks if t in scores]
            if len(present) == len(tasks):
                scores["avg"] = statistics.mean(scores[t] for t in tasks)
                if small and all(t in scores for t in small):
                    scores["small avg"] = statistics.mean(scores[t] for t in small)
    return rows


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def verdict(a: list[float], b: list[float]) -> str:
    """Compare two sets of per-seed scores (x1): 'higher' / 'lower' (a relative to b) when the difference of the
    means exceeds twice the larger standard deviation, else 'no difference'; 'inconclusive' when either side has
    fewer than two seeds (no standard deviation to compare with)."""
    if min(len(a), len(b)) < 2:
        return "inconclusive"
    (ma, sa), (mb, sb) = mean_std(a), mean_std(b)
    if abs(ma - mb) <= 2 * max(sa, sb):
        return "no difference"
    return "higher" if ma > mb else "lower"


def table(name: str, records: list[dict], tasks: list[str], small: list[str]) -> str:
    rows = per_seed(records, tasks, small)
    columns = tasks + (["small avg"] if small else []) + ["avg"]
    stats = {}
    for row, seeds in rows.items():
        for column in columns:
            values = [s[column] for s in seeds.values() if column in s]
            if values:
                stats[(row, column)] = (*mean_std(values), len(values))
    best = {c: max((stats[(r, c)][0] for r in rows if (r, c) in stats), default=None) for c in columns}
    lines = [f"| method | {' | '.join(columns)} | seeds |", "|---" * (len(columns) + 2) + "|"]
    for row, seeds in rows.items():
        cells = []
        for column in columns:
            if (row, column) not in stats:
                cells.append("-")
                continue
            mean, std, n = stats[(row, column)]
            text = f"{100 * mean:.2f} ± {100 * std:.2f}" if n > 1 else f"{100 * mean:.2f}"  # one seed: no spread
            cells.append(f"**{text}**" if best[column] is not None and mean == best[column] else text)
        lines.append(f"| {row} | {' | '.join(cells)} | {len(seeds)} |")
    return "\n".join(lines)


def plot_scores(path: Path, records: list[dict], tasks: list[str], small: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = per_seed(records, tasks, small)
    columns = tasks + ["avg"]
    width = 0.8 / max(1, len(rows))
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(columns) * max(1, len(rows)) / 3), 4.5))
    for i, (row, seeds) in enumerate(rows.items()):
        means, stds = [], []
        for column in columns:
            values = [s[column] for s in seeds.values() if column in s]
            m, s = mean_std(values) if values else (np.nan, 0.0)
            means.append(100 * m)
            stds.append(100 * s)
        ax.bar(np.arange(len(columns)) + i * width, means, width, yerr=stds, capsize=2, label=row)
    ax.set_xticks(np.arange(len(columns)) + width * (len(rows) - 1) / 2, columns, rotation=20)
    ax.set_ylabel("dev score x100 (mean ± std over seeds)")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_curves(path: Path, records: list[dict], tasks: list[str]) -> bool:
    """Dev score of each task (and the average) against training steps, mean over seeds, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves: dict[str, dict[int, dict[str, list[float]]]] = {}
    for r in records:
        for point in r.get("curve") or []:
            by_step = curves.setdefault(row_name(r), {}).setdefault(point["step"], {})
            for task, value in point["scores"].items():
                by_step.setdefault(task, []).append(value)
    if not curves:
        return False
    panels = [t for t in tasks if any(t in s for c in curves.values() for s in c.values())]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.2), squeeze=False)
    for ax, task in zip(axes[0], panels):
        for row, by_step in curves.items():
            steps = sorted(s for s in by_step if task in by_step[s])
            if steps:
                ax.plot(steps, [100 * statistics.mean(by_step[s][task]) for s in steps], marker=".", label=row)
        ax.set_title(task, fontsize=9)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("dev score x100 (mean over seeds)")
    axes[0][-1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_routes(path: Path, records: list[dict]) -> list[str]:
    """Each routed method's routes on the dev sets (the share of each task's examples or tokens per expert, per
    routed layer), from its lowest seed's record, one heatmap per method; the methods drawn (none: no figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hf_taskmoe.analysis.routing import RoutingStatistics

    chosen: dict[str, dict] = {}
    for r in sorted(records, key=lambda r: r["seed"]):
        if r.get("routing") and row_name(r) not in chosen:
            chosen[row_name(r)] = r
    if not chosen:
        return []
    stats = {name: RoutingStatistics.from_dict(r["routing"]) for name, r in chosen.items()}
    width = max(s.figure_size()[0] for s in stats.values())
    heights = [s.figure_size()[1] for s in stats.values()]
    fig, axes = plt.subplots(len(stats), 1, figsize=(width, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, (name, s) in zip(axes[:, 0], stats.items()):
        s.plot(None, title=f"{name}, seed {chosen[name]['seed']}", ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return list(stats)


def route_sharing(records: list[dict]) -> str:
    """Per routed method, a task x task table of the routed layers in which two tasks send most of their examples to
    the same expert (`RoutingStatistics.shared_routes`), mean over seeds, out of the number of routed layers; the
    diagonal is how many layers each task's route decides. Empty when no record routed or none decided a layer."""
    from hf_taskmoe.analysis.routing import RoutingStatistics

    by_method: dict[str, list] = {}
    for r in records:
        if r.get("routing"):
            by_method.setdefault(row_name(r), []).append(RoutingStatistics.from_dict(r["routing"]))
    blocks = []
    for name, stats in by_method.items():
        matrices = [st.shared_routes().double() for st in stats]
        if not any(m.sum() for m in matrices):
            continue  # soft routes that decide no layer (average routing)
        mean = sum(matrices) / len(matrices)
        tasks, layers, experts = stats[0].task_names, len(stats[0].layers), stats[0].num_experts
        lines = [f"**{name}** ({len(stats)} seed(s); {layers} routed layers of {experts} experts: two independent "
                 f"random routes would share {layers / experts:.1f})", "",
                 f"| shared layers | {' | '.join(tasks)} |", "|---" * (len(tasks) + 1) + "|"]
        for i, task in enumerate(tasks):
            lines.append(f"| {task} | {' | '.join(f'{float(mean[i, j]):.1f}' for j in range(len(tasks)))} |")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def clip(text: str, width: int) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= width else text[: width - 1] + "…"


def sample_generations(records: list[dict], per_task: int = 2, width: int = 70) -> str:
    """A markdown table of generated text: for each task its first `per_task` dev examples (input clipped to
    `width` characters, target) and each method's output (its lowest seed), so a reader sees what the scores
    count. Empty when no cell saved samples (`generations.json` of `run_multitask.py --predict_with_generate`)."""
    outputs: dict[str, dict[tuple[str, str], str]] = {}  # method -> (task, input) -> output
    examples: dict[str, list[tuple[str, str]]] = {}  # task -> [(input, target)] in the order the cells saved them
    for r in sorted(records, key=lambda r: r["seed"]):
        if not r.get("samples"):
            continue
        seen = outputs.setdefault(row_name(r), {})
        for sample in r["samples"]:
            key = (sample["task"], sample["input"])
            if key in seen:  # a higher seed of a method already drawn, or a repeated sample
                continue
            seen[key] = sample["output"]
            rows = examples.setdefault(sample["task"], [])
            if (sample["input"], sample["target"]) not in rows:
                rows.append((sample["input"], sample["target"]))
    if not outputs:
        return ""
    methods = list(outputs)
    lines = [f"| task | input | target | {' | '.join(methods)} |", "|---" * (len(methods) + 3) + "|"]
    for task, rows in examples.items():
        for text, target in rows[:per_task]:
            cells = [clip(outputs[m].get((task, text), "-"), 40) for m in methods]
            lines.append(f"| {task} | {clip(text, width)} | {clip(target, 40)} | {' | '.join(cells)} |")
    return "\n".join(lines)


def cost(records: list[dict]) -> str:
    reused = [r for r in records if r.get("reused_from")]
    ran = [r for r in records if not r.get("reused_from")]
    total = sum(r.get("process_wall_time_s") or r.get("wall_time_s") or 0 for r in ran)
    peak = max((r.get("peak_rss_mb") or 0 for r in records), default=0)
    threads = sorted({(r.get("machine") or {}).get("threads") for r in records} - {None})
    devices = sorted({str(r.get("device")) for r in records})
    copied = f" (and {len(reused)} reused from another experiment, not counted)" if reused else ""
    resumed = sum(bool(r.get("resumed_from")) for r in ran)
    at_least = f"at least (for {resumed} cell(s) resumed from a checkpoint, the part after it) " if resumed else ""
    return (f"{len(ran)} cells{copied}, {at_least}{total / 3600:.2f} h of wall time in all ({', '.join(devices)}, "
            f"{'/'.join(map(str, threads))} thread(s) per cell), peak memory of a cell {peak:.0f} MB")


def report(experiment_file: Path, results: Path | None, out: Path) -> str:
    spec = read_spec(Path(experiment_file).resolve())
    results = results or RESULTS / f"{spec['name']}.jsonl"
    records, stale = current(load_records(results), Path(experiment_file))
    records = ordered(records, spec)
    tasks = spec.get("report_tasks") or sorted({t for r in records for t in r["scores"]})
    small = spec.get("small_tasks", [])
    out.mkdir(parents=True, exist_ok=True)
    text = [f"## {spec['name']}", "", spec.get("description", ""), "", table(spec["name"], records, tasks, small), "",
            f"Dev scores x100, mean ± std over seeds; best mean per column in bold. {cost(records)}. "
            f"Results: `{results.relative_to(Path.cwd()) if results.is_relative_to(Path.cwd()) else results}`."]
    if stale:
        text.append(f"\n({len(stale)} finished record(s) in that file ran other options than the experiment file now "
                    f"gives their cells and are left out: {', '.join(stale)}.)")
    plot_scores(out / f"{spec['name']}_scores.png", records, tasks, small)
    text.append(f"\n![scores]({spec['name']}_scores.png)")
    if plot_curves(out / f"{spec['name']}_curves.png", records, tasks):
        text.append(f"\n![dev curves]({spec['name']}_curves.png)")
    if plot_routes(out / f"{spec['name']}_routes.png", records):
        text.append(f"\n![routes per task]({spec['name']}_routes.png)")
        sharing = route_sharing(records)
        if sharing:
            text += [
                "",
                "Routes shared between tasks (layers where both send most examples to one expert):",
                "",
                sharing,
            ]
    samples = sample_generations(records)
    if samples:
        text += ["", "Sample generations (greedy; each method's lowest seed):", "", samples]
    markdown = "\n".join(text) + "\n"
    (out / f"{spec['name']}.md").write_text(markdown)
    return markdown


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiments", nargs="+", help="Experiment files (JSON).")
    parser.add_argument(
        "--results", nargs="+", help="Results files, one per experiment (default: results/<name>.jsonl)."
    )
    parser.add_argument("--out", default=str(RESULTS), help="Folder for the tables and plots.")
    args = parser.parse_args(argv)
    results = args.results or [None] * len(args.experiments)
    for experiment, result in zip(args.experiments, results):
        print(report(Path(experiment), Path(result) if result else None, Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
