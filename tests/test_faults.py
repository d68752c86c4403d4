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


@pytest.mark.ci
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


# -- kill -9 while save_pretrained writes over a model (issue 59 item 10) ---------------------------------------------
#: a fork server: imports once, then for each line on stdin forks a worker that saves the model into the folder again
#: and again, version after version (every parameter set to version / 1000; sharded and whole files in turn), printing
#: `saved <version>` after each save; the server prints the worker's pid and, once it is killed, `reaped`
_SAVE_LOOP = r"""
import os, sys, torch
from hf_taskmoe import BertForTaskMoE, BertTaskMoEConfig, TaskSpec
folder = sys.argv[1]
torch.manual_seed(0)
model = BertForTaskMoE(BertTaskMoEConfig(
    tasks=[TaskSpec(name="a", num_labels=2), TaskSpec(name="b", num_labels=3)], num_experts=4, vocab_size=30000,
    hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256))
print("ready", flush=True)
for line in sys.stdin:
    version = int(line)
    pid = os.fork()
    if pid == 0:
        while True:
            version += 1
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(version / 1000)
            model.save_pretrained(folder, max_shard_size="2MB" if version % 2 else "5GB")
            os.write(1, f"saved {version}\n".encode())
    print(f"pid {pid}", flush=True)
    os.waitpid(pid, 0)
    print("reaped", flush=True)
"""


def _version(model) -> float:
    """The one value every parameter of a model saved by `_SAVE_LOOP` holds (its version / 1000)."""
    values = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert torch.all(values == values[0]), "a model mixing two saves"
    return round(float(values[0]) * 1000)


