import pytest
import torch
from transformers import AutoTokenizer, pipeline

import hf_taskmoe
from hf_taskmoe import BertForTaskMoE, BertWithPALs, TaskSpec

TASKS = [
    TaskSpec(name="sst2", label_names=["negative", "positive"]),
    TaskSpec(name="stsb", problem_type="regression", text_fields=["sentence1", "sentence2"]),
    TaskSpec(name="tags", problem_type="multi_label_classification", num_labels=3),
]


@pytest.fixture(scope="module")
def saved(minilm, tmp_path_factory):
    folder = tmp_path_factory.mktemp("mt")
    torch.manual_seed(0)
    model = BertForTaskMoE.from_dense(str(minilm), tasks=TASKS, num_experts=2).eval()
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(minilm).save_pretrained(folder)
    return folder


def _direct(model, tok, text, pair, task):
    enc = tok(text, pair, return_tensors="pt")
    with torch.no_grad():
        return model(**enc, task_ids=model.task_ids_for([task])).task_logits[task][0]


def test_single_pair_and_mixed_batch_match_the_model(saved):
    pipe = pipeline(hf_taskmoe.PIPELINE_TASK, model=str(saved))  # loads model and tokenizer from the folder
    assert isinstance(pipe, hf_taskmoe.MultiTaskTextClassificationPipeline)
    model, tok = pipe.model, pipe.tokenizer

    single = pipe("a fine film", task="sst2")
    probs = _direct(model, tok, "a fine film", None, "sst2").softmax(-1)
    assert single["label"] == ["negative", "positive"][int(probs.argmax())]
    assert single["score"] == pytest.approx(probs.max().item(), abs=1e-5)

    pair = pipe({"text": "A man plays.", "text_pair": "A man is playing."}, task="stsb")
    assert pair["score"] == pytest.approx(_direct(model, tok, "A man plays.", "A man is playing.", "stsb").item(), abs=1e-5)

    rows = [
        {"text": "tagged words", "task": "tags"},
        {"text": "a dull, long film", "task": "sst2"},
        {"text": "A cat sleeps.", "text_pair": "The cat is asleep.", "task": "stsb"},
        {"text": "great", "task": "sst2"},
    ]
    results = pipe(rows, batch_size=4)  # one padded batch of three tasks, singles and a pair
    assert [r["task"] for r in results] == ["tags", "sst2", "stsb", "sst2"]
    for row, result in zip(rows, results):
        logits = _direct(model, tok, row["text"], row.get("text_pair"), row["task"])
        if row["task"] == "stsb":
            assert result["score"] == pytest.approx(logits.item(), abs=1e-4)
        elif row["task"] == "sst2":
            assert result["score"] == pytest.approx(logits.softmax(-1).max().item(), abs=1e-4)
        else:
            expected = logits.sigmoid()
            assert list(result["scores"].values()) == pytest.approx(expected.tolist(), abs=1e-4)
            assert result["labels"] == [f"LABEL_{i}" for i in range(3) if expected[i] > 0.5]
    top = pipe("a fine film", task="sst2", top_k=2)["top"]
    assert [t["label"] for t in top] == sorted(["negative", "positive"], key=lambda l: -probs[["negative", "positive"].index(l)].item())


def test_pipeline_bad_inputs_and_other_families(saved, minilm):
    pipe = pipeline(hf_taskmoe.PIPELINE_TASK, model=str(saved))
    with pytest.raises(ValueError, match="Say which task"):
        pipe("no task given")
    with pytest.raises(ValueError, match="Unknown task 'nope'"):
        pipe("x", task="nope")
    with pytest.raises(ValueError, match="'text'"):
        pipe({"sentence": "x"}, task="sst2")
    pals = BertWithPALs.from_dense(str(minilm), tasks=TASKS[:2], pal_size=24, pal_num_heads=4).eval()
    out = pipeline(hf_taskmoe.PIPELINE_TASK, model=pals, tokenizer=pipe.tokenizer)(["fine", "bad"], task="sst2")
    assert [r["task"] for r in out] == ["sst2", "sst2"] and all(0.5 <= r["score"] <= 1 for r in out)


def test_pipeline_loads_from_a_repo_id_through_the_hub_cache(saved, tmp_path, monkeypatch):
    """`pipeline(..., model="org/name")` resolved from a cache snapshot with the Hub switched off."""
    import huggingface_hub.constants

    from .conftest import make_hub_cache

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    cache = tmp_path / "cache"
    make_hub_cache(cache, "org/mttag-multitask", saved)
    pipe = pipeline(hf_taskmoe.PIPELINE_TASK, model="org/mttag-multitask", model_kwargs={"cache_dir": str(cache)},
                    tokenizer=AutoTokenizer.from_pretrained(saved))
    local = pipeline(hf_taskmoe.PIPELINE_TASK, model=str(saved))
    for inputs in ({"text": "a fine film", "task": "sst2"}, {"text": "A man plays.", "text_pair": "A man is playing.", "task": "stsb"}):
        assert pipe(inputs) == local(inputs)
