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
from hf_taskmoe.pipelines import TEXT2TEXT_PIPELINE_TASK

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
        "--model_name_or_path",
        str(model),
        "--output_dir",
        str(out),
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "4",
        "--max_train_samples",
        "8",
        "--max_eval_samples",
        "4",
        "--max_seq_length",
        "16",
        "--use_cpu",
        "--num_experts",
        "2",
        "--disable_tqdm",
        "true",
        "--do_eval",
        "false",
        "--report_to",
        "none",
        *extra,
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
    (folder / "tasks.json").write_text(
        json.dumps(
            {
                "tasks": [
                    {
                        "name": "t",
                        "label_names": ["neg", "pos"],
                        "text_fields": ["text"],
                        "train_file": "t/train.jsonl",
                        "validation_file": "t/train.jsonl",
                    }
                ]
            }
        )
    )
    return folder / "tasks.json"


def test_a_second_run_into_a_claimed_output_dir_is_refused_naming_the_first(tmp_path, tiny_dense, capsys):
    """Two runs never share an output folder: the second exits 2 naming the first's pid, host and start time."""
    import socket
    import subprocess
    import time

    out = tmp_path / "run"
    first = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "run_multitask.py"), *_argv(out, tiny_dense, "--max_steps", "100000")],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    lock = tmp_path / ".run.lock"
    try:
        deadline = time.time() + 120
        while not lock.exists() and first.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert lock.exists(), "the first run never claimed its folder"
        time.sleep(0.2)  # its record written
        _refused(
            capsys,
            _argv(out, tiny_dense),
            rf"in use by the run with pid {first.pid} on host {socket.gethostname()}, started 20",
            r"Wait for that run to finish, or pass another --output_dir",
        )
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
    _refused(
        capsys, _argv(out, tiny_dense, "--overwrite_output_dir", "--tasks", str(_bad_task_file(tmp_path))), "line 2"
    )
    assert _run_files(out) == before and (out / "checkpoint-2").is_dir()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".run.")]  # no staging, no lock left

    run_multitask.main(_argv(out, tiny_dense, "--overwrite_output_dir", "--max_steps", "3", "--seed", "7"))
    assert not (out / "checkpoint-2").exists()  # the earlier run's checkpoints went with it
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 3
    second = load_file(out / "model.safetensors")
    assert AutoModel.from_pretrained(out).config.model_type == "taskmoe_moe"
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".run.")]

    # the output folder is a mount point: it cannot be renamed, so the new run is copied in, then the old removed
    (out / "notes-from-the-old-run.txt").write_text("old")
    real_rename = os.rename

    def busy(src, dst, *args, **kwargs):
        if Path(src) == out or Path(dst) == out:
            raise OSError(errno.EBUSY, "Device or resource busy", str(src))
        return real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", busy)
    from hf_taskmoe import folder_swap

    real_exchange = folder_swap.exchange
    monkeypatch.setattr(folder_swap, "exchange", lambda a, b: busy(a, b) if out in (Path(a), Path(b)) else
                        real_exchange(a, b))  # renameat2 of a mount point: EBUSY too
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


# ---------------------------------------------------------------------------------------------- refusals before compute
def _dense_with(tmp_path, minilm, **config):
    """A tiny dense BERT with the MiniLM tokenizer (vocabulary 30522), its config changed by `config`."""
    from transformers import BertConfig, BertModel

    folder = tmp_path / "dense"
    torch.manual_seed(0)
    BertModel(
        BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, **config)
    ).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm / name, folder / name)
    return folder


