import pytest
import torch
from transformers import AutoTokenizer, pipeline

import hf_taskmoe
from hf_taskmoe import BertForTaskMoE, BertWithPALs, TaskSpec
from hf_taskmoe.pipelines import PIPELINE_TASK, TEXT2TEXT_PIPELINE_TASK

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
    pipe = pipeline(PIPELINE_TASK, model=str(saved))  # loads model and tokenizer from the folder
    assert isinstance(pipe, hf_taskmoe.MultiTaskTextClassificationPipeline)
    model, tok = pipe.model, pipe.tokenizer

    single = pipe("a fine film", task="sst2")
    probs = _direct(model, tok, "a fine film", None, "sst2").softmax(-1)
    assert single["label"] == ["negative", "positive"][int(probs.argmax())]
    assert single["score"] == pytest.approx(probs.max().item(), abs=1e-5)

    pair = pipe({"text": "A man plays.", "text_pair": "A man is playing."}, task="stsb")
    assert pair["score"] == pytest.approx(
        _direct(model, tok, "A man plays.", "A man is playing.", "stsb").item(), abs=1e-5
    )

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
    assert [t["label"] for t in top] == sorted(
        ["negative", "positive"], key=lambda label: -probs[["negative", "positive"].index(label)].item()
    )


def test_pipeline_bad_inputs_and_other_families(saved, minilm):
    pipe = pipeline(PIPELINE_TASK, model=str(saved))
    with pytest.raises(ValueError, match="Say which task"):
        pipe("no task given")
    with pytest.raises(ValueError, match="Unknown task 'nope'"):
        pipe("x", task="nope")
    with pytest.raises(ValueError, match="'text'"):
        pipe({"sentence": "x"}, task="sst2")
    pals = BertWithPALs.from_dense(str(minilm), tasks=TASKS[:2], pal_size=24, pal_num_heads=4).eval()
    out = pipeline(PIPELINE_TASK, model=pals, tokenizer=pipe.tokenizer)(["fine", "bad"], task="sst2")
    assert [r["task"] for r in out] == ["sst2", "sst2"] and all(0.5 <= r["score"] <= 1 for r in out)


def test_pipeline_loads_from_a_repo_id_through_the_hub_cache(saved, tmp_path, monkeypatch):
    """`pipeline(..., model="org/name")` resolved from a cache snapshot with the Hub switched off."""
    import huggingface_hub.constants

    from .conftest import make_hub_cache

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    cache = tmp_path / "cache"
    make_hub_cache(cache, "org/mttag-multitask", saved)
    pipe = pipeline(PIPELINE_TASK, model="org/mttag-multitask", model_kwargs={"cache_dir": str(cache)},
                    tokenizer=AutoTokenizer.from_pretrained(saved))
    local = pipeline(PIPELINE_TASK, model=str(saved))
    for inputs in (
        {"text": "a fine film", "task": "sst2"},
        {"text": "A man plays.", "text_pair": "A man is playing.", "task": "stsb"},
    ):
        assert pipe(inputs) == local(inputs)


def save_routed_seq2seq(tiny_dense, folder):
    """Save a BartTaskRouted (warm-started from a tiny BERT with the MiniLM vocabulary, tasks trec and boolq)
    whose tasks route apart, with its tokenizer."""
    from hf_taskmoe import BartTaskRouted, bart_from_bert

    torch.manual_seed(0)
    tasks = [
        TaskSpec(name="trec", problem_type="seq2seq"),
        TaskSpec(name="boolq", problem_type="seq2seq", text_fields=["question", "passage"]),
    ]
    model = BartTaskRouted.from_dense(bart_from_bert(tiny_dense), tasks, num_experts=2).eval()
    with torch.no_grad():  # distinct experts and routes, as training would leave them
        for name, p in model.named_parameters():
            if ".experts." in name or name.startswith("router."):
                p.add_(torch.randn_like(p) * 0.5)
    assert not torch.equal(model.task_routing()[0].argmax(-1), model.task_routing()[1].argmax(-1))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_dense).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def saved_seq2seq(tiny_dense, tmp_path_factory):
    return save_routed_seq2seq(tiny_dense, tmp_path_factory.mktemp("routed"))


