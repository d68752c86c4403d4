#!/usr/bin/env python
"""Write the learning rate each method won in the search into the experiment files that train it.

Reads the lr_search results (every method at each learning rate, seed 0), takes for each method the rate with the
best all-task dev average (single-task: the mean over its tasks' cells), and sets it as the method's
`learning_rate` in main.json and robustness.json (same method names), pals_sampling.json (`bert_*` rows: MT-Dense's
rate, `pals_*`: PALs') and camtl_ablation.json (CA-MTL's). Prints the table it chose from.

    python examples/experiments/select_lr.py [--results examples/experiments/results/lr_search.jsonl]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from runner import RESULTS, read_results  # noqa: E402

CONFIGS = HERE / "configs"
# experiment file -> {method name prefix: the searched method whose rate it takes}
TARGETS = {
    "main.json": None,  # same names
    "robustness.json": None,
    "pals_sampling.json": {"bert_": "mt_dense", "pals_": "pals"},
    "camtl_ablation.json": {"": "camtl"},
}


def best_rates(results: Path) -> tuple[dict[str, float], dict[str, dict[float, float]]]:
    averages: dict[str, dict[float, list[float]]] = {}
    for record in read_results(results).values():
        if record["status"] != "ok":
            continue
        rate = float(record["argv"][record["argv"].index("--learning_rate") + 1])
        scores = averages.setdefault(record["method"], {}).setdefault(rate, [])
        scores.extend(record["scores"].values()) if record.get("task") else scores.append(record["average"])
    table = {m: {r: statistics.mean(v) for r, v in by_rate.items()} for m, by_rate in averages.items()}
    return {m: max(by_rate, key=by_rate.get) for m, by_rate in table.items()}, table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=str(RESULTS / "lr_search.jsonl"))
    parser.add_argument("--configs", default=str(CONFIGS))
    args = parser.parse_args(argv)
    best, table = best_rates(Path(args.results))
    for method, by_rate in table.items():
        cells = "  ".join(f"{rate:g}: {100 * score:.2f}" for rate, score in sorted(by_rate.items()))
        print(f"{method:<12} {cells}  -> {best[method]:g}")
    for name, mapping in TARGETS.items():
        path = Path(args.configs) / name
        spec = json.loads(path.read_text())
        for method in spec["methods"]:
            source = method["name"] if mapping is None else next(
                (src for prefix, src in mapping.items() if method["name"].startswith(prefix)), None)
            if source in best:
                method.setdefault("args", {})["learning_rate"] = best[source]
        path.write_text(json.dumps(spec, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
