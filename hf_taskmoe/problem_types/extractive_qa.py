"""Extractive question answering (SQuAD-style): the answer is a span of the context.

The `extractive_qa` problem type (`ExtractiveQA`): a task whose `text_fields` are `[question_field, context_field]`
and whose label (`label_field`, e.g. `"answers"`) is SQuAD's `{"text": [...], "answer_start": [...]}`. Its head
scores every token as the answer's start and end (`Linear(hidden, 2)`), a row's label is the `(start, end)` token
pair, the loss the mean of the start and end cross-entropies; predictions are decoded back to text of the context
and scored with SQuAD's exact match and token F1 (the metric names `exact_match` and `f1` of an extractive-QA task
mean SQuAD's, computed here). The Hub files its results under `question-answering`.

The pure parts, usable without a model:

- `tokenize_qa`: (question, context) pairs -> model features. A context longer than one window is cut into
  overlapping windows (`stride` tokens shared by neighbours), so one example may give several features; each
  feature keeps the index of its example and the character offsets of its context tokens, and, for training, the
  token positions of the answer (or of [CLS] when the answer is not inside that window).
- `best_spans`: start/end logits of all the features of one example -> its valid spans, best first (start <= end,
  both in the context, at most `max_answer_length` tokens), each with its text, cut from the context by character
  offsets (so the answer keeps the context's own spelling, case and spacing); the first one's text is the answer.
- `normalize_answer`, `exact_match`, `f1`, `squad_scores`: the SQuAD v1.1 metrics (Rajpurkar et al., 2016), each
  prediction scored against every reference answer and the best score kept.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from ..layers.task_head import IGNORE_INDEX, TaskHead
from .base import ENCODER, ProblemType, register_problem_type

#: one example's answers, as SQuAD writes them: {"text": [...], "answer_start": [...]} (character offsets)
Answers = dict


# ----------------------------------------------------------------------------------------------- tokenising
def _check_answers(answers: Answers, context: str, where: str) -> tuple[int, int] | None:
    """[start, end) characters of the first answer, checked against the context; None for no answer (SQuAD 2.0)."""
    if not isinstance(answers, dict) or not {"text", "answer_start"} <= set(answers):
        raise ValueError(
            f"{where}: `answers` must be a dict {{'text': [...], 'answer_start': [...]}}, got {answers!r}."
        )
    texts, starts = answers["text"], answers["answer_start"]
    if isinstance(texts, str) or isinstance(starts, int) or len(texts) != len(starts):
        raise ValueError(
            f"{where}: `answers` needs lists of the same length under 'text' and 'answer_start', got {answers!r}."
        )
    if not texts:
        return None
    text, start = texts[0], starts[0]
    if isinstance(start, bool) or not isinstance(start, int) or not isinstance(text, str) or not text:
        raise ValueError(f"{where}: an answer is a non-empty text and an integer offset, got {text!r} at {start!r}.")
    if not 0 <= start <= len(context) - len(text) or context[start : start + len(text)] != text:
        raise ValueError(
            f"{where}: the answer {text!r} is not at character {start} of its context "
            f"(the context there reads {context[max(start, 0) : max(start, 0) + len(text)]!r})."
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
    where=None,
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
        where: `where(i)` names example i in error messages (default `"Example i"`).

    Returns:
        Lists with one entry per feature: `input_ids`, `attention_mask` (and `token_type_ids` when the tokenizer
        makes them), `example_index` (position of the feature's example in `questions`), `offset_mapping`
        (`(start, end)` characters in the context for a context token, None for question and special tokens),
        and with `answers`: `start_positions`, `end_positions` (token positions of the answer's first and last
        token inside the feature, both the [CLS] position when the answer is not wholly inside the window).
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            "`tokenize_qa` needs a fast tokenizer (it reads character offsets); load it with use_fast=True."
        )
    if isinstance(questions, str) or isinstance(contexts, str):
        raise ValueError("`questions` and `contexts` are lists of texts (one per example), not a single text.")
    if len(questions) != len(contexts) or (answers is not None and len(answers) != len(questions)):
        raise ValueError(
            f"`questions` ({len(questions)}), `contexts` ({len(contexts)})"
            + (f" and `answers` ({len(answers)})" if answers is not None else "")
            + " must have one entry per example."
        )
    for name, value in (("max_length", max_length), ("stride", stride), ("max_question_length", max_question_length)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "stride" else 1):
            raise ValueError(f"`{name}` must be an integer >= {0 if name == 'stride' else 1}, got {value!r}.")
    where = where or (lambda i: f"Example {i}")
    for i, (q, c) in enumerate(zip(questions, contexts)):
        if not isinstance(q, str) or not q.strip() or not isinstance(c, str) or not c.strip():
            raise ValueError(f"{where(i)}: the question and the context must be non-empty texts, got {q!r} and {c!r}.")
    spans = (
        [_check_answers(a, c, where(i)) for i, (a, c) in enumerate(zip(answers, contexts))]
        if answers is not None
        else None
    )

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
    array is one feature, given with that feature's `offset_mapping` (or a list holding it). In each feature the
    `n_best` highest start and end logits are paired; a pair counts when both tokens are context tokens (an offset
    that is None or negative, e.g. (-1, -1), marks another token), start <= end and the span is at most
    `max_answer_length` tokens. Padding beyond a feature's offsets is ignored."""
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
                candidates.append(
                    {
                        "answer": context[begin:finish],
                        "start": begin,
                        "end": finish,
                        "score": float(start_row[s] + end_row[e]),
                        "feature": feature,
                    }
                )
    candidates.sort(key=lambda c: -c["score"])
    return candidates[:n_best]



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


