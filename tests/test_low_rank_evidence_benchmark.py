"""`benchmarks/low_rank_evidence.py` (issue 56's real-weights evidence) at tiny size: a random 2-layer Llama with
bytes as tokens trains two of the configurations on the real four-task mixture of examples/data, appends one JSON
line per (configuration, seed), and a second run skips what the file already holds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "low_rank_evidence.py"


def _run(results: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPT), "--smoke", "--results", str(results), "--configs", "lora_all",
           "routed_low_rank", "--steps", "2", "--batch", "4", "--rank", "4", "--eval_per_task", "2",
           "--max_chars", "30", "--max_new", "2"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900)


@pytest.mark.ci  # subprocesses of a small LM: .ci/run runs it (`pytest -m ci`), out of the default run
def test_smoke_run_appends_one_line_per_run_and_resumes(tmp_path):
    results = tmp_path / "evidence.jsonl"
    done = _run(results)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["config"] for r in lines] == ["lora_all", "routed_low_rank"]
    for row in lines:
        assert set(row["exact_match"]) == {"rotten_tomatoes", "trec", "sms_spam", "newsgroups"}
        assert 0 <= row["average"] <= 1 and row["trainable"] > 0 and row["stored"] > row["trainable"]
        assert row["peak_mib"] > 0 and row["step_s"] > 0
    # the routed model stores the dense model, 4 experts' deltas and the router; one LoRA holds a quarter of the deltas
    routed, lora = lines[1], lines[0]
    assert routed["trainable"] > 4 * lora["trainable"]
    summary = json.loads(done.stdout.strip().splitlines()[-1])["summary"]
    assert set(summary) == {"lora_all", "routed_low_rank"} and summary["lora_all"]["step_x_lora_all"] == 1.0
    again = _run(results)  # resumable: both pairs are in the file, nothing runs again
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("skipped") == 2 and len(results.read_text().splitlines()) == 2


@pytest.mark.ci
def test_alternated_smoke_run_times_both_configurations_in_one_process():
    """`benchmarks/low_rank_alternated.py --smoke`: both configurations stepped alternately in one process, wall and
    CPU seconds per step and their ratios to one LoRA in the JSON line it prints last."""
    cmd = [sys.executable, str(SCRIPT.parent / "low_rank_alternated.py"), "--smoke", "--steps", "2", "--rank", "4"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(result["configs"]) == {"lora_all", "routed_low_rank"} and result["smoke"] is True
    for row in result["configs"].values():
        assert len(row["all"]) == 2 and row["wall_s"] > 0 and row["cpu_s"] > 0
    assert result["configs"]["lora_all"]["cpu_x_lora_all"] == 1.0
