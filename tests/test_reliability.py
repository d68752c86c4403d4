"""Issue 35: runs never lose or mix data, loads are exact, and every user error is a one-paragraph refusal before
compute (the script's exit status 2, a `ValueError` in Python). Each test states the promise it holds."""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModel

import hf_taskmoe
from hf_taskmoe import BertForTaskMoE, TaskSpec
from hf_taskmoe.hub import export_for_remote_code

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import run_multitask  # noqa: E402


def _cross_device(monkeypatch, device: Path):
    """`device` behaves as another file system (a mount point): a rename into or out of it fails with EXDEV, as
    os.rename/os.replace do across devices; renames within either side work."""
    real_rename, real_replace = os.rename, os.replace
    device = str(device.resolve())

    def inside(path) -> bool:
        path = str(Path(path).resolve())
        return path == device or path.startswith(device + os.sep)

    def guarded(real):
        def rename(src, dst, *args, **kwargs):
            if inside(src) != inside(dst) or Path(dst).resolve() == Path(device) or Path(src).resolve() == Path(device):
                raise OSError(errno.EXDEV, "Invalid cross-device link", str(src))
            return real(src, dst, *args, **kwargs)
        return rename

    monkeypatch.setattr(os, "rename", guarded(real_rename))
    monkeypatch.setattr(os, "replace", guarded(real_replace))


# ---------------------------------------------------------------------------------------------- exports
def _two_models(tiny_dense):
    tasks = [TaskSpec(name="a", num_labels=2)]
    first = BertForTaskMoE.from_dense(tiny_dense, tasks, num_experts=2)
    second = BertForTaskMoE.from_dense(tiny_dense, tasks, num_experts=2)
    with torch.no_grad():
        second.heads["a"].classifier.weight.add_(1.0)
    return first, second


def test_an_export_into_a_mount_point_is_copied_then_swapped(tmp_path, tiny_dense, monkeypatch):
    """Export into a folder on another device (a Docker volume): staged beside it, copied, then swapped in."""
    first, second = _two_models(tiny_dense)
    folder = tmp_path / "volume"
    folder.mkdir()
    export_for_remote_code(first, folder)
    (folder / "notes.txt").write_text("a user's own file stays")
    (tmp_path / "probe").touch()
    _cross_device(monkeypatch, folder)
    with pytest.raises(OSError, match="cross-device"):  # the simulation holds: a plain rename into it fails
        os.replace(tmp_path / "probe", folder / "probe")
    export_for_remote_code(second, folder, max_shard_size="100KB")
    monkeypatch.undo()
    names = {p.name for p in folder.iterdir()}
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names and "notes.txt" in names
    assert not [n for n in names if ".incoming-" in n or n.startswith(".export")]
    loaded = AutoModel.from_pretrained(folder)
    assert torch.equal(loaded.heads["a"].classifier.weight, second.heads["a"].classifier.weight)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".volume.export-")]  # staging removed


