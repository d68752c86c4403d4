"""The experiment runner and its report (examples/experiments/): cells, restart, failures, tables."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "experiments"))
import claims  # noqa: E402
import report  # noqa: E402
import runner  # noqa: E402


def _tasks(folder: Path) -> Path:
    """A two-task config of a few rows: a classification task and a regression task."""
    rows = {
        "pos": [{"text": f"good film {i}", "label": ["neg", "pos"][i % 2]} for i in range(8)],
        "score": [{"text": f"rating {i}", "label": float(i % 3)} for i in range(8)],
    }
    for name, data in rows.items():
        (folder / name).mkdir(parents=True)
        (folder / name / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    config = {
        "tasks": [
            {
                "name": "pos",
                "label_names": ["neg", "pos"],
                "text_fields": ["text"],
                "train_file": "pos/train.jsonl",
                "validation_file": "pos/train.jsonl",
            },
            {
                "name": "score",
                "problem_type": "regression",
                "text_fields": ["text"],
                "train_file": "score/train.jsonl",
                "validation_file": "score/train.jsonl",
            },
        ]
    }
    (folder / "tasks.json").write_text(json.dumps(config))
    return folder / "tasks.json"


def _experiment(tmp_path: Path, tiny_dense, methods: list[dict]) -> Path:
    tasks = _tasks(tmp_path / "data")
    spec = {
        "name": "tiny",
        "tasks": str(tasks),
        "seeds": [1, 2],
        "small_tasks": ["score"],
        "common": {
            "model_name_or_path": str(tiny_dense),
            "max_steps": 2,
            "per_device_train_batch_size": 4,
            "max_seq_length": 16,
            "use_cpu": True,
            "eval_strategy": "steps",
            "eval_steps": 1,
            "logging_steps": 1,
        },
        "methods": methods,
    }
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(spec))
    return path


def _run(path: Path, tmp_path: Path, *extra: str) -> int:
    return runner.main(
        [str(path), "--results", str(tmp_path / "results.jsonl"), "--runs", str(tmp_path / "runs"), *extra]
    )


@pytest.mark.ci
def test_two_methods_two_seeds_restart_and_report(tmp_path, tiny_dense):
    path = _experiment(tmp_path, tiny_dense, [
        {"name": "mt_dense", "args": {"num_experts": 1}},
        {"name": "mt_tag", "args": {"num_experts": 2}},
    ])
    assert _run(path, tmp_path) == 0
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(r["method"], r["seed"]) for r in records] == [
        ("mt_dense", 1),
        ("mt_tag", 1),
        ("mt_dense", 2),
        ("mt_tag", 2),
    ]
    for r in records:
        assert r["status"] == "ok" and r["steps"] == 2 and set(r["scores"]) == {"pos", "score"}
        assert sum(r["examples_seen"].values()) == 8  # 2 steps of 4 rows
        assert r["curve"] and r["curve"][-1]["step"] == 2  # dev scores during training
        assert r["versions"]["torch"] and r["wall_time_s"] > 0 and r["peak_rss_mb"] > 0
        assert "--seed" in r["argv"] and str(r["seed"]) == r["argv"][r["argv"].index("--seed") + 1]
    assert not list((tmp_path / "runs").rglob("*.safetensors"))  # weights nobody continues are dropped
    # a restart runs nothing: every cell is done
    assert _run(path, tmp_path) == 0
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 4
    # the routed cells carry each task's dev-set route (the dense ones route nothing); the report draws them
    assert all(bool(r["routing"]) == (r["method"] == "mt_tag") for r in records)
    routing = records[1]["routing"]
    assert set(routing["tasks"]) == {"pos", "score"} and routing["num_experts"] == 2
    assert all(
        sum(layer["shares"]) == pytest.approx(1.0, abs=1e-3)
        for t in routing["tasks"].values()
        for layer in t["per_layer"]
    )
    markdown = report.report(path, tmp_path / "results.jsonl", tmp_path / "out")
    assert "| mt_dense |" in markdown and "| mt_tag |" in markdown and "± " in markdown
    assert (tmp_path / "out" / "tiny_scores.png").exists() and (tmp_path / "out" / "tiny_curves.png").exists()
    assert "tiny_routes.png" in markdown and report.plot_routes(tmp_path / "r.png", records) == ["mt_tag"]


@pytest.mark.ci
def test_a_failing_cell_is_recorded_and_the_others_run(tmp_path, tiny_dense):
    path = _experiment(tmp_path, tiny_dense, [
        {"name": "broken", "args": {"gating": "no_such_gating", "num_experts": 2}},
        {"name": "mt_dense", "args": {"num_experts": 1}},
    ])
    assert _run(path, tmp_path, "--seeds", "1") == 1
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["status"] for r in records] == ["error", "ok"]
    assert "gating" in records[0]["error"] and records[0]["exit_code"] == 2
    # the next start retries the failed cell only
    assert _run(path, tmp_path, "--seeds", "1") == 1
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["method"] for r in records] == ["broken", "mt_dense", "broken"]


@pytest.mark.ci
def test_a_cell_another_runner_holds_or_finished_is_left_to_it(tmp_path, tiny_dense, capsys):
    path = _experiment(tmp_path, tiny_dense, [{"name": "mt_dense", "args": {"num_experts": 1}}])
    _, cells = runner.load_experiment(path, tmp_path / "runs")
    lock = runner._lock_path(cells[0])  # mt_dense/seed1
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, b'otherhost 4242'); print('held', flush=True); time.sleep(120)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert _run(path, tmp_path) == 0
        records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
        assert [r["cell"] for r in records] == ["mt_dense/seed2"]  # seed 1 is the other runner's
        printed = capsys.readouterr()
        assert "mt_dense/seed1: running in another runner (otherhost 4242)" in printed.out + printed.err
        assert "1 running in another runner" in printed.out
        runner.main(
            [str(path), "--results", str(tmp_path / "results.jsonl"), "--runs", str(tmp_path / "runs"), "--list"]
        )
        assert "running  mt_dense/seed1  (otherhost 4242)" in capsys.readouterr().out
    finally:
        holder.kill()
        holder.wait()
    # its runner died: the lock went with it, and the cell is free again
    assert runner.lock_holder(cells[0]) is None
    # a cell another runner finished after this one made its plan is not trained again (its argv could not run)
    cells[0].argv = ["--no_such_option"]
    finished = {
        "cell": cells[0].key,
        "method": "mt_dense",
        "seed": 1,
        "status": "ok",
        "scores": {},
        "argv": cells[0].argv,
    }
    runner.append_record(tmp_path / "results.jsonl", finished)
    assert runner.attempt(cells[0], 1, tmp_path / "results.jsonl") == "finished by another runner"
    assert runner.lock_holder(cells[0]) is None  # attempt released it
    assert runner.claim(cells[0]) is None and runner.lock_holder(cells[0]) == f"{socket.gethostname()} {os.getpid()}"
    runner.release(cells[0])
    assert runner.lock_holder(cells[0]) is None


@pytest.mark.ci
def test_an_interrupted_cell_resumes_from_its_checkpoint_to_the_scores_of_an_uninterrupted_one(
    tmp_path, tiny_dense, capsys
):
    path = _experiment(tmp_path, tiny_dense, [{"name": "mt_dense", "args": {"num_experts": 1}}])
    spec = json.loads(path.read_text())
    spec["common"].update(max_steps=24, eval_steps=4)
    path.write_text(json.dumps(spec))
    (whole,), (cell,) = (runner.load_experiment(path, tmp_path / runs)[1][:1] for runs in ("whole", "killed"))
    expected = runner.run_cell(whole, 1)
    assert expected["status"] == "ok" and "resumed_from" not in expected
    assert not list(whole.output_dir.glob("checkpoint-*"))  # a finished cell keeps no checkpoint
    # the same cell's process killed (kill -9) once it starts its checkpoint of step 12 (complete or not)
    argv, resume = runner.cell_command(cell)
    assert (
        resume is None
        and argv[argv.index("--save_strategy") + 1] == "steps"
        and "no" not in argv[argv.index("--save_strategy") :][:2]
    )
    process = subprocess.Popen(
        argv, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 120
    while not (cell.output_dir / "checkpoint-12").exists() and process.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (cell.output_dir / "run_summary.json").exists(), "the run finished before it could be killed"
    # --list names the checkpoint the cell will continue from; seed 2 never started
    capsys.readouterr()
    runner.main([str(path), "--results", str(tmp_path / "results.jsonl"), "--runs", str(tmp_path / "killed"), "--list"])
    listed = capsys.readouterr().out.splitlines()
    assert listed[1] == "todo  mt_dense/seed2"
    assert listed[0] in ("resumable  mt_dense/seed1  (checkpoint-8)", "resumable  mt_dense/seed1  (checkpoint-12)")
    got = runner.run_cell(cell, 1)
    assert got["status"] == "ok" and got["resumed_from"] in ("checkpoint-8", "checkpoint-12")
    assert got["argv"] == expected["argv"] == cell.argv  # the record keeps the experiment's command line
    assert got["scores"] == expected["scores"] and got["steps"] == 24
    assert [point["step"] for point in got["curve"]] == [4, 8, 12, 16, 20, 24, 24]  # and the final evaluation
    assert got["curve"] == expected["curve"]  # the dev curve from before the kill comes back with the checkpoint
    assert not list(cell.output_dir.glob("checkpoint-*"))
    # a folder left by another command line, or by a run without checkpoints, is not resumed: it starts afresh
    cell.output_dir.joinpath("checkpoint-4").mkdir()
    assert runner.resumable_checkpoint(cell) is None  # not complete
    cell.argv = (
        _with(cell.argv, "--learning_rate", "0.5")
        if "--learning_rate" in cell.argv
        else [*cell.argv, "--learning_rate", "0.5"]
    )
    assert runner.resumable_checkpoint(cell) is None and runner.cell_command(cell, checkpoints=False)[1] is None
    assert not cell.output_dir.joinpath("checkpoint-4").exists()


def _with(argv: list[str], option: str, value: str) -> list[str]:
    i = argv.index(option)
    return [*argv[: i + 1], value, *argv[i + 2:]]


@pytest.mark.ci
def test_a_cell_whose_options_changed_since_it_ran_is_stale_and_runs_again(tmp_path, tiny_dense, capsys):
    path = _experiment(tmp_path, tiny_dense, [{"name": "mt_dense", "args": {"num_experts": 1}}])
    _, cells = runner.load_experiment(path, tmp_path / "runs")
    results = tmp_path / "results.jsonl"
    # seed 1 ran this command line; seed 2 ran it with another budget
    records = [
        {
            "cell": c.key,
            "method": "mt_dense",
            "seed": c.seed,
            "status": "ok",
            "scores": {"pos": 0.5, "score": 0.7},
            "argv": argv,
        }
        for c, argv in ((cells[0], cells[0].argv), (cells[1], _with(cells[1].argv, "--max_steps", "3")))
    ]
    for record in records:
        runner.append_record(results, record)
    assert runner.finished(records[0], cells[0]) and not runner.finished(records[1], cells[1])
    assert not runner.finished({**records[0], "status": "error"}, cells[0])
    # the same command line made elsewhere: paths under examples/, a saved model by its last three parts
    a = ["--tasks", "/a/examples/data/t.json", "--model_name_or_path", "/a/runs/exp/m/seed1", "--init_from", "x"]
    b = ["--tasks", "/b/c/examples/data/t.json", "--model_name_or_path", "/tmp/r/exp/m/seed1", "--init_from", "x"]
    assert runner._portable(a) == runner._portable(b)
    # options in another order and numbers written otherwise are the same command; a missing or added option is not
    assert runner.same_command(["--lr", "1e-4", "--x", "a", "b"], ["--x", "a", "b", "--lr", "0.0001"])
    assert not runner.same_command(["--lr", "1e-4"], ["--lr", "3e-4"])
    assert not runner.same_command(["--lr", "1e-4", "--bf16", "true"], ["--lr", "1e-4"])
    assert runner.same_command(["--lr", "1e-4", "--bf16", "true"], ["--lr", "1e-4"], extra_allowed=True)
    assert not runner.same_command(["--lr", "1e-4"], ["--lr", "1e-4", "--bf16", "true"], extra_allowed=True)
    # the report leaves the stale record out of its table and says so
    markdown = report.report(path, results, tmp_path / "report")
    assert "| mt_dense | **50.00** | **70.00** | **70.00** | **60.00** | 1 |" in markdown  # seed 1 alone
    assert "1 finished record(s) in that file ran other options" in markdown and "mt_dense/seed2" in markdown
    _run(path, tmp_path, "--list")
    assert capsys.readouterr().out.splitlines() == ["done  mt_dense/seed1", "stale  mt_dense/seed2"]
    assert _run(path, tmp_path) == 0
    assert "1 finished cell(s) ran another command line" in capsys.readouterr().out
    latest = runner.read_results(results)
    assert latest["mt_dense/seed2"]["argv"] == cells[1].argv and latest["mt_dense/seed2"]["steps"] == 2  # ran again
    assert latest["mt_dense/seed1"] == records[0]  # not trained again


@pytest.mark.ci
def test_single_task_method_trains_one_task_alone(tmp_path, tiny_dense):
    path = _experiment(tmp_path, tiny_dense, [{"name": "single_task", "single_task": True, "args": {"num_experts": 1}}])
    assert _run(path, tmp_path, "--seeds", "1") == 0
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["task"] for r in records] == ["pos", "score"]
    for r in records:
        assert list(r["examples_seen"]) == [r["task"]] and r["examples_seen"][r["task"]] == 8
        assert list(r["scores"]) == [r["task"]]
        config = json.loads((tmp_path / "runs" / "tiny" / r["cell"] / "config.json").read_text())
        assert [t["name"] for t in config["tasks"]] == [r["task"]]


def test_tables_render_from_a_results_file_written_by_hand(tmp_path):
    records = []
    for seed, (a, b) in enumerate([(0.80, 0.50), (0.82, 0.54), (0.78, 0.52)], start=1):
        records.append(
            {"cell": f"mt/seed{seed}", "method": "mt", "seed": seed, "status": "ok", "scores": {"x": a, "y": b}}
        )
        records.append(
            {
                "cell": f"st/x/seed{seed}",
                "method": "st",
                "task": "x",
                "seed": seed,
                "status": "ok",
                "scores": {"x": 0.70},
            }
        )
        records.append(
            {
                "cell": f"st/y/seed{seed}",
                "method": "st",
                "task": "y",
                "seed": seed,
                "status": "ok",
                "scores": {"y": 0.60},
            }
        )
    records.append({"cell": "mt/seed4", "method": "mt", "seed": 4, "status": "error", "error": "boom"})
    results = tmp_path / "hand.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in records))
    spec = tmp_path / "hand.json"
    spec.write_text(json.dumps({"name": "hand", "tasks": "-", "seeds": [1, 2, 3], "methods": [], "small_tasks": ["y"]}))
    markdown = report.report(spec, results, tmp_path)
    lines = {
        line.split("|")[1].strip(): line
        for line in markdown.splitlines()
        if line.startswith("| ") and "---" not in line
    }
    # mt: x 80.00 ± 2.00, y 52.00 ± 2.00, per-seed averages 65, 68, 65 -> 66.00 ± 1.73; st: 70, 60, avg 65, std 0
    assert lines["mt"] == "| mt | **80.00 ± 2.00** | 52.00 ± 2.00 | 52.00 ± 2.00 | **66.00 ± 1.73** | 3 |"
    assert lines["st"] == "| st | 70.00 ± 0.00 | **60.00 ± 0.00** | **60.00 ± 0.00** | 65.00 ± 0.00 | 3 |"
    # (the failed seed-4 cell is not counted)
    assert report.verdict([0.80, 0.82, 0.78], [0.70, 0.70, 0.70]) == "higher"  # 0.10 > 2 x 0.02
    assert report.verdict([0.52, 0.54, 0.50], [0.60, 0.60, 0.60]) == "lower"
    assert report.verdict([0.52, 0.54, 0.50], [0.55, 0.55, 0.55]) == "no difference"  # 0.03 <= 2 x 0.02
    assert report.verdict([0.90], [0.50, 0.52]) == "inconclusive"  # one seed has no spread to compare with


def test_cost_adds_the_cells_wall_times_and_says_when_a_resumed_cell_counts_only_its_last_part():
    records = [{"process_wall_time_s": 1800, "peak_rss_mb": 900, "device": "cpu", "machine": {"threads": 1}},
               {"process_wall_time_s": 3600, "peak_rss_mb": 1200, "device": "cpu", "machine": {"threads": 1}}]
    assert (
        report.cost(records)
        == "2 cells, 1.50 h of wall time in all (cpu, 1 thread(s) per cell), peak memory of a cell 1200 MB"
    )
    records[1]["resumed_from"] = "checkpoint-114"
    assert report.cost(records).startswith(
        "2 cells, at least (for 1 cell(s) resumed from a checkpoint, the part after it) 1.50 h"
    )


def test_text2text_findings_follow_the_two_std_rule_on_per_seed_averages():
    tasks = ["a", "b"]

    def records(method, per_seed_scores, single=False):
        out = []
        for seed, (a, b) in enumerate(per_seed_scores, start=1):
            if single:  # one cell per task, gathered by seed
                out += [
                    {"method": method, "task": t, "seed": seed, "status": "ok", "scores": {t: v}}
                    for t, v in (("a", a), ("b", b))
                ]
            else:
                out.append({"method": method, "seed": seed, "status": "ok", "scores": {"a": a, "b": b}})
        return out

    def outcomes(rows):
        text = claims.claims_text2text(rows, tasks)
        return [line.split("|")[2].strip() for line in text.splitlines()[-3:]], text

    base = records("single_task", [(0.5, 0.5)] * 3, single=True) + records(
        "mt_dense", [(0.60, 0.60), (0.62, 0.62), (0.58, 0.58)]
    )
    # average well above dense (0.70 vs 0.60, std 0.02); Gumbel-ST above hard; Gumbel-ST not above dense (0.61)
    rows = (
        base
        + records("average", [(0.70, 0.70)] * 3)
        + records("gumbel_st", [(0.61, 0.61), (0.60, 0.60), (0.62, 0.62)])
        + records("hard", [(0.40, 0.40)] * 3)
    )
    found, text = outcomes(rows)
    assert found == ["reproduced", "reproduced", "reproduced"], text
    assert "| average vs mt_dense | 70.00 ± 0.00 | 60.00 ± 2.00 | +10.00 | higher (3 seeds) |" in text
    # a routed model above dense contradicts finding 3; Gumbel-ST merely equal to hard is not "the best"
    rows = base + records("average", [(0.50, 0.50)] * 3) + records("gumbel_st", [(0.80, 0.80)] * 3) \
        + records("hard", [(0.80, 0.79), (0.80, 0.81), (0.80, 0.80)])
    assert outcomes(rows)[0] == ["not reproduced", "not reproduced", "not reproduced"]
    # one seed per side: nothing is decided; a method that did not run decides nothing either
    found, text = outcomes(records("mt_dense", [(0.6, 0.6)]) + records("hard", [(0.9, 0.9)]))
    assert found == ["inconclusive", "inconclusive", "inconclusive"]
    assert "| average vs mt_dense | - | - | - | not run |" in text
    # a seed that misses a task is left out of the averages
    rows = base + [{"method": "average", "seed": s, "status": "ok", "scores": {"a": 0.9}} for s in (1, 2, 3)]
    assert "| average vs mt_dense | - | - | - | not run |" in claims.claims_text2text(rows, tasks)


def test_sample_generations_table_shows_each_methods_output_beside_input_and_target():
    def record(method, seed, outputs, task=None):
        samples = [
            {"task": "labels", "input": f"text {i} | piped", "target": "yes", "output": o}
            for i, o in enumerate(outputs)
        ]
        return {"cell": f"{method}/seed{seed}", "method": method, "task": task, "seed": seed, "status": "ok",
                "scores": {"labels": 1.0}, "samples": samples}

    records = [record("dense", 2, ["no", "no", "no"]), record("dense", 1, ["yes", "no", "yes"]),
               record("routed", 1, ["yes", "yes"]), {"method": "other", "seed": 1, "status": "ok", "scores": {}}]
    table = report.sample_generations(records, per_task=2).splitlines()
    assert table[0] == "| task | input | target | dense | routed |"
    # the lowest seed of each method; the pipe in the input is escaped so the row keeps its columns
    assert table[2] == "| labels | text 0 \\| piped | yes | yes | yes |"
    assert table[3] == "| labels | text 1 \\| piped | yes | no | yes |"
    assert len(table) == 4  # per_task=2
    assert report.sample_generations([records[-1]]) == ""
    assert report.clip("a  b\nc" + "x" * 20, 8) == "a b cxx…"


def test_text2text_unseen_claims_pair_seeds_and_samples_and_report_the_relative_gain():
    def records(method, scores):
        return [{"method": method, "variant": f"sample{k}", "seed": 1, "status": "ok", "scores": {"trec": v}}
                for k, v in enumerate(scores, start=1)]

    rows = records("fewshot_single_task", [0.4, 0.5, 0.5]) + records("fewshot_dense", [0.6, 0.75, 0.75]) \
        + records("fewshot_routing", [0.4, 0.5])  # routing lacks sample 3: compared on samples 1-2 only
    lines = claims.claims_text2text_unseen(rows).splitlines()
    # dense: +50% on every sample; 70.00 ± 8.66 vs 46.67 ± 5.77 -> 23.33 > 2 x 8.66
    assert lines[2] == ("| fewshot_dense vs fewshot_single_task | 70.00 ± 8.66 | 46.67 ± 5.77 | +23.33 | higher "
                        "(3 seed x sample pairs) | +50.0 ± 0.0% |")
    assert lines[3].startswith(
        "| fewshot_routing vs fewshot_single_task | 45.00 ± 7.07 | 45.00 ± 7.07 | +0.00 | no difference (2 seed"
    )
    assert lines[3].endswith("| +0.0 ± 0.0% |")
    assert lines[4].startswith(
        "| fewshot_dense vs fewshot_routing | 67.50 ± 10.61 | 45.00 ± 7.07 | +22.50 | higher (2 seed"
    )


def test_route_sharing_table_averages_the_seeds_and_skips_routes_that_decide_nothing():
    import torch

    from hf_taskmoe.analysis.routing import RoutingStatistics

    def routing(counts):
        stats = RoutingStatistics(["a", "b"], layers=[0, 1], num_experts=2, unit="examples")
        stats.counts = torch.tensor(counts, dtype=torch.float64)
        return stats.to_dict()

    same, apart = [[[4, 0], [4, 0]], [[0, 4], [0, 4]]], [[[4, 0], [0, 4]], [[0, 4], [0, 4]]]
    records = [
        {"method": "hard", "seed": 1, "routing": routing(same)},
        {"method": "hard", "seed": 2, "routing": routing(apart)},
        {"method": "average", "seed": 1, "routing": routing([[[2, 2], [2, 2]]] * 2)},
        {"method": "dense", "seed": 1},
    ]
    lines = report.route_sharing(records).splitlines()
    assert lines[0].startswith(
        "**hard** (2 seed(s); 2 routed layers of 2 experts: two independent random routes would share 1.0)"
    )
    assert lines[4:] == ["| a | 2.0 | 1.5 |", "| b | 1.5 | 2.0 |"]  # 2 shared layers under seed 1, 1 under seed 2
    assert report.route_sharing(records[2:]) == ""


def test_experiment_files_in_the_repository_are_valid():
    for path in sorted((ROOT / "examples" / "experiments" / "configs").glob("*.json")):
        spec, cells = runner.load_experiment(path)
        assert cells, path
        assert len({c.key for c in cells}) == len(cells), path
        for cell in cells:
            tasks = Path(cell.argv[cell.argv.index("--tasks") + 1])
            assert tasks.exists(), (path, tasks)


@pytest.mark.ci
def test_a_same_as_method_reuses_the_other_experiments_cell_and_refuses_another_command(tmp_path, tiny_dense):
    path = _experiment(tmp_path, tiny_dense, [{"name": "dense_grid_point", "same_as": "main/mt_dense",
                                               "args": {"num_experts": 1}}])
    spec = json.loads(path.read_text())
    spec["tasks"] = str(_tasks(tmp_path / "checkout" / "examples" / "data"))  # a task-config inside a checkout
    path.write_text(json.dumps(spec))
    _, cells = runner.load_experiment(path, tmp_path / "runs")
    # main's records, written by hand as if run in another checkout of the project
    moved = [arg.replace(str(tmp_path / "checkout"), "/elsewhere/checkout") for arg in cells[0].argv]
    assert moved != cells[0].argv
    source = {"cell": "mt_dense/seed1", "method": "mt_dense", "experiment": "main", "seed": 1, "status": "ok",
              "argv": moved, "scores": {"pos": 75.0, "score": 0.5}}
    (tmp_path / "main.jsonl").write_text(json.dumps(source) + "\n")
    assert _run(path, tmp_path, "--seeds", "1") == 0
    (record,) = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert record["reused_from"] == "main/mt_dense/seed1" and record["cell"] == "dense_grid_point/seed1"
    assert record["experiment"] == "tiny" and record["scores"] == {"pos": 75.0, "score": 0.5}
    assert not (tmp_path / "runs").exists()  # nothing trained
    # another command line (here another seed's) is refused, not silently reused
    (tmp_path / "main.jsonl").write_text(json.dumps({**source, "cell": "mt_dense/seed2", "seed": 2}) + "\n")
    with pytest.raises(ValueError, match="differs"):
        _run(path, tmp_path, "--seeds", "2")
