"""`benchmarks/low_rank_step.py` (docs/task-routing-lm.md "Low-rank experts"): a smoke run at tiny shapes trains the
routed low-rank model and one peft LoRA, each in its own subprocess, generates a mixed batch three ways, and prints
its JSON last."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.ci  # subprocesses of a small LM: .ci/run runs it (`pytest -m ci`), out of the default run
def test_smoke_run_prints_steps_memory_and_generation():
    cmd = [sys.executable, str(BENCHMARKS / "low_rank_step.py"), "--smoke", "--rows", "4", "--seq", "8", "--steps", "1",
           "--repeats", "1", "--configs", "routed_hard", "lora_r", "--prompt", "6", "--new", "3", "--gen_repeats", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    train = result["train"]
    assert set(train) == {"routed_hard", "lora_r"} and result["layers"] == 2
    for row in train.values():
        assert row["peak_mib"] >= row["built_mib"] > 0 and row["step_s"] > 0 and len(row["all_step_s"]) == 1
    assert train["lora_r"]["peak_x_lora_r"] == 1.0 and "peak_x_lora_4r" not in train["lora_r"]
    # 4 experts of rank 16 on every projection: 4x the deltas of one rank-16 LoRA on the same linears, plus the router
    assert train["routed_hard"]["trainable"] > 4 * train["lora_r"]["trainable"]
    gen = result["generation"]
    assert set(gen["seconds"]) == {"routed_hard", "dense", "peft_mixed"} and gen["ratio_to_dense"]["dense"] == 1.0
    assert gen["distinct_routes"] > 1
    assert gen["peft_tokens_equal_routed"] is True  # the exported adapters are the routes' deltas exactly
    assert gen["cpu_ratio_to_dense"]["dense"] == 1.0 and all(v > 0 for v in gen["cpu_seconds"].values())


@pytest.mark.ci
def test_only_generation_runs_the_generation_child_alone():
    cmd = [sys.executable, str(BENCHMARKS / "low_rank_step.py"), "--smoke", "--rows", "4", "--prompt", "6",
           "--new", "3", "--gen_repeats", "2", "--threads", "1", "--only-generation"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "train" not in result and result["layers"] == 2
    gen = result["generation"]
    assert gen["threads"] == 1 and gen["repeats"] == 2
    assert {len(v) for v in gen["all_cpu_seconds"].values()} == {2} == {len(v) for v in gen["all_seconds"].values()}
    assert gen["peft_tokens_equal_routed"] is True
