#!/usr/bin/env bash
# The whole evidence suite on this machine's CPU, one cell at a time, in dependency order; resumable: run it again
# after any interruption and it continues with the cells that are not done. Long: start it in the background,
#   nohup bash examples/experiments/run_all.sh > runs/suite.log 2>&1 &
# and read the progress in runs/suite.log. THREADS (default 1) threads per cell.
set -u
cd "$(dirname "$0")/../.."
threads=${THREADS:-1}
for experiment in main robustness unseen_task text2text text2text_unseen pals_sampling camtl_ablation; do
  python examples/experiments/runner.py "examples/experiments/configs/$experiment.json" --threads "$threads"
done
