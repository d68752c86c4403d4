"""Matthews correlation coefficient (multi-class form of Gorodkin 2004; binary MCC for two classes).

Shipped with hf_taskmoe as a local `evaluate` module so that it loads offline:
`evaluate.load(<path of this folder>)`.
"""

import datasets
import evaluate
import numpy as np


class MatthewsCorrelation(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__, citation="", inputs_description="predictions, references: class indices",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references):
        pred, ref = np.asarray(predictions), np.asarray(references)
        classes = np.union1d(pred, ref)
        index = {c: i for i, c in enumerate(classes)}
        confusion = np.zeros((len(classes), len(classes)), dtype=np.float64)
        for r, p in zip(ref, pred):
            confusion[index[r], index[p]] += 1
        t, p = confusion.sum(1), confusion.sum(0)  # true / predicted counts per class
        c, s = np.trace(confusion), confusion.sum()
        denominator = np.sqrt((s**2 - p @ p) * (s**2 - t @ t))
        return {"matthews_correlation": float((c * s - t @ p) / denominator) if denominator else 0.0}