def test_a_cross_device_export_that_fails_midway_leaves_the_previous_export_usable(tmp_path, tiny_dense, monkeypatch):
    """The old export stays whole until the new one is complete on the target's device (a full disk mid-copy)."""
    first, second = _two_models(tiny_dense)
    folder = tmp_path / "volume"
    folder.mkdir()
    export_for_remote_code(first, folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    _cross_device(monkeypatch, folder)
    real_copy, calls = shutil.copy2, []

    def copy_until_disk_full(src, dst, *args, **kwargs):
        calls.append(src)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        return real_copy(src, dst, *args, **kwargs)

    monkeypatch.setattr(shutil, "copy2", copy_until_disk_full)
    with pytest.raises(OSError, match="No space left"):
        export_for_remote_code(second, folder)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before  # untouched, no temporaries left
    loaded = AutoModel.from_pretrained(folder)
    assert torch.equal(loaded.heads["a"].classifier.weight, first.heads["a"].classifier.weight)
    assert hf_taskmoe


# ---------------------------------------------------------------------------------------------- the script's runs
def _argv(out, model, *extra):
    return [
        "--model_name_or_path", str(model), "--output_dir", str(out), "--max_steps", "2", "--per_device_train_batch_size", "4",
        "--max_train_samples", "8", "--max_eval_samples", "4", "--max_seq_length", "16", "--use_cpu", "--num_experts", "2",
        "--disable_tqdm", "true", "--do_eval", "false", "--report_to", "none", *extra,
    ]


def _refused(capsys, argv, *patterns):
    """The script refuses `argv` with exit status 2 and one paragraph (no traceback) matching every pattern."""
    import re

    capsys.readouterr()
    assert run_multitask.cli(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" not in err and "\nerror: " in "\n" + err.replace("\r", "\n"), err
    err = err[err.index("error: "):]
    for pattern in patterns:
        assert re.search(pattern, err, re.DOTALL), (pattern, err)
    return err


def _bad_task_file(tmp_path):
    folder = tmp_path / "bad"
    (folder / "t").mkdir(parents=True)
    (folder / "t" / "train.jsonl").write_text('{"text": "fine", "label": "pos"}\n{"text": "odd", "label": "meh"}\n')
    (folder / "tasks.json").write_text(json.dumps({"tasks": [{"name": "t", "label_names": ["neg", "pos"], "text_fields": ["text"],
                                                              "train_file": "t/train.jsonl", "validation_file": "t/train.jsonl"}]}))
    return folder / "tasks.json"


def test_a_second_run_into_a_claimed_output_dir_is_refused_naming_the_first(tmp_path, tiny_dense, capsys):
    """Two runs never share an output folder: the second exits 2 naming the first's pid, host and start time."""
    import socket
    import subprocess
    import time

    out = tmp_path / "run"
    first = subprocess.Popen([sys.executable, str(ROOT / "examples" / "run_multitask.py"),
                              *_argv(out, tiny_dense, "--max_steps", "100000")], cwd=ROOT,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    lock = tmp_path / ".run.lock"
    try:
        deadline = time.time() + 120
        while not lock.exists() and first.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert lock.exists(), "the first run never claimed its folder"
        time.sleep(0.2)  # its record written
        _refused(capsys, _argv(out, tiny_dense), rf"in use by the run with pid {first.pid} on host {socket.gethostname()}, started 20",
                 r"Wait for that run to finish, or pass another --output_dir")
        assert json.loads(lock.read_text())["pid"] == first.pid  # the refused run left the first's claim alone
    finally:
        first.kill()
        first.wait()


def test_a_stale_lock_is_taken_over_with_a_notice_and_every_run_releases_its_lock(tmp_path, tiny_dense, capsys):
    """A lock left by a killed run (its pid dead on this host) is taken over, saying so; a run, finished or refused,
    leaves no lock behind."""
    import socket
    import subprocess

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "run"
    lock = tmp_path / ".run.lock"
    lock.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": "2026-01-01 00:00:00 UTC"}))
    assert run_multitask.cli(_argv(out, tiny_dense)) == 0
    err = capsys.readouterr().err
    assert f"Taking over the stale lock of the run with pid {dead.pid}" in err
    assert (out / "model.safetensors").exists() and not lock.exists()
    _refused(capsys, _argv(tmp_path / "other", tiny_dense, "--tasks", str(_bad_task_file(tmp_path))), "line 2")
    assert not (tmp_path / ".other.lock").exists()


def _run_files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}


def test_overwrite_keeps_the_previous_run_until_the_new_one_is_saved(tmp_path, tiny_dense, capsys, monkeypatch):
    """--overwrite_output_dir: a run refused for a bad task file leaves the previous model intact; a good one replaces
    it whole (staged beside it, then swapped), also where the folder cannot be renamed (a mount point)."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    run_multitask.main(_argv(out, tiny_dense, "--save_strategy", "steps", "--save_steps", "2"))
    before = _run_files(out)
    assert (out / "checkpoint-2").is_dir()
    _refused(capsys, _argv(out, tiny_dense, "--overwrite_output_dir", "--tasks", str(_bad_task_file(tmp_path))), "line 2")
    assert _run_files(out) == before and (out / "checkpoint-2").is_dir()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".run.")]  # no staging, no lock left

    run_multitask.main(_argv(out, tiny_dense, "--overwrite_output_dir", "--max_steps", "3", "--seed", "7"))
    assert not (out / "checkpoint-2").exists()  # the earlier run's checkpoints went with it
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 3
    second = load_file(out / "model.safetensors")
    assert AutoModel.from_pretrained(out).config.model_type == "taskmoe_bert"
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".run.")]

    # the output folder is a mount point: it cannot be renamed, so the new run is copied in, then the old removed
    (out / "notes-from-the-old-run.txt").write_text("old")
    real_rename = os.rename

    def busy(src, dst, *args, **kwargs):
        if Path(src) == out or Path(dst) == out:
            raise OSError(errno.EBUSY, "Device or resource busy", str(src))
        return real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", busy)
    run_multitask.main(_argv(out, tiny_dense, "--overwrite_output_dir", "--max_steps", "2", "--seed", "8"))
    monkeypatch.undo()
    assert not (out / "notes-from-the-old-run.txt").exists()
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 2
    third = load_file(out / "model.safetensors")
    assert any(not torch.equal(second[k], third[k]) for k in second)
    assert not [p.name for p in out.iterdir() if ".incoming-" in p.name]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".run.")]


def test_an_output_dir_that_is_a_file_or_read_only_is_refused(tmp_path, tiny_dense, capsys, monkeypatch):
    """Refused before compute, exit 2, naming the folder and how to fix it."""
    import tempfile

    (tmp_path / "a-file").write_text("x")
    _refused(capsys, _argv(tmp_path / "a-file", tiny_dense), r"--output_dir .*a-file is a file, not a folder")
    _refused(capsys, _argv(tmp_path / "a-file" / "run", tiny_dense), r"cannot create the folder .*a-file")
    read_only = tmp_path / "ro"
    read_only.mkdir()
    real = tempfile.mkstemp

    def no_write(*args, dir=None, **kwargs):  # a read-only file system (root ignores chmod, so simulated)
        if dir is not None and Path(dir).resolve() == read_only.resolve():
            raise OSError(errno.EROFS, "Read-only file system", str(dir))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", no_write)
    _refused(capsys, _argv(read_only / "run", tiny_dense), r"the folder .*ro is not writable \(Read-only file system\)")
    monkeypatch.undo()
    if os.geteuid() != 0:  # the real thing where permissions apply
        read_only.chmod(0o555)
        try:
            _refused(capsys, _argv(read_only / "run", tiny_dense), r"not writable")
        finally:
            read_only.chmod(0o755)
