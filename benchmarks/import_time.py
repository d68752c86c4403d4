"""Import time of hf_taskmoe over transformers, each measured in fresh interpreters.

Every figure is the median, over `--repeats` new `python` processes, of the wall time (`time.perf_counter`) of the
import statements alone (interpreter start-up excluded). Compared side by side in the same run:

- `transformers_s`: `import transformers` (lazy: no torch);
- `config_floor_s`: `import transformers; from transformers import PreTrainedConfig`, what registering a config
  with `AutoConfig` needs at the least (transformers 5.x's config base imports torch);
- `model_floor_s`: `import transformers; from transformers import PreTrainedModel; import transformers.pipelines`,
  what registering model classes and pipelines eagerly needs (this imports scipy, through transformers.loss);
- `hf_taskmoe_s`: `import transformers; import hf_taskmoe`.

`hf_taskmoe_over_transformers_s` = `hf_taskmoe_s - transformers_s` (the goal: under 0.5 s);
`hf_taskmoe_over_model_floor_s` = `hf_taskmoe_s - model_floor_s` (hf_taskmoe's own share).
Usage: `python benchmarks/import_time.py [--repeats 5]`; the last line is one JSON object.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STATEMENTS = {
    "transformers_s": "import transformers",
    "config_floor_s": "import transformers; from transformers import PreTrainedConfig",
    "model_floor_s": "import transformers; from transformers import PreTrainedModel; import transformers.pipelines",
    "hf_taskmoe_s": "import transformers; import hf_taskmoe",
}


def time_import(statement: str) -> float:
    code = (f"import sys, time; sys.path.insert(0, {str(ROOT)!r}); start = time.perf_counter(); {statement}; "
            "print(time.perf_counter() - start)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    samples = {name: [] for name in STATEMENTS}
    for _ in range(args.repeats):  # interleaved, so load on the machine falls on every statement alike
        for name, statement in STATEMENTS.items():
            samples[name].append(time_import(statement))
    result = {name: round(statistics.median(times), 3) for name, times in samples.items()}
    for name, times in samples.items():
        print(f"{name:16s} median {result[name]:.3f} s  runs {[round(t, 3) for t in times]}")
    result["hf_taskmoe_over_transformers_s"] = round(result["hf_taskmoe_s"] - result["transformers_s"], 3)
    result["hf_taskmoe_over_model_floor_s"] = round(result["hf_taskmoe_s"] - result["model_floor_s"], 3)
    result["repeats"] = args.repeats
    print(json.dumps(result))


if __name__ == "__main__":
    main()