# ----------------------------------------------------------------------------------------------- the head
class ExtractiveQAHead(TaskHead):
    """Start and end scores of every token (`Linear(hidden, 2)` on the token states, as BERT's SQuAD head); the
    loss is the mean of the start and the end cross-entropy over the row's tokens."""

    def __init__(self, task, hidden_size, dropout, scale_loss_by_num_classes=False):
        super().__init__(task, hidden_size, dropout, scale_loss_by_num_classes)
        self.qa_outputs = nn.Linear(hidden_size, 2)

    def forward(self, sequence_output, pooled_output, span_positions=None):
        return self.qa_outputs(self.dropout(sequence_output))  # (rows, seq, 2): start, end

    def label_width(self):
        return 2

    def prepare_labels(self, labels, rows, seq_len, padded=True, check_values=True):
        """`(rows, 2)` start and end token positions, each in `[0, seq_len)` (-100: row not scored)."""
        values = self._own_columns(labels, rows, 2, padded, "extractive-QA", check_values)  # (rows, 2)
        positions = self._class_indices(values, rows, seq_len, check_values)
        if check_values:
            backwards = (positions[:, 1] < positions[:, 0]) & (positions[:, 0] != IGNORE_INDEX)
            if backwards.any():
                raise ValueError(
                    f"Labels of extractive-QA task {self.task_name!r} are (start, end) token positions with end >= "
                    f"start; rows {rows[backwards.nonzero(as_tuple=True)[0][:5]].tolist()} end before they start."
                )
        return positions

    def loss(self, logits, labels):
        # no division by log(seq_len) under `scale_loss_by_num_classes`: a row's "classes" are its tokens, whose
        # number is the batch's padding, not a property of the task
        start = F.cross_entropy(logits[..., 0].float(), labels[:, 0], ignore_index=IGNORE_INDEX, reduction="sum")
        end = F.cross_entropy(logits[..., 1].float(), labels[:, 1], ignore_index=IGNORE_INDEX, reduction="sum")
        kept = (labels[:, 0] != IGNORE_INDEX).sum().clamp(min=1)  # no read back: an all-ignored task gives 0
        return (start + end) / (2 * kept)


# ----------------------------------------------------------------------------------------------- the type
def _columns(dataset) -> dict[str, list]:
    """The columns of a tokenised set (a `datasets.Dataset`, a view holding one as `.dataset`, or a list of rows)."""
    dataset = getattr(dataset, "dataset", dataset)  # the trainer's TaskView wraps the tokenised set
    if hasattr(dataset, "column_names"):
        return {
            name: list(dataset[name])
            for name in dataset.column_names
            if name in ("window", "offset_mapping", "context", "answer_texts")
        }
    rows = list(dataset)
    return {name: [row[name] for row in rows] for name in (rows[0] if rows else {})}


