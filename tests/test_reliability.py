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
