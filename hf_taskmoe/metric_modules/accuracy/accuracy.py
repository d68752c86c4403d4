"""Accuracy: share of predictions equal to the reference.

Shipped with hf_taskmoe as a local `evaluate` module so that it loads offline:
`evaluate.load(<path of this folder>)`.
"""

import datasets
import evaluate
import numpy as np


class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__, citation="", inputs_description="predictions, references: class indices",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references):
        predictions, references = np.asarray(predictions), np.asarray(references)
        return {"accuracy": float(np.mean(predictions == references)) if len(references) else 0.0}
