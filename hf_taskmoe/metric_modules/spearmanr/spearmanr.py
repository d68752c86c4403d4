"""Spearman rank correlation (Pearson correlation of the ranks, ties get their average rank).

Shipped with hf_taskmoe as a local `evaluate` module so that it loads offline:
`evaluate.load(<path of this folder>)`.
"""

import datasets
import evaluate
import numpy as np


def _ranks(values):
    order = np.argsort(values, kind="mergesort")
    ranks = np.empty(len(values), dtype=np.float64)
    sorted_values = values[order]
    start = 0
    for end in range(1, len(values) + 1):
        if end == len(values) or sorted_values[end] != sorted_values[start]:
            ranks[order[start:end]] = (start + end - 1) / 2.0 + 1.0  # average rank of a tie group
            start = end
    return ranks


class Spearmanr(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__, citation="", inputs_description="predictions, references: floats",
            features=datasets.Features({"predictions": datasets.Value("float64"), "references": datasets.Value("float64")}),
        )

    def _compute(self, predictions, references):
        x = _ranks(np.asarray(predictions, dtype=np.float64))
        y = _ranks(np.asarray(references, dtype=np.float64))
        x, y = x - x.mean(), y - y.mean()
        denominator = np.sqrt((x @ x) * (y @ y))
        return {"spearmanr": float(x @ y / denominator) if denominator else 0.0}
