"""ROUGE-1, ROUGE-2 and ROUGE-L F-measures (Lin 2004) of generated against reference texts, averaged over examples.

Tokens are lower-cased runs of letters and digits (as `rouge_score`'s default tokenizer, without stemming).
Shipped with hf_taskmoe as a local `evaluate` module so that it loads offline:
`evaluate.load(<path of this folder>)`.
"""

import re
from collections import Counter

import datasets
import evaluate
import numpy as np

_TOKEN = re.compile(r"[a-z0-9]+")


def _tokens(text):
    return _TOKEN.findall(str(text).lower())


def _f_measure(overlap, predicted, reference):
    if overlap == 0 or predicted == 0 or reference == 0:
        return 0.0
    precision, recall = overlap / predicted, overlap / reference
    return 2 * precision * recall / (precision + recall)


def _ngram_f(pred, ref, n):
    p = Counter(tuple(pred[i : i + n]) for i in range(len(pred) - n + 1))
    r = Counter(tuple(ref[i : i + n]) for i in range(len(ref) - n + 1))
    return _f_measure(sum((p & r).values()), sum(p.values()), sum(r.values()))


def _lcs(a, b):
    row = [0] * (len(b) + 1)
    for x in a:
        previous = 0
        for j, y in enumerate(b, 1):
            current = row[j]
            row[j] = previous + 1 if x == y else max(row[j], row[j - 1])
            previous = current
    return row[-1]


class Rouge(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__, citation="", inputs_description="predictions, references: strings",
            features=datasets.Features({"predictions": datasets.Value("string"), "references": datasets.Value("string")}),
        )

    def _compute(self, predictions, references):
        scores = {"rouge1": [], "rouge2": [], "rougeL": []}
        for prediction, reference in zip(predictions, references):
            pred, ref = _tokens(prediction), _tokens(reference)
            scores["rouge1"].append(_ngram_f(pred, ref, 1))
            scores["rouge2"].append(_ngram_f(pred, ref, 2))
            scores["rougeL"].append(_f_measure(_lcs(pred, ref), len(pred), len(ref)))
        return {k: float(np.mean(v)) if v else 0.0 for k, v in scores.items()}
