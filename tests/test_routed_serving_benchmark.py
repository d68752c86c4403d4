"""`benchmarks/routed_serving.py` at tiny shapes on the CPU (a smoke run, its timings mean nothing): a bounded run
(`--budget-s`) stops after its first round and still ends with the JSON line, which says so; each phase is reported
on stderr with its seconds, the export apart (its method and iterations in the JSON)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

# out of the default run for its time: .ci/run runs it (`pytest -m ci`)
pytestmark = pytest.mark.ci

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--batch", "4", "--prompt", "6",
        "--new", "3", "--repeats", "1"]


def run(*args):
    done = subprocess.run([sys.executable, "routed_serving.py", *TINY, *args], cwd=BENCHMARKS, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_a_bounded_run_stops_after_its_first_round_with_its_json_line():
    result, log = run("--rounds", "3", "--budget-s", "0", "--svd", "subspace")
    assert (result["rounds"], result["rounds_done"], result["partial"]) == (3, 1, True)
    assert result["export_svd"] == "subspace" and 4 <= result["export_svd_iterations"] <= 64  # q/o/MLP: 64 wide
    assert result["export_s"] > 0 and result["total_s"] >= result["export_s"]
    for variant in ("routed", "peft_mixed", "export_task", "dense"):
        assert result[f"{variant}_ms"] > 0 and f"warm-up {variant}:" in log
    assert "] export: adapters rank 16 on cpu, svd subspace" in log and "round 1/3:" in log
    assert "stopping after 1 of 3 rounds" in log and "round 2/3" not in log


def test_an_unbounded_run_of_chosen_variants_does_every_round():
    result, log = run("--rounds", "2", "--variants", "routed,dense")
    assert (result["rounds_done"], result["partial"], result["export_svd"]) == (2, False, "auto")
    assert result["export_svd_iterations"] == 0  # on the CPU "auto" is the exact SVD
    assert "peft_mixed_ms" not in result and "export_task_ms" not in result and result["routed_ratio"] > 0
    assert "round 2/2:" in log and "peft model loaded" not in log
