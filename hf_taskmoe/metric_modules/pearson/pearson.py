"""Pearson correlation between predicted and reference scores.

Shipped with hf_taskmoe as a local `evaluate` module so that it loads offline:
`evaluate.load(<path of this folder>)`.
"""

import datasets
import evaluate
import numpy as np


class Pearson(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__, citation="", inputs_description="predictions, references: floats",
            features=datasets.Features({"predictions": datasets.Value("float64"), "references": datasets.Value("float64")}),
        )

    def _compute(self, predictions, references):
        x, y = np.asarray(predictions, dtype=np.float64), np.asarray(references, dtype=np.float64)
        x, y = x - x.mean(), y - y.mean()
        denominator = np.sqrt((x @ x) * (y @ y))
        return {"pearson": float(x @ y / denominator) if denominator else 0.0}
