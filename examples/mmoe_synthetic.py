"""MMoE paper, Figures 4 and 5, at the scale this CPU affords: Shared-Bottom vs OMoE vs MMoE on the
synthetic task pair of section 3.2, for several task correlations, over many independent runs.

Model sizes are the paper's (section 5.1): input 100; MoE models with 8 experts of one 16-unit layer;
towers of one 8-unit layer; Shared-Bottom with one 113-unit layer (the same parameter budget). Adam.
Each run draws its own data (seed = run index) and its own initialisation. Reported: task-1 MSE on a
held-out set of the same distribution (the tasks are symmetric, as the paper notes), along training.

Outputs in --output_dir: results.json (every run's final loss, mean curves), loss_vs_steps.png (Figure 4:
mean held-out loss against steps, one panel per correlation), final_loss_histogram.png (Figure 5: the
final losses of all runs, one panel per correlation). Prints a table, then a JSON line.

    python examples/mmoe_synthetic.py [--runs 20] [--steps 2000] [--workers 2] [--correlations 0.0 0.5 0.9 1.0]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
from functools import partial

import numpy as np
import torch
from tqdm.auto import tqdm

from hf_taskmoe import MMoEConfig, MMoEModel, TaskSpec
from hf_taskmoe.training import synthetic_task_pair

MODELS = {"Shared-Bottom": "shared_bottom", "OMoE": "omoe", "MMoE": "mmoe"}
TASKS = [TaskSpec(name="y1", problem_type="regression"), TaskSpec(name="y2", problem_type="regression")]


def run_one(architecture: str, data, args, seed: int) -> list[float]:
    """Train one model; return the held-out task-1 MSE at every evaluation point."""
    torch.manual_seed(seed)
    config = MMoEConfig(
        tasks=TASKS, numeric_features=[f"x{i}" for i in range(data.x.shape[1])], architecture=architecture
    )
    model = MMoEModel(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)
    train_x, train_y, eval_x, eval_y = (
        x[: args.train_size],
        y[: args.train_size],
        x[args.train_size :],
        y[args.train_size :],
    )
    g = torch.Generator().manual_seed(seed)
    curve = []
    for step in range(1, args.steps + 1):
        rows = torch.randint(0, args.train_size, (args.batch_size,), generator=g)
        loss = model(numeric_features=train_x[rows], labels=train_y[rows]).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % args.eval_every == 0 or step == args.steps:
            with torch.no_grad():
                model.eval()
                pred = model(numeric_features=eval_x).task_logits["y1"][:, 0]
                model.train()
            curve.append(float(((pred - eval_y[:, 0]) ** 2).mean()))
    return curve


def run_setting(job: tuple[float, int], args) -> tuple[float, int, float, dict[str, list[float]]]:
    """One (correlation, run): draw the data with seed = run, train the three models on it."""
    torch.set_num_threads(args.threads)
    p, run = job
    data = synthetic_task_pair(args.train_size + args.eval_size, p, seed=run)
    return p, run, data.label_correlation, {name: run_one(arch, data, args, seed=run) for name, arch in MODELS.items()}


def plot(results: dict, args, path_curves: str, path_hist: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    corrs = args.correlations
    steps = [
        min(s * args.eval_every, args.steps)
        for s in range(1, len(next(iter(results.values()))[str(corrs[0])]["mean_curve"]) + 1)
    ]
    fig, axes = plt.subplots(1, len(corrs), figsize=(4.2 * len(corrs), 3.4), sharey=True, squeeze=False)
    for ax, p in zip(axes[0], corrs):
        for name in MODELS:
            ax.plot(steps, results[name][str(p)]["mean_curve"], label=name)
        ax.set_title(f"correlation {p}")
        ax.set_xlabel("training step")
        ax.set_yscale("log")
    axes[0][0].set_ylabel(f"task-1 held-out MSE (mean of {args.runs} runs)")
    axes[0][-1].legend()
    fig.tight_layout()
    fig.savefig(path_curves, dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(corrs), figsize=(4.2 * len(corrs), 3.4), squeeze=False)
    for ax, p in zip(axes[0], corrs):
        finals = [results[name][str(p)]["final_losses"] for name in MODELS]
        bins = np.histogram_bin_edges(np.concatenate(finals), bins=15)
        for name, values in zip(MODELS, finals):
            ax.hist(values, bins=bins, alpha=0.5, label=name)
        ax.set_title(f"correlation {p}")
        ax.set_xlabel("final task-1 held-out MSE")
    axes[0][0].set_ylabel("runs")
    axes[0][-1].legend()
    fig.tight_layout()
    fig.savefig(path_hist, dpi=120)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--correlations", type=float, nargs="+", default=[0.0, 0.5, 0.9, 1.0])
    parser.add_argument("--runs", type=int, default=20, help="independent runs (data + initialisation) per setting")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument(
        "--lr", type=float, default=1e-3, help="Adam learning rate (the paper grid-searched 1e-4, 1e-3, 1e-2)"
    )
    parser.add_argument("--train_size", type=int, default=10_000)
    parser.add_argument("--eval_size", type=int, default=2_000)
    parser.add_argument("--eval_every", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--workers", type=int, default=max(1, min(2, os.cpu_count() or 1)), help="parallel processes")
    parser.add_argument("--output_dir", default="runs/mmoe_synthetic")
    args = parser.parse_args()
    os.makedirs(args.output_dir, exist_ok=True)

    started = time.time()
    jobs = [(p, run) for p in args.correlations for run in range(args.runs)]
    outcomes = []
    # tiny models: one thread per process, one process per core
    with multiprocessing.get_context("fork").Pool(args.workers) as pool:
        for outcome in tqdm(
            pool.imap_unordered(partial(run_setting, args=args), jobs), total=len(jobs), desc="settings"
        ):
            outcomes.append(outcome)
    outcomes.sort(key=lambda o: (o[0], o[1]))
    results = {name: {} for name in MODELS}
    label_corr = {}
    for p in args.correlations:
        mine = [o for o in outcomes if o[0] == p]
        label_corr[str(p)] = round(float(np.mean([o[2] for o in mine])), 4)
        for name in MODELS:
            c = np.array([o[3][name] for o in mine])  # (runs, evaluations)
            finals = c[:, -1]
            results[name][str(p)] = {
                "final_mean": round(float(finals.mean()), 5), "final_std": round(float(finals.std()), 5),
                "final_median": round(float(np.median(finals)), 5), "final_losses": finals.round(5).tolist(),
                "mean_curve": c.mean(0).round(5).tolist(),
            }

    plot(
        results,
        args,
        os.path.join(args.output_dir, "loss_vs_steps.png"),
        os.path.join(args.output_dir, "final_loss_histogram.png"),
    )
    print(f"\nFinal task-1 held-out MSE, mean ± std over {args.runs} runs ({args.steps} steps, Adam lr {args.lr})")
    print(f"{'correlation':<12}{'label corr':>11}" + "".join(f"{n:>22}" for n in MODELS))
    for p in args.correlations:
        row = "".join(
            f"{results[n][str(p)]['final_mean']:>13.4f} ± {results[n][str(p)]['final_std']:<6.4f}" for n in MODELS
        )
        print(f"{p:<12}{label_corr[str(p)]:>11.3f}{row}")
    drop = {
        n: round(
            results[n][str(min(args.correlations))]["final_mean"]
            - results[n][str(max(args.correlations))]["final_mean"],
            5,
        )
        for n in MODELS
    }
    average = {
        n: round(float(np.mean([results[n][str(p)]["final_mean"] for p in args.correlations])), 5) for n in MODELS
    }
    print(f"loss increase from correlation {max(args.correlations)} to {min(args.correlations)}: {drop}")
    print(f"mean over correlations: {average}")
    summary = {
        "runs": args.runs, "seeds": f"0..{args.runs - 1} (data and initialisation)", "steps": args.steps,
        "batch_size": args.batch_size, "lr": args.lr, "train_size": args.train_size, "eval_size": args.eval_size,
        "label_correlation": label_corr, "degradation": drop, "mean_over_correlations": average,
        "minutes": round((time.time() - started) / 60, 1),
        "final_mean": {n: {p: results[n][p]["final_mean"] for p in results[n]} for n in MODELS},
    }
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump({**summary, "results": results}, f, indent=1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