def test_token_ids_beyond_the_vocabulary_or_type_vocab_size_are_refused_before_training(tmp_path, minilm, capsys):
    """A tokenizer that is not the model's: the script refuses after tokenising (exit 2, naming task, example, id and
    table); in Python the collator's `BatchChecker` raises the `ValueError` before the batch reaches the model."""
    from hf_taskmoe.training.batches import BatchChecker

    small_vocab = _dense_with(tmp_path / "v", minilm, vocab_size=500)
    _refused(
        capsys,
        _argv(tmp_path / "a", small_vocab),
        r"Task 'rotten_tomatoes', train example \d+: the tokenizer .* gives input_ids \d+, but the model's vocabulary "
        r"\(vocab_size\) has 500 entries: the tokenizer is not the model's",
    )
    assert not (tmp_path / "a" / "model.safetensors").exists()
    # a task of sentence pairs, whose second sentences the tokenizer gives segment 1
    pairs = tmp_path / "pairs"
    pairs.mkdir()
    rows = [{"question": f"is {w} a word", "passage": f"{w} is a word of this sentence", "label": str(i % 2 == 0)}
            for i, w in enumerate(["red", "blue", "green", "cold", "warm", "fast", "slow", "tall"])]
    (pairs / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (pairs / "tasks.json").write_text(json.dumps({"tasks": [{
        "name": "pair_qa", "label_names": ["False", "True"], "text_fields": ["question", "passage"],
        "train_file": "train.jsonl", "validation_file": "train.jsonl"}]}))
    one_segment = _dense_with(tmp_path / "t", minilm, type_vocab_size=1)
    _refused(
        capsys,
        _argv(tmp_path / "b", one_segment, "--tasks", str(pairs / "tasks.json")),
        r"Task 'pair_qa', train example \d+: .* gives token_type_ids 1, but the "
        r"model's token type table \(type_vocab_size\) has 1 entries",
    )

    model = BertForTaskMoE.from_dense(small_vocab, [TaskSpec(name="a", num_labels=2)], num_experts=2)
    check = BatchChecker.for_model(model)
    ok = {"input_ids": torch.tensor([[1, 499], [2, 3]]), "token_type_ids": torch.zeros(2, 2, dtype=torch.long),
          "task_ids": torch.tensor([0, 0]), "labels": torch.tensor([0, 1])}
    check(ok)
    with pytest.raises(
        ValueError,
        match=r"`input_ids` holds 500 \(row 1, position 0, and 0 more out of range\), but the "
        r"model's vocabulary \(`vocab_size`\) has 500 entries .*another tokenizer",
    ):
        check({**ok, "input_ids": torch.tensor([[1, 2], [500, 3]])})
    with pytest.raises(ValueError, match=r"`token_type_ids` holds 2 .*`type_vocab_size`\) has 2 entries"):
        check({**ok, "token_type_ids": torch.tensor([[0, 0], [0, 2]])})
    with pytest.raises(ValueError, match=r"`input_ids` holds -1"):
        check({**ok, "input_ids": torch.tensor([[1, -1], [2, 3]])})


@pytest.mark.parametrize("option, value, field", [
    ("--per_device_train_batch_size", "0", "per_device_train_batch_size"),
    ("--per_device_eval_batch_size", "0", "per_device_eval_batch_size"),
    ("--gradient_accumulation_steps", "0", "gradient_accumulation_steps"),
    ("--max_steps", "0", "max_steps"),
])
def test_zero_batch_size_or_steps_are_refused_in_one_paragraph(tmp_path, tiny_dense, capsys, option, value, field):
    """`--per_device_train_batch_size 0` (and kin) and `--max_steps 0` (which would take one step at learning rate 0)
    are refused: exit 2 in the script, a ValueError from MultiTaskTrainingArguments."""
    from hf_taskmoe.training import MultiTaskTrainingArguments

    _refused(
        capsys, _argv(tmp_path / "out", tiny_dense, option, value), rf"Invalid arguments: `{field}` must be a positive"
    )
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=rf"`{field}` must be a positive"):
        MultiTaskTrainingArguments(output_dir=str(tmp_path / "o"), use_cpu=True, **{field: 0})


