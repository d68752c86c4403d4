"""Faults: a run killed with kill -9 (while training or while saving) resumes to the weights of an uninterrupted
run; runs never mix in one folder; a saved model is never continued with a contradicting task file; an export
never leaves stale weights and a failed export leaves the previous one usable."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import run_multitask  # noqa: E402


def _argv(out, model, *extra):
    return [
        "--model_name_or_path",
        str(model),
        "--output_dir",
        str(out),
        "--max_steps",
        "24",
        "--per_device_train_batch_size",
        "4",
        "--max_train_samples",
        "16",
        "--max_eval_samples",
        "4",
        "--max_seq_length",
        "16",
        "--use_cpu",
        "--num_experts",
        "2",
        "--logging_steps",
        "4",
        "--disable_tqdm",
        "true",
        "--do_eval",
        "false",
        *extra,
    ]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_kill_9_while_training_then_resume_latest_gives_the_same_weights(tmp_path, tiny_dense):
    run_multitask.main(_argv(tmp_path / "whole", tiny_dense))
    killed = tmp_path / "killed"
    argv = [
        sys.executable,
        str(ROOT / "examples" / "run_multitask.py"),
        *_argv(killed, tiny_dense, "--save_strategy", "steps", "--save_steps", "4"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}  # the same arithmetic as this process
    process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (killed / "checkpoint-8").exists() and process.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (killed / "model.safetensors").exists(), "the run finished before it could be killed"
    # a checkpoint being written when the kill came may be incomplete: `latest` skips it
    checkpoints = sorted(killed.glob("checkpoint-*"))
    assert checkpoints
    with pytest.raises(ValueError, match="holds another run"):  # not resuming: refused, nothing mixed
        run_multitask.main(_argv(killed, tiny_dense))
    run_multitask.main(
        _argv(killed, tiny_dense, "--resume_from_checkpoint", "latest", "--save_strategy", "steps", "--save_steps", "4")
    )
    assert _equal(_weights(killed), _weights(tmp_path / "whole"))


def test_a_checkpoint_cut_short_while_saving_is_skipped_or_refused(tmp_path, tiny_dense):
    out = tmp_path / "run"
    run_multitask.main(_argv(out, tiny_dense, "--save_strategy", "steps", "--save_steps", "8", "--max_steps", "16"))
    whole = _weights(out)
    # as if kill -9 came while checkpoint-16 was written: its optimizer and scheduler never reached the disk
    for name in ("optimizer.pt", "scheduler.pt"):
        (out / "checkpoint-16" / name).unlink()
    with pytest.raises(ValueError, match=r"checkpoint-16 is incomplete: optimizer.pt, scheduler.pt missing"):
        run_multitask.main(
            _argv(out, tiny_dense, "--max_steps", "16", "--resume_from_checkpoint", str(out / "checkpoint-16"))
        )
    (out / "model.safetensors").unlink()
    run_multitask.main(
        _argv(out, tiny_dense, "--max_steps", "16", "--resume_from_checkpoint", "latest")
    )  # checkpoint-8
    assert _equal(_weights(out), whole)


def test_overwrite_replaces_an_earlier_run(tmp_path, tiny_dense):
    out = tmp_path / "run"
    run_multitask.main(_argv(out, tiny_dense, "--save_strategy", "steps", "--save_steps", "8", "--max_steps", "16"))
    assert (out / "checkpoint-16").exists()
    run_multitask.main(_argv(out, tiny_dense, "--max_steps", "4", "--overwrite_output_dir"))
    assert not list(out.glob("checkpoint-*"))  # the old checkpoints are gone, not mixed with the new run
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 4


def test_continuing_with_a_contradicting_task_file_is_refused(tmp_path, tiny_dense):
    first = tmp_path / "first"
    run_multitask.main(_argv(first, tiny_dense, "--max_steps", "2"))
    demo = json.loads((ROOT / "examples" / "data" / "demo_mixture" / "tasks.json").read_text())
    for task in demo["tasks"]:
        for key in ("train_file", "validation_file"):
            task[key] = str(ROOT / "examples" / "data" / "demo_mixture" / task[key])
    demo["tasks"][0]["label_names"] = ["fresh", "rotten"]  # the same task, its labels in the other order
    demo["tasks"][1]["metrics"] = ["accuracy", "f1_macro"]
    (tmp_path / "tasks.json").write_text(json.dumps(demo))
    with pytest.raises(
        ValueError, match=r"(?s)task 'rotten_tomatoes': label_names saved \['rotten', 'fresh'\].*task 'trec': metrics"
    ):
        run_multitask.main(
            _argv(tmp_path / "second", first, "--tasks", str(tmp_path / "tasks.json"), "--max_steps", "2")
        )


def test_export_replaces_what_it_wrote_and_a_failed_export_leaves_the_previous_one(tmp_path, tiny_dense, monkeypatch):
    from transformers import AutoModel

    import hf_taskmoe
    from hf_taskmoe import BertForTaskMoE, TaskSpec
    from hf_taskmoe.hub import export_for_remote_code

    tasks = [TaskSpec(name="a", num_labels=2)]
    first = BertForTaskMoE.from_dense(tiny_dense, tasks, num_experts=2)
    folder = tmp_path / "export"
    export_for_remote_code(first, folder)
    (folder / "modeling_taskmoe_camtl.py").write_text("# another family's file, from an older export\n")
    (folder / "notes.txt").write_text("a user's own file stays")
    second = BertForTaskMoE.from_dense(tiny_dense, tasks, num_experts=2)
    with torch.no_grad():
        second.heads["a"].classifier.weight.add_(1.0)
    export_for_remote_code(second, folder, max_shard_size="100KB")  # shards now
    names = {p.name for p in folder.iterdir()}
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names
    assert "modeling_taskmoe_camtl.py" not in names and "notes.txt" in names
    loaded = AutoModel.from_pretrained(folder)
    assert torch.equal(loaded.heads["a"].classifier.weight, second.heads["a"].classifier.weight)

    def broken(self, *args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(type(first), "save_pretrained", broken)
    with pytest.raises(OSError, match="disk full"):
        export_for_remote_code(first, folder)
    monkeypatch.undo()
    again = AutoModel.from_pretrained(folder)  # the previous export, whole
    assert torch.equal(again.heads["a"].classifier.weight, second.heads["a"].classifier.weight)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".export.export-")]  # no staging left behind
    assert hf_taskmoe  # imported for the Auto registration