@pytest.mark.slow  # about 20 s (a 4M-parameter model, so that a save's writes take most of its time); in .ci/run
def test_kill_9_at_any_moment_of_a_save_leaves_the_old_or_the_new_model(tmp_path):
    """A process killed (`kill -9`) while `save_pretrained` writes over a saved model leaves a folder that loads as
    the model that was there or the one being saved (never neither, never a mix), with the folder's other files,
    killed 10 times at moments spread over the loop of saves (a save takes about 70 ms here, most of it writing;
    sharded and whole files in turn). Before the save wrote into a folder beside it and swapped it in, a kill
    mid-save left a folder that did not load (a config.json cut short)."""
    from hf_taskmoe import BertForTaskMoE

    folder = tmp_path / "model"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen([sys.executable, "-c", _SAVE_LOOP, str(folder)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        assert server.stdout.readline().strip() == "ready"
        saved = 0  # the last version known to be complete
        for kill, delay in enumerate([0.35, 0.05, 0.6, 0.13, 0.27, 0.02, 0.45, 0.09, 0.2, 0.75]):
            server.stdin.write(f"{saved}\n")
            server.stdin.flush()
            line = server.stdout.readline().split()
            assert line[0] == "pid", line
            if kill == 0:  # the first model, and a file of the user's beside it, before any kill
                while server.stdout.readline().split() != ["saved", "1"]:
                    pass
                saved = 1
                (folder / "notes.txt").write_text("mine")
            time.sleep(delay)
            os.kill(int(line[1]), signal.SIGKILL)
            for line in iter(server.stdout.readline, ""):
                if line.startswith("saved"):
                    saved = int(line.split()[1])
                elif line.strip() == "reaped":
                    break
            version = _version(BertForTaskMoE.from_pretrained(folder))
            assert version in (saved, saved + 1), (kill, version, saved)  # the old model or the one being saved
            assert (folder / "notes.txt").read_text() == "mine"
            saved = max(saved, version)
    finally:
        server.kill()
        server.wait()
    assert saved >= 5  # the workers saved: the kills came during the loop of saves
    # a save after the kills removes what they left beside the folder (temporary folders of killed saves)
    model = BertForTaskMoE.from_pretrained(folder)
    model.save_pretrained(folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def _tiny_mt_tag(value: float):
    from hf_taskmoe import BertForTaskMoE, BertTaskMoEConfig, TaskSpec

    model = BertForTaskMoE(BertTaskMoEConfig(
        tasks=[TaskSpec(name="a", num_labels=2)], num_experts=2, vocab_size=60, hidden_size=16, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=32))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def test_a_save_over_a_model_keeps_the_folders_other_files_and_drops_only_old_weights(tmp_path):
    """The swapped-in folder carries what was in the old one besides its weights (a tokenizer file, notes, a
    checkpoint folder, written before the save), drops the old model's weight files that the new save does not
    write (shards after a whole file, or the reverse: never stale weights beside new ones), and leaves nothing
    beside the folder."""
    from hf_taskmoe import BertForTaskMoE

    folder = tmp_path / "model"
    _tiny_mt_tag(0.001).save_pretrained(folder, max_shard_size="10KB")
    assert len(list(folder.glob("model-*-of-*.safetensors"))) > 1
    (folder / "notes.txt").write_text("mine")
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "checkpoint-4").mkdir()
    (folder / "checkpoint-4" / "optimizer.pt").write_bytes(b"state")
    (folder / "adapter_model.safetensors").write_bytes(b"an adapter's weights, not the model's: kept")
    _tiny_mt_tag(0.002).save_pretrained(folder)
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["adapter_model.safetensors", "checkpoint-4", "config.json", "model.safetensors", "notes.txt",
                     "tokenizer_config.json"]
    assert (folder / "checkpoint-4" / "optimizer.pt").read_bytes() == b"state"
    assert _version(BertForTaskMoE.from_pretrained(folder)) == 2
    _tiny_mt_tag(0.003).save_pretrained(folder, max_shard_size="10KB")
    assert not (folder / "model.safetensors").exists() and (folder / "notes.txt").read_text() == "mine"
    assert _version(BertForTaskMoE.from_pretrained(folder)) == 3
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_where_folders_cannot_be_exchanged_a_kill_between_the_two_renames_loses_no_model(tmp_path, monkeypatch):
    """Without `renameat2(RENAME_EXCHANGE)` (not Linux, NFS) the swap is two renames: the old folder to its backup,
    the new one to the path. Stopped between them (the second rename never runs), the path holds nothing:
    `from_pretrained` loads the old model from the backup, and the next save puts it back before saving."""
    from hf_taskmoe import BertForTaskMoE, folder_swap

    folder = tmp_path / "model"
    _tiny_mt_tag(0.001).save_pretrained(folder)
    (folder / "notes.txt").write_text("mine")
    monkeypatch.setattr(folder_swap, "exchange", lambda a, b: False)
    renames = []

    def rename(source, destination):
        renames.append((Path(source).name, Path(destination).name))
        if len(renames) == 2:
            raise KeyboardInterrupt  # the process stops here
        os.replace(source, destination)

    monkeypatch.setattr(folder_swap.os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        _tiny_mt_tag(0.002).save_pretrained(folder)
    monkeypatch.setattr(folder_swap.os, "rename", os.rename)
    assert renames[0] == ("model", ".model.save-backup") and renames[1][1] == "model"
    assert not folder.exists() and folder_swap.backup_path(folder).is_dir()
    assert _version(BertForTaskMoE.from_pretrained(folder)) == 1  # the earlier model, from its backup
    assert _version(BertForTaskMoE.from_pretrained(pretrained_model_name_or_path=str(folder))) == 1
    _tiny_mt_tag(0.003).save_pretrained(folder)
    assert _version(BertForTaskMoE.from_pretrained(folder)) == 3 and (folder / "notes.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_a_folder_that_cannot_be_renamed_has_its_files_replaced_one_by_one(tmp_path, monkeypatch):
    """Another user's folder under a sticky-bit parent cannot be renamed (EPERM): the save still succeeds, its files
    replaced one by one (`folder_swap.install_staged`), the old shards removed, the folder's other files kept."""
    import errno

    from hf_taskmoe import BertForTaskMoE, folder_swap

    folder = tmp_path / "model"
    _tiny_mt_tag(0.001).save_pretrained(folder, max_shard_size="10KB")
    (folder / "notes.txt").write_text("mine")

    def refused(*args):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(folder_swap, "exchange", refused)
    monkeypatch.setattr(folder_swap.os, "rename", refused)
    _tiny_mt_tag(0.002).save_pretrained(folder)
    monkeypatch.undo()
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "notes.txt"]
    assert _version(BertForTaskMoE.from_pretrained(folder)) == 2
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_exchange_swaps_two_folders_in_one_step(tmp_path):
    """This system's exchange (Linux: `renameat2(RENAME_EXCHANGE)`), what keeps a complete model at the path through
    a save; where it is missing it says so (False) and moves nothing."""
    from hf_taskmoe.folder_swap import exchange

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "from_a").touch()
    if not exchange(tmp_path / "a", tmp_path / "b"):  # a file system without it (the two renames then)
        assert (tmp_path / "a" / "from_a").exists() and not list((tmp_path / "b").iterdir())
        return
    assert (tmp_path / "b" / "from_a").exists() and not list((tmp_path / "a").iterdir())