class ExtractiveQA(ProblemType):
    """`extractive_qa`: the answer is a span of the context (see the module docstring)."""

    name = "extractive_qa"
    hub_pipeline_tag = "question-answering"
    default_metrics = ("exact_match", "f1")
    capabilities = frozenset({ENCODER})
    has_classes = False
    pipeline = "classification"  # the encoder pipeline, which gives each input's rows (windows) to `pipeline_result`
    pipeline_inputs = ("question", "context")
    head_class = ExtractiveQAHead
    #: the label field holds an object (SQuAD's answers dict), which the data files' column check must let through
    label_is_object = True
    #: tokens shared by neighbouring windows of a long context, as a share of `max_length` (run_qa.py's 128 of 384)
    stride_share = 1 / 3
    #: a question keeps at most this many tokens, and at most a quarter of `max_length`: every window then holds
    #: more context tokens than the stride
    max_question_length = 64
    #: the longest answer decoded, in tokens, and the start / end candidates tried per window
    max_answer_length = 30
    n_best = 20

    # ------------------------------------------------------------------ the spec
    def resolve_num_labels(self, spec, prefix):
        if spec.num_labels is not None:
            raise ValueError(
                f"{prefix}: `num_labels` has no meaning for problem_type 'extractive_qa' (the head scores every token "
                f"as start and end), got {spec.num_labels!r}; leave it out."
            )
        return None

    def check_spec(self, spec, prefix):
        if len(spec.text_fields) != 2:
            raise ValueError(
                f"{prefix}: problem_type 'extractive_qa' reads two text fields, the question's then the context's "
                f'(e.g. `"text_fields": ["question", "context"]`), got {list(spec.text_fields)}.'
            )
        if spec.label_names is not None:
            raise ValueError(f"{prefix}: `label_names` names classes; problem_type 'extractive_qa' has none.")
        return {}

    def stride(self, max_length: int) -> int:
        return int(max_length * self.stride_share)

    def question_length(self, max_length: int) -> int:
        return max(1, min(self.max_question_length, max_length // 4))

    # ------------------------------------------------------------------ data
    def encode_label(self, spec, value, where):
        """SQuAD's answers `{"text": [...], "answer_start": [...]}` (each answer a non-empty text and its character
        offset in the context; `[]` and `[]` for a question without answer), as a dict of two lists."""
        if not isinstance(value, dict) or set(value) != {"text", "answer_start"}:
            raise ValueError(
                f"{where}: the answers (field {spec.label_field!r}) must be an object "
                f'{{"text": [...], "answer_start": [...]}}, got {value!r}.'
            )
        texts, starts = value["text"], value["answer_start"]
        if not isinstance(texts, (list, tuple)) or not isinstance(starts, (list, tuple)) or len(texts) != len(starts):
            raise ValueError(
                f"{where}: the answers need lists of the same length under 'text' and 'answer_start', got {value!r}."
            )
        for text, start in zip(texts, starts):
            if (
                not isinstance(text, str)
                or not text
                or isinstance(start, bool)
                or not isinstance(start, int)
                or start < 0
            ):
                raise ValueError(
                    f"{where}: an answer is a non-empty text at a character offset >= 0, got {text!r} at {start!r}."
                )
        return {"text": list(texts), "answer_start": list(starts)}

    def check_row(self, spec, row, label, where):
        context = row.get(spec.text_fields[1])
        if label is None or not isinstance(context, str):
            return []
        return [
            f"Task {spec.name!r}, {where}: the answer {text!r} is not at character {start} of the context (field "
            f"{spec.text_fields[1]!r}), which reads {context[start : start + len(text)]!r} there."
            for text, start in zip(label["text"], label["answer_start"])
            if context[start : start + len(text)] != text
        ]

    def tokenize(self, spec, batch, labels, tokenizer, max_length, where, stride: int | None = None, **options):
        """One row per window of a context (`tokenize_qa`); besides the model columns each row keeps `window` (its
        place among its example's windows: 0 starts an example), `offset_mapping` (characters of each context token
        in the context, `[-1, -1]` elsewhere), `context`, and with labels `answer_texts`, which the metrics read."""
        questions, contexts = batch[spec.text_fields[0]], batch[spec.text_fields[1]]
        features = tokenize_qa(
            tokenizer,
            questions,
            contexts,
            max_length,
            self.stride(max_length) if stride is None else stride,
            labels,
            self.question_length(max_length),
            where=where,
        )
        example_index = features.pop("example_index")
        offsets = features.pop("offset_mapping")
        out = {k: v for k, v in features.items() if k not in ("start_positions", "end_positions")}
        out["window"] = [f - example_index.index(e) for f, e in enumerate(example_index)]
        out["offset_mapping"] = [[list(o) if o is not None else [-1, -1] for o in row] for row in offsets]
        out["context"] = [contexts[e] for e in example_index]
        if labels is not None:
            out["answer_texts"] = [list(labels[e]["text"]) for e in example_index]
            out["labels"] = [[s, e] for s, e in zip(features["start_positions"], features["end_positions"])]
        return out

    # ------------------------------------------------------------------ evaluation
    def decode(self, logits: np.ndarray, dataset) -> tuple[list[str], list[list[str]] | None]:
        """Answer texts of an evaluation set's examples from the logits of its rows `(rows, seq, 2)` (rows in the
        set's order, padded beyond each row's tokens): each example's best span (`best_spans`), "" where no span is
        valid (e.g. every window's best tokens are question or special tokens); and each example's reference answers
        (None without labels)."""
        logits = np.asarray(logits, dtype=np.float64)
        columns = _columns(dataset)
        missing = [c for c in ("window", "offset_mapping", "context") if c not in columns]
        if missing:
            raise ValueError(
                f"The evaluation set has no column(s) {missing}: tokenise it with the problem type (tokenize_task)."
            )
        windows, offsets, contexts = columns["window"], columns["offset_mapping"], columns["context"]
        if len(windows) != len(logits):
            raise ValueError(f"{len(logits)} rows of logits for an evaluation set of {len(windows)} rows (windows).")
        starts = [f for f, w in enumerate(windows) if w == 0] + [len(windows)]  # each example's first window
        references = columns.get("answer_texts")
        predictions = []
        for first, stop in zip(starts[:-1], starts[1:]):
            rows = range(first, stop)
            spans = best_spans(
                [logits[f, :, 0] for f in rows],
                [logits[f, :, 1] for f in rows],
                [offsets[f] for f in rows],
                contexts[first],
                self.max_answer_length,
                self.n_best,
            )
            predictions.append(spans[0]["answer"] if spans else "")
        return predictions, [references[f] for f in starts[:-1]] if references is not None else None

    def compute_metrics(self, spec, logits, labels, run_metric, dataset=None, **context):
        """SQuAD's exact match and F1 (metric names `exact_match`, `f1`) of the decoded answers; any other metric gets
        the answer texts and each example's first reference. Needs `dataset`, the task's tokenised evaluation set
        (its `window`, `offset_mapping`, `context` and `answer_texts` columns)."""
        if dataset is None:
            raise ValueError(
                f"Task {spec.name!r} is extractive QA: its metrics map token spans back to the context, so they need "
                "the tokenised evaluation set (`dataset=`)."
            )
        predictions, references = self.decode(logits, dataset)
        if references is None:
            raise ValueError(
                f"Task {spec.name!r}: the evaluation set has no answers (`answer_texts`) to score against."
            )
        scores = squad_scores(predictions, references)
        texts = {"predictions": predictions, "references": [r[0] if r else "" for r in references]}
        return {name: scores[name] if name in scores else run_metric(name, texts, None) for name in spec.metrics}

    def baseline_logits(self, spec, source_labels, num_rows):
        return None  # a trivial answer reads the context (e.g. its first words), which logits cannot say

    # ------------------------------------------------------------------ MT-Uncertainty
    def entropy(self, spec, logits, attention_mask):
        """Mean of the start and the end distribution's entropy over each row's tokens; H' = log(tokens)."""
        scores = logits.float()  # (rows, seq, 2)
        if attention_mask is not None:
            scores = scores.masked_fill(attention_mask[..., None] == 0, float("-inf"))
        per_row = torch.special.entr(torch.softmax(scores, dim=1)).sum(1).mean(-1)  # (rows,)
        return per_row, math.log(logits.shape[1])

    # ------------------------------------------------------------------ pipelines, cards
    def pipeline_encode(self, spec, item, tokenizer, max_length, **extra):
        features = tokenize_qa(
            tokenizer,
            [item["question"]],
            [item["context"]],
            max_length,
            self.stride(max_length),
            max_question_length=self.question_length(max_length),
        )
        keys = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in features]
        return [
            {**{k: features[k][f] for k in keys}, "offset_mapping": features["offset_mapping"][f]}
            for f in range(len(features["input_ids"]))
        ]

    def pipeline_result(self, spec, logits, features, item, top_k=None):
        """`{"task", "answer", "score", "start", "end"}` (`top_k`: `{"task", "top": [...]}` with the k best spans):
        `score` is the span's probability, start and end softmax-normalised over the window's context tokens."""
        logits = logits.float().cpu()  # (windows, seq, 2)
        normalised = []
        for f, row in enumerate(features):
            offsets = row["offset_mapping"]
            n = min(len(offsets), logits.shape[1])
            context_token = torch.tensor([o is not None and o[1] > o[0] for o in offsets[:n]])
            scores = logits[f, :n].masked_fill(~context_token[:, None], float("-inf"))
            normalised.append(torch.log_softmax(scores, dim=0).numpy())  # (n, 2): log p(start), log p(end)
        spans = best_spans(
            [s[:, 0] for s in normalised],
            [s[:, 1] for s in normalised],
            [row["offset_mapping"] for row in features],
            item["context"],
            self.max_answer_length,
            max(self.n_best, top_k or 1),
        )
        found = [
            {"answer": s["answer"], "score": math.exp(s["score"]), "start": s["start"], "end": s["end"]} for s in spans
        ]
        if top_k is None:
            return {"task": spec.name, **(found[0] if found else {"answer": "", "score": 0.0, "start": 0, "end": 0})}
        return {"task": spec.name, "top": found[:top_k]}

    def card_labels(self, spec, label_range=None):
        return "answer span of the context"


register_problem_type(ExtractiveQA())