def test_text2text_pipeline_single_pair_and_mixed_batch_match_generate(saved_seq2seq):
    pipe = pipeline(TEXT2TEXT_PIPELINE_TASK, model=str(saved_seq2seq), max_new_tokens=6)
    assert isinstance(pipe, hf_taskmoe.MultiTaskText2TextGenerationPipeline)
    model, tok = pipe.model, pipe.tokenizer
    assert type(model).__name__ == "TaskRoutedForSeq2SeqLM"  # a saved BartTaskRouted, through AutoModelForSeq2SeqLM

    def direct(text, pair, task, **kwargs):
        enc = tok(text, pair, return_tensors="pt", return_token_type_ids=False)
        with torch.no_grad():
            ids = model.generate(**enc, task_ids=model.task_ids_for([task]), max_new_tokens=6, **kwargs)
        return tok.decode(ids[0], skip_special_tokens=True).strip()

    single = pipe("What is the capital of France?", task="trec")
    assert single == {"task": "trec", "generated_text": direct("What is the capital of France?", None, "trec")}
    pair = pipe({"text": "is it raining", "text_pair": "The sky is clear today."}, task="boolq", num_beams=3)
    assert pair["generated_text"] == direct("is it raining", "The sky is clear today.", "boolq", num_beams=3)

    rows = [
        {"text": "Who wrote Hamlet?", "task": "trec"},
        {"text": "is water wet", "text_pair": "Water makes things wet, as everyone knows.", "task": "boolq"},
        {"text": "How many legs does a spider have?", "task": "trec"},
    ]
    results = pipe(rows, batch_size=3)  # one padded batch of two tasks, a single text and a pair
    assert [r["task"] for r in results] == ["trec", "boolq", "trec"]
    expected = [direct(r["text"], r.get("text_pair"), r["task"]) for r in rows]
    assert [r["generated_text"] for r in results] == expected
    # the task matters: the same text through the other task's routes
    assert (
        direct("Who wrote Hamlet?", None, "boolq") != expected[0] or direct("is water wet", None, "trec") != expected[1]
    )


def test_text2text_pipeline_loads_from_a_repo_id_through_the_hub_cache(saved_seq2seq, tmp_path, monkeypatch):
    import huggingface_hub.constants

    from .conftest import make_hub_cache

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    make_hub_cache(tmp_path / "cache", "org/routed-multitask", saved_seq2seq)
    pipe = pipeline(
        TEXT2TEXT_PIPELINE_TASK,
        model="org/routed-multitask",
        model_kwargs={"cache_dir": str(tmp_path / "cache")},
        tokenizer=AutoTokenizer.from_pretrained(saved_seq2seq),
        max_new_tokens=5,
    )
    local = pipeline(TEXT2TEXT_PIPELINE_TASK, model=str(saved_seq2seq), max_new_tokens=5)
    rows = [{"text": "Who wrote Hamlet?", "task": "trec"}, {"text": "is it", "text_pair": "It is.", "task": "boolq"}]
    assert pipe(rows) == local(rows)


def test_pipelines_refuse_the_other_problem_types(saved, saved_seq2seq):
    classifier = BertForTaskMoE.from_pretrained(saved)
    text2text = pipeline(
        TEXT2TEXT_PIPELINE_TASK, model=classifier, tokenizer=AutoTokenizer.from_pretrained(saved)
    )
    with pytest.raises(ValueError, match=r"'sst2' is single_label_classification; this pipeline serves \['seq2seq'\]"):
        text2text("a fine film", task="sst2")
    with pytest.raises(ValueError, match="'trec' is seq2seq; this pipeline serves"):
        pipeline(PIPELINE_TASK, model=str(saved_seq2seq))("Who?", task="trec")
    with pytest.raises(TypeError, match="unexpected keyword"):
        pipeline(PIPELINE_TASK, model=str(saved))("a fine film", task="sst2", num_beams=2)
