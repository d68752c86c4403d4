"""Extractive question answering (SQuAD-style): the answer is a span of the context.

The pure parts of the problem type, usable without a model:

- `tokenize_qa`: (question, context) pairs -> model features. A context longer than one window is cut into
  overlapping windows (`stride` tokens shared by neighbours), so one example may give several features; each
  feature keeps the index of its example and the character offsets of its context tokens, and, for training, the
  token positions of the answer (or of [CLS] when the answer is not inside that window).
- `best_spans` / `decode_best_span`: start/end logits of all the features of one example -> the best valid span
  (start <= end, both in the context, at most `max_answer_length` tokens) and its text, cut from the context by
  character offsets (so the answer keeps the context's own spelling, case and spacing).
- `normalize_answer`, `exact_match`, `f1`, `squad_scores`: the SQuAD v1.1 metrics (Rajpurkar et al., 2016), each
  prediction scored against every reference answer and the best score kept.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Sequence

import numpy as np

#: one example's answers, as SQuAD writes them: {"text": [...], "answer_start": [...]} (character offsets)
Answers = dict


# ----------------------------------------------------------------------------------------------- tokenising
def _check_answers(answers: Answers, context: str, index: int) -> tuple[int, int] | None:
    """[start, end) characters of the first answer, checked against the context; None for no answer (SQuAD 2.0)."""
    if not isinstance(answers, dict) or not {"text", "answer_start"} <= set(answers):
        raise ValueError(
            f"Example {index}: `answers` must be a dict {{'text': [...], 'answer_start': [...]}}, got {answers!r}."
        )
    texts, starts = answers["text"], answers["answer_start"]
    if isinstance(texts, str) or isinstance(starts, int) or len(texts) != len(starts):
        raise ValueError(
            f"Example {index}: `answers` needs lists of the same length under 'text' and 'answer_start', got {answers!r}."
        )
    if not texts:
        return None
    text, start = texts[0], starts[0]
    if isinstance(start, bool) or not isinstance(start, int) or not isinstance(text, str) or not text:
        raise ValueError(f"Example {index}: an answer is a non-empty text and an integer offset, got {text!r} at {start!r}.")
    if not 0 <= start <= len(context) - len(text) or context[start:start + len(text)] != text:
        raise ValueError(
            f"Example {index}: the answer {text!r} is not at character {start} of its context "
            f"(the context there reads {context[max(start, 0):max(start, 0) + len(text)]!r})."
        )
    return start, start + len(text)


def _cut_question(tokenizer, question: str, max_question_length: int) -> str:
    """The question, cut after its `max_question_length`-th token (a long question would leave no room for context)."""
    enc = tokenizer(question, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    return question if len(offsets) <= max_question_length else question[: offsets[max_question_length - 1][1]]


def tokenize_qa(
    tokenizer,
    questions: Sequence[str],
    contexts: Sequence[str],
    max_length: int = 384,
    stride: int = 128,
    answers: Sequence[Answers] | None = None,
    max_question_length: int = 64,
) -> dict[str, list]:
    """Tokenise (question, context) pairs into features, a long context into several overlapping windows.

    Each feature is `[CLS] question [SEP] context-window [SEP]`; only the context is ever cut (a question longer than
    `max_question_length` tokens is cut first, so that every window holds context). Neighbouring windows of one
    context share `stride` tokens, so an answer cut by one window boundary lies whole in the next window.

    Args:
        tokenizer: a fast tokenizer (offsets are needed).
        questions, contexts: one question and its context per example.
        max_length: tokens per feature, special tokens included.
        stride: tokens shared by consecutive windows of one context; `0 <= stride` and the windows must leave room
            for more than `stride` context tokens.
        answers: for training, each example's SQuAD answers `{"text": [...], "answer_start": [...]}`; the first
            answer is the label. An empty list means "no answer" (labelled at [CLS]).
        max_question_length: questions are cut to this many tokens.

    Returns:
        Lists with one entry per feature: `input_ids`, `attention_mask` (and `token_type_ids` when the tokenizer
        makes them), `example_index` (position of the feature's example in `questions`), `offset_mapping`
        (`(start, end)` characters in the context for a context token, None for question and special tokens),
        and with `answers`: `start_positions`, `end_positions` (token positions of the answer's first and last
        token inside the feature, both the [CLS] position when the answer is not wholly inside the window).
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("`tokenize_qa` needs a fast tokenizer (it reads character offsets); load it with use_fast=True.")
    if isinstance(questions, str) or isinstance(contexts, str):
        raise ValueError("`questions` and `contexts` are lists of texts (one per example), not a single text.")
    if len(questions) != len(contexts) or (answers is not None and len(answers) != len(questions)):
        raise ValueError(
            f"`questions` ({len(questions)}), `contexts` ({len(contexts)})"
            + (f" and `answers` ({len(answers)})" if answers is not None else "") + " must have one entry per example."
        )
    for name, value in (("max_length", max_length), ("stride", stride), ("max_question_length", max_question_length)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "stride" else 1):
            raise ValueError(f"`{name}` must be an integer >= {0 if name == 'stride' else 1}, got {value!r}.")
    for i, (q, c) in enumerate(zip(questions, contexts)):
        if not isinstance(q, str) or not q.strip() or not isinstance(c, str) or not c.strip():
            raise ValueError(f"Example {i}: the question and the context must be non-empty texts, got {q!r} and {c!r}.")
    spans = [_check_answers(a, c, i) for i, (a, c) in enumerate(zip(answers, contexts))] if answers is not None else None

    # leading spaces of a question count as tokens for some tokenizers and would eat the context's room
    questions = [_cut_question(tokenizer, q.lstrip(), max_question_length) for q in questions]
    specials = tokenizer.num_special_tokens_to_add(pair=True)
    longest = max(len(tokenizer(q, add_special_tokens=False)["input_ids"]) for q in questions)
    room = max_length - specials - longest  # context tokens per window, for the longest question
    if room <= stride:
        raise ValueError(
            f"`max_length` {max_length} leaves {room} context token(s) per window after the question ({longest} "
            f"tokens) and {specials} special tokens, not more than `stride` {stride}: raise `max_length` or lower "
            "`stride` / `max_question_length`."
        )

    enc = tokenizer(
        list(questions),
        list(contexts),
        truncation="only_second",
        max_length=max_length,
        stride=stride,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
    )
    example_index = enc.pop("overflow_to_sample_mapping")
    offsets = enc.pop("offset_mapping")
    features: dict[str, list] = {key: list(values) for key, values in enc.items()}
    features["example_index"] = list(example_index)
    features["offset_mapping"] = []
    if spans is not None:
        features["start_positions"], features["end_positions"] = [], []
    for f, example in enumerate(example_index):
        in_context = [s == 1 for s in enc.sequence_ids(f)]
        context_offsets = [tuple(o) if keep else None for o, keep in zip(offsets[f], in_context)]
        features["offset_mapping"].append(context_offsets)
        if spans is None:
            continue
        start, end = _answer_tokens(context_offsets, spans[example])
        if start is None:  # no answer, or not wholly in this window: point at [CLS]
            ids = features["input_ids"][f]
            start = end = ids.index(tokenizer.cls_token_id) if tokenizer.cls_token_id in ids else 0
        features["start_positions"].append(start)
        features["end_positions"].append(end)
    return features


def _answer_tokens(offsets: list, span: tuple[int, int] | None) -> tuple[int | None, int | None]:
    """Token positions of the first and last token of the character span [start, end) in a window whose context
    tokens have `offsets` (None elsewhere); (None, None) when the span is absent or not wholly in the window."""
    if span is None:
        return None, None
    tokens = [t for t, o in enumerate(offsets) if o is not None and o[1] > o[0]]  # context tokens that hold text
    if not tokens or offsets[tokens[0]][0] > span[0] or offsets[tokens[-1]][1] < span[1]:
        return None, None
    first = next(t for t in tokens if offsets[t][1] > span[0])  # the token the answer starts in
    last = next(t for t in reversed(tokens) if offsets[t][0] < span[1])  # the token the answer ends in
    return first, last


# ----------------------------------------------------------------------------------------------- decoding
def _per_feature(values, name: str) -> list[np.ndarray]:
    """Logits of one example as one 1-D array per feature: a 1-D array (one feature), a 2-D array or a list of 1-D."""
    if hasattr(values, "detach"):  # a torch tensor
        values = values.detach().float().cpu().numpy()
    if isinstance(values, np.ndarray) and values.ndim == 1:
        return [values]
    rows = [np.asarray(v.detach().float().cpu() if hasattr(v, "detach") else v, dtype=np.float64) for v in values]
    if any(r.ndim != 1 for r in rows):
        raise ValueError(f"`{name}` must be one 1-D array of logits per feature.")
    return rows


def _is_one_feature(offsets) -> bool:
    """Whether `offsets` is one feature's offset mapping (pairs and Nones) rather than a list of them."""
    first = next((o for o in offsets if o is not None), None)
    if first is None:  # only Nones: one feature without context tokens (a feature list holds lists)
        return True
    return len(first) == 2 and all(isinstance(v, (int, np.integer)) for v in first)


def best_spans(
    start_logits,
    end_logits,
    offsets: Sequence[Sequence],
    context: str,
    max_answer_length: int = 30,
    n_best: int = 20,
) -> list[dict]:
    """The valid spans of one example, best first: dicts with `answer` (the context's text of the span), `start`,
    `end` (characters, end exclusive), `score` (start logit + end logit) and `feature` (which window).

    `start_logits` / `end_logits` hold one row per feature of the example (`tokenize_qa`'s features with its
    `example_index`: a 2-D array or a list of 1-D arrays), `offsets` each feature's `offset_mapping`; a single 1-D
    array is one feature, given with that feature's `offset_mapping` (or a list holding it). In each feature the `n_best` highest start and
    end logits are paired; a pair counts when both tokens are context tokens (an offset that is None or negative,
    e.g. (-1, -1), marks another token), start <= end and the span is at most `max_answer_length` tokens. Padding
    beyond a feature's offsets is ignored."""
    starts, ends = _per_feature(start_logits, "start_logits"), _per_feature(end_logits, "end_logits")
    if _is_one_feature(offsets):
        offsets = [offsets]
    if not len(starts) == len(ends) == len(offsets):
        raise ValueError(
            f"One example's features: {len(starts)} rows of start logits, {len(ends)} of end logits and "
            f"{len(offsets)} offset lists must match."
        )
    candidates = []
    for feature, (start_row, end_row, feature_offsets) in enumerate(zip(starts, ends, offsets)):
        n = min(len(start_row), len(end_row), len(feature_offsets))
        is_context = [o is not None and o[0] >= 0 and o[1] > o[0] for o in feature_offsets[:n]]
        top_starts = np.argsort(start_row[:n])[::-1][:n_best]
        top_ends = np.argsort(end_row[:n])[::-1][:n_best]
        for s in top_starts:
            if not is_context[s]:
                continue
            for e in top_ends:
                if not is_context[e] or e < s or e - s + 1 > max_answer_length:
                    continue
                begin, finish = int(feature_offsets[s][0]), int(feature_offsets[e][1])
                candidates.append({
                    "answer": context[begin:finish],
                    "start": begin,
                    "end": finish,
                    "score": float(start_row[s] + end_row[e]),
                    "feature": feature,
                })
    candidates.sort(key=lambda c: -c["score"])
    return candidates[:n_best]


def decode_best_span(
    start_logits,
    end_logits,
    offsets: Sequence[Sequence],
    context: str,
    max_answer_length: int = 30,
    n_best: int = 20,
) -> str:
    """The text of the best valid span of one example over all its features (`best_spans`); "" when no span is
    valid (e.g. every window's best tokens are question or special tokens)."""
    spans = best_spans(start_logits, end_logits, offsets, context, max_answer_length, n_best)
    return spans[0]["answer"] if spans else ""


# ----------------------------------------------------------------------------------------------- metrics
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD v1.1's answer normalisation: lower case, drop ASCII punctuation, drop the articles a/an/the, and
    collapse whitespace to single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _references(references: str | Sequence[str]) -> list[str]:
    refs = [references] if isinstance(references, str) else list(references)
    if not refs:
        raise ValueError("Score a prediction against at least one reference answer.")
    return refs


def exact_match(prediction: str, references: str | Sequence[str]) -> float:
    """1.0 when the normalised prediction equals a normalised reference, else 0.0."""
    predicted = normalize_answer(prediction)
    return float(any(predicted == normalize_answer(r) for r in _references(references)))


def _token_f1(prediction: str, reference: str) -> float:
    predicted, gold = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not predicted or not gold:  # (SQuAD 2.0's reading of an empty answer: right only against an empty one)
        return float(predicted == gold)
    same = sum((Counter(predicted) & Counter(gold)).values())  # tokens in common, with multiplicity
    if same == 0:
        return 0.0
    precision, recall = same / len(predicted), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def f1(prediction: str, references: str | Sequence[str]) -> float:
    """Token-level F1 of the normalised prediction against the best-matching reference (max over references)."""
    return max(_token_f1(prediction, r) for r in _references(references))


def squad_scores(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> dict[str, float]:
    """Mean `exact_match` and `f1` over examples (fractions in [0, 1]); `references[i]` lists example i's answers."""
    if len(predictions) != len(references) or not predictions:
        raise ValueError(
            f"Need one list of reference answers per prediction, got {len(predictions)} predictions and "
            f"{len(references)} reference lists."
        )
    return {
        "exact_match": float(np.mean([exact_match(p, r) for p, r in zip(predictions, references)])),
        "f1": float(np.mean([f1(p, r) for p, r in zip(predictions, references)])),
    }