@pytest.mark.parametrize("name", ["trainer_state.json", "task_sampler.json"])
def test_a_truncated_checkpoint_file_is_named_and_latest_falls_back(tmp_path, tiny_dense, capsys, name):
    """kill -9 while the newest checkpoint's trainer_state.json / task_sampler.json was written: resuming from it
    names the file and the checkpoint (exit 2); `latest` takes the newest complete checkpoint, saying which it
    skipped."""
    out = tmp_path / "run"
    run_multitask.main(_argv(out, tiny_dense, "--max_steps", "4", "--save_strategy", "steps", "--save_steps", "2"))
    path = out / "checkpoint-4" / name
    assert path.exists()
    path.write_text(path.read_text()[: len(path.read_text()) // 2])  # cut short
    _refused(capsys, _argv(out, tiny_dense, "--max_steps", "4", "--resume_from_checkpoint", str(out / "checkpoint-4")),
             rf"checkpoint-4: the checkpoint cannot be resumed: {name} \(unreadable")
    (out / "model.safetensors").unlink()
    capsys.readouterr()
    run_multitask.main(_argv(out, tiny_dense, "--max_steps", "4", "--resume_from_checkpoint", "latest",
                             "--save_strategy", "no"))
    said = [line for line in capsys.readouterr().err.splitlines() if "checkpoint-4" in line]  # one line, stderr
    assert len(said) == 1 and said[0].startswith(f"Skipped the incomplete checkpoint checkpoint-4 ({name} (unreadable")
    assert said[0].endswith("resuming from checkpoint-2 instead.")
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 4  # continued from checkpoint-2
    assert (out / "model.safetensors").exists()


def test_a_generation_count_of_zero_is_refused_by_the_pipeline(tiny_dense, tmp_path):
    """`num_beams=0` (a ZeroDivisionError inside generate) and kin: a ValueError naming the keyword."""
    from transformers import pipeline

    from .test_pipeline import save_routed_seq2seq

    pipe = pipeline(
        TEXT2TEXT_PIPELINE_TASK, model=str(save_routed_seq2seq(tiny_dense, tmp_path / "m")), max_new_tokens=3
    )
    for keyword in ("num_beams", "num_return_sequences", "max_new_tokens"):
        with pytest.raises(ValueError, match=rf"`{keyword}` must be a positive integer, got 0"):
            pipe("What is the capital of France?", task="trec", **{keyword: 0})
    assert pipe("What is the capital of France?", task="trec", num_beams=2)["task"] == "trec"


def test_a_config_object_that_does_not_describe_a_saved_model_is_refused_too(tmp_path, tiny_dense):
    """`from_pretrained(folder, config=...)` with another `num_experts` than the saved model's: refused like a
    hand-edited config.json (only a checkpoint of another model type, a dense BERT, loads partially, as in
    transformers, with a warning pointing to from_dense)."""
    model = BertForTaskMoE.from_dense(tiny_dense, [TaskSpec(name="a", num_labels=2)], num_experts=2)
    model.save_pretrained(tmp_path / "saved")
    other = BertForTaskMoE.from_dense(tiny_dense, [TaskSpec(name="a", num_labels=2)], num_experts=3).config
    with pytest.raises(ValueError, match=r"Cannot load BertForTaskMoE .*experts\.up_proj \(2, .*\) on file, \(3, "):
        BertForTaskMoE.from_pretrained(tmp_path / "saved", config=other)
    loaded, info = BertForTaskMoE.from_pretrained(tmp_path / "saved", config=other, ignore_mismatched_sizes=True,
                                                  output_loading_info=True)
    assert loaded.config.num_experts == 3 and any("experts.up_proj" in m[0] for m in info["mismatched_keys"])


def test_an_unreadable_file_or_a_full_disk_is_a_refusal_not_an_internal_error(
    tmp_path, tiny_dense, capsys, monkeypatch
):
    """An unreadable data file (permissions; simulated, root reads everything) exits 2 naming the file; a disk that
    fills while the new model is saved exits 2 naming the file, and --overwrite_output_dir leaves the earlier run."""
    import transformers.modeling_utils

    task_file = _bad_task_file(tmp_path)
    train = (task_file.parent / "t" / "train.jsonl").resolve()
    real = Path.read_bytes

    def denied(self):
        if self.resolve() == train:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", denied)
    _refused(
        capsys,
        _argv(tmp_path / "out", tiny_dense, "--tasks", str(task_file)),
        r"t/train.jsonl could not be read \(Permission denied\)",
    )
    monkeypatch.undo()

    out = tmp_path / "run"
    run_multitask.main(_argv(out, tiny_dense))
    before = _run_files(out)

    def disk_full(tensors, filename, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(filename))

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", disk_full)
    _refused(
        capsys,
        _argv(out, tiny_dense, "--overwrite_output_dir", "--seed", "3"),
        r"cannot use .*model.safetensors: No space left on device\. Check the path, its permissions and the free space",
    )
    monkeypatch.undo()
    assert _run_files(out) == before
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".run.")]


def test_the_trainer_refuses_a_batch_tokenised_for_another_vocabulary_before_the_model_runs(
    tmp_path, tiny_dense, minilm
):
    """In Python: `MultiTaskTrainer.train` on ids the model's embedding has no row for (a tokenizer with a larger
    vocabulary) stops with the collator's ValueError, not an IndexError inside the embedding; no step is taken."""
    from datasets import Dataset

    from hf_taskmoe.training import MultiTaskTrainer, MultiTaskTrainingArguments

    model = BertForTaskMoE.from_dense(_dense_with(tmp_path, minilm, vocab_size=500), [TaskSpec(name="a", num_labels=2)],
                                      num_experts=2)
    rows = Dataset.from_dict(
        {"input_ids": [[101, 7592, 102], [101, 200, 102]], "attention_mask": [[1, 1, 1]] * 2, "labels": [0, 1]}
    )
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    args = MultiTaskTrainingArguments(
        output_dir=str(tmp_path / "o"),
        per_device_train_batch_size=2,
        max_steps=1,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = MultiTaskTrainer(model=model, args=args, train_dataset={"a": rows})
    with pytest.raises(
        ValueError, match=r"`input_ids` holds (7592|101|102) .*vocabulary \(`vocab_size`\) has 500 entries"
    ):
        trainer.train()
    assert not calls and trainer.state.global_step == 0
