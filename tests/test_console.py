"""The console command `hf-taskmoe` (pyproject.toml's `[project.scripts]`), run from a fresh process as a user runs
it: `python -m hf_taskmoe.cli` is the same function as the installed entry point (which exists only after
`pip install`), and `hf-taskmoe train ...` runs what `python examples/run_multitask.py ...` runs: the same help, the
same refusals and exit statuses, the same run."""

import json
import os
import subprocess
import sys
import tomllib
from importlib import import_module
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "examples" / "run_multitask.py")
COMMAND = [sys.executable, "-m", "hf_taskmoe.cli"]


def _run(argv, cwd=ROOT):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1"}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_the_declared_entry_point_is_the_function_that_python_m_runs():
    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["hf-taskmoe"]
    module, _, function = target.partition(":")
    from hf_taskmoe.cli import console

    assert getattr(import_module(module), function) is console.main
    assert "from .console import main" in (ROOT / "hf_taskmoe" / "cli" / "__main__.py").read_text()
    # the example script calls the very functions the console command calls
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import run_multitask
    finally:
        sys.path.remove(str(ROOT / "examples"))
    from hf_taskmoe.cli import train

    assert run_multitask.cli is train.cli and run_multitask.main is train.main


@pytest.mark.ci  # fresh interpreters, 10-20 s each: .ci/run's ci step runs them
def test_help_lists_the_subcommands_and_a_wrong_command_is_refused():
    shown = _run([*COMMAND, "--help"])
    assert shown.returncode == 0 and shown.stdout.startswith("usage: hf-taskmoe <command>")
    assert [line.split()[0] for line in shown.stdout.split("commands:\n")[1].split("\n\n")[0].splitlines()] == ["train"]
    assert max(len(line) for line in shown.stdout.splitlines()) <= 120  # fits a screen's width

    bare = _run(COMMAND)
    assert bare.returncode == 2 and bare.stderr.startswith("usage: hf-taskmoe") and not bare.stdout

    wrong = _run([*COMMAND, "trian"])
    assert wrong.returncode == 2 and "`trian` is not a command of hf-taskmoe" in wrong.stderr
    assert "Traceback" not in wrong.stderr


@pytest.mark.ci  # fresh interpreters, 10-20 s each: .ci/run's ci step runs them
def test_train_help_is_the_example_scripts_with_the_commands_name():
    command = _run([*COMMAND, "train", "--help"])
    script = _run([sys.executable, SCRIPT, "--help"])
    assert command.returncode == script.returncode == 0
    assert command.stdout.startswith("usage: hf-taskmoe train [options]")
    assert command.stdout == script.stdout.replace("python examples/run_multitask.py", "hf-taskmoe train")
    assert "--model_family" in command.stdout and "--tasks" in command.stdout


@pytest.mark.ci  # fresh interpreters, 10-20 s each: .ci/run's ci step runs them
def test_train_refuses_what_the_script_refuses_with_the_same_status(tmp_path, tiny_dense):
    argv = ["--model_name_or_path", str(tiny_dense), "--tasks", "no_such_task"]
    command = _run([*COMMAND, "train", *argv, "--output_dir", str(tmp_path / "a")])
    script = _run([sys.executable, SCRIPT, *argv, "--output_dir", str(tmp_path / "b")])
    assert command.returncode == script.returncode == 2
    assert "Unknown task 'no_such_task'" in command.stderr and "Traceback" not in command.stderr
    assert command.stderr == script.stderr

    bad = _run([*COMMAND, "train", "--max_seq_length", "0", "--output_dir", str(tmp_path / "c")])
    assert bad.returncode == 2 and "`max_seq_length` must be an integer >= 1, got 0" in bad.stderr


@pytest.mark.ci  # fresh interpreters, 10-20 s each: .ci/run's ci step runs them
def test_train_runs_the_example_scripts_run(tmp_path, tiny_dense):
    """Two steps of MT-TaG on the demo mixture, from another working folder: a model, its card and the metrics of
    every task, as the script writes them."""
    out = tmp_path / "run"
    done = _run([*COMMAND, "train", "--model_name_or_path", str(tiny_dense), "--output_dir", str(out),
                 "--max_steps", "2", "--per_device_train_batch_size", "4", "--max_train_samples", "8",
                 "--max_eval_samples", "4", "--max_seq_length", "16"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "model.safetensors").exists() and (out / "README.md").exists()
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["steps"] == 2 and summary["argv"][:2] == ["--model_name_or_path", str(tiny_dense)]
    tasks = json.loads((ROOT / "examples" / "data" / "demo_mixture" / "tasks.json").read_text())["tasks"]
    for task in tasks:  # every task scored with its own metric
        assert any(key.startswith(f"eval_{task['name']}_") for key in summary["metrics"]), task["name"]


def test_the_demo_without_its_data_is_refused_in_one_paragraph(tmp_path, monkeypatch, capsys):
    """An installed package holds no examples/: `hf-taskmoe train` with no --tasks says where the demo's data lives
    and what to pass instead (exit 2), before any output folder or model."""
    from hf_taskmoe.cli import train

    gone = tmp_path / "examples" / "data" / "demo_mixture" / "tasks.json"
    monkeypatch.setattr(train, "DEMO_TASKS", gone)
    monkeypatch.setitem(train.DEMO_PRESET, "tasks", [str(gone)])
    code = train.cli(["--output_dir", str(tmp_path / "out")], prog="hf-taskmoe train")
    err = capsys.readouterr().err
    assert code == 2 and "the demo's data ships with a source checkout" in err and "--tasks my_tasks.json" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()
