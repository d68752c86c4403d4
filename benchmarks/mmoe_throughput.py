"""Training throughput (rows/second) of MMoEModel on census-income-shaped input, side by side with OMoE
and Shared-Bottom of the same width.

Input: 7 numeric + 31 categorical columns with the census-income cardinalities (4-dim embeddings);
2 binary tasks; MMoE/OMoE with 8 experts of 32 units, Shared-Bottom of 256 units, towers of 8; batch
1024; Adam. Random rows of those shapes (throughput does not depend on the values). Runs alternate
between the models so that machine noise hits all alike; each figure is a median.

    python benchmarks/mmoe_throughput.py [--rounds 7] [--steps 30] [--threads 2]

Prints a table, then one JSON line: {"mmoe_rows_per_s": ..., "mmoe_vs_shared_bottom_time_ratio": ...}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hf_taskmoe import MMoEConfig, MMoEModel, TaskSpec

CARDINALITIES = [
    10,
    53,
    48,
    4,
    25,
    16,
    6,
    11,
    3,
    4,
    7,
    9,
    7,
    7,
    52,
    39,
    9,
    11,
    10,
    11,
    4,
    5,
    6,
    44,
    44,
    44,
    6,
    4,
    4,
    4,
    3,
]


def make_model(architecture: str) -> MMoEModel:
    config = MMoEConfig(
        tasks=[TaskSpec(name="income", num_labels=2), TaskSpec(name="never_married", num_labels=2)],
        numeric_features=[f"n{i}" for i in range(7)], categorical_features=[f"c{i}" for i in range(len(CARDINALITIES))],
        categorical_cardinalities=CARDINALITIES, architecture=architecture, num_experts=8, expert_hidden_sizes=[32],
        bottom_hidden_sizes=[256], tower_hidden_sizes=[8],
    )
    return MMoEModel(config)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=30, help="training steps per timed round")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    batch = {
        "numeric_features": torch.randn(args.batch, 7),
        "categorical_features": torch.stack([torch.randint(0, c, (args.batch,)) for c in CARDINALITIES], 1),
        "labels": torch.randint(0, 2, (args.batch, 2)).float(),
    }
    runs = {}
    for name in ("mmoe", "omoe", "shared_bottom"):
        model = make_model(name)
        runs[name] = (model, torch.optim.Adam(model.parameters(), lr=1e-3), [])

    def steps(model, optimizer):
        for _ in range(args.steps):
            loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

    for model, optimizer, _ in runs.values():
        steps(model, optimizer)  # warm-up
    for _ in range(args.rounds):
        for model, optimizer, times in runs.values():
            start = time.perf_counter()
            steps(model, optimizer)
            times.append((time.perf_counter() - start) / args.steps)

    per_step = {name: statistics.median(times) for name, (_, _, times) in runs.items()}
    rows = {name: args.batch / t for name, t in per_step.items()}
    print(f"{'model':<15}{'ms/step':>10}{'rows/s':>12}")
    for name in runs:
        print(f"{name:<15}{1000 * per_step[name]:>10.2f}{rows[name]:>12,.0f}")
    print(json.dumps({
        "batch": args.batch, "threads": args.threads,
        "mmoe_rows_per_s": round(rows["mmoe"]), "omoe_rows_per_s": round(rows["omoe"]),
        "shared_bottom_rows_per_s": round(rows["shared_bottom"]),
        "mmoe_vs_shared_bottom_time_ratio": round(per_step["mmoe"] / per_step["shared_bottom"], 3),
    }))


if __name__ == "__main__":
    main()
