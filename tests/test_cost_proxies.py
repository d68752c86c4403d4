"""`benchmarks/cost_proxies.py` (docs/benchmarks.md "CPU proxies of the GPU cost"): a smoke run at tiny shapes goes
through both proxies for every family and prints its JSON last; the counter's sums on a known product."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def cost_proxies():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import cost_proxies

        yield cost_proxies
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.mark.ci
def test_smoke_run_prints_every_proxy():
    done = subprocess.run([sys.executable, str(BENCHMARKS / "cost_proxies.py"), "--smoke", "--top", "3", "--floor"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    families = {"mt_dense", "mt_tag_grouped_mm", "mt_tag_sorted_loop", "pals", "camtl"}
    assert result["device_work"]["errors"] == {}
    for proxy in ("device_kernels", "device_gflops", "device_bytes", "device_roofline", "host_time"):
        assert set(result["goals_met"][proxy]) == families
        assert set(result["rank_correlation"][proxy]) == {"step", "kernel_time", "kernels"}
    assert set(result["host"]["ratio"]) == families
    # the sorted loop's one host read per MoE layer is answered by the planned even split, and counted
    assert result["device_work"]["host_reads"]["mt_tag_sorted_loop"] > 0
    assert result["device_work"]["host_reads"]["mt_tag_grouped_mm"] == 0
    # the experts' floor: one expert more adds work but, grouped, no kernel; the floor lies below the family's count
    floor = result["device_work"]["experts_floor"]
    assert set(floor) == {"mt_tag_grouped_mm", "mt_tag_sorted_loop"}
    assert floor["mt_tag_grouped_mm"]["per_expert_kernels"] == 0 < floor["mt_tag_sorted_loop"]["per_expert_kernels"]
    for family, row in floor.items():
        assert row["per_expert_gbytes"] > 0
        assert 1 < row["gbytes_floor_ratio"] <= result["device_work"]["gbytes_ratio"][family]


def test_counter_on_fake_tensors(cost_proxies):
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    counter = cost_proxies.WorkCounter()
    with mode:
        a, b = torch.empty(64, 32), torch.empty(32, 16)
        with counter:
            a.t()  # a view: no kernel, no bytes
            a @ b
            sorted_experts = torch.empty(64, dtype=torch.long)
            ends = torch.searchsorted(sorted_experts, torch.empty(4, dtype=torch.long), right=True)
            planned = ends.tolist()
    assert counter.kernels["mm"] == 1 and "t" not in counter.kernels
    assert counter.flops["mm"] == 2 * 64 * 32 * 16
    assert counter.bytes["mm"] == 4 * (64 * 32 + 32 * 16 + 64 * 16)
    assert planned == [16, 32, 48, 64]


def test_counter_counts_a_destination_only_written_once(cost_proxies):
    """A copy into a fresh tensor, a put-back by `index_copy_` and an `out=` result write their destination without
    reading it: each counts it once; an in-place add reads it and writes it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    counter = cost_proxies.WorkCounter()
    with FakeTensorMode():
        x, order = torch.empty(64, 8), torch.empty(64, dtype=torch.long)
        with counter:
            torch.empty_like(x).copy_(x)
            torch.empty_like(x).index_copy_(0, order, x)
            torch.eq(order, 3, out=torch.empty(64, dtype=torch.bool))
            x.add_(x)
    size = 64 * 8 * 4
    assert counter.bytes["copy_"] == 2 * size
    assert counter.bytes["index_copy_"] == 2 * size + 64 * 8
    assert counter.bytes["eq"] == 64 * 8 + 64
    assert counter.bytes["add_"] == 3 * size


def test_spearman(cost_proxies):
    assert cost_proxies.spearman({"a": 1, "b": 2, "c": 3}, {"a": 10, "b": 20, "c": 30}) == 1.0
    assert cost_proxies.spearman({"a": 1, "b": 2, "c": 3}, {"a": 3, "b": 2, "c": 1}) == -1.0
    assert cost_proxies.spearman({"a": 1, "b": 2}, {"a": 1, "b": 2}) is None
