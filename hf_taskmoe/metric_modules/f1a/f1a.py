"""F1a (MultiRC): binary F1 over all answer options of the dataset, not grouped by question.

Shipped with hf_taskmoe as a local `evaluate` module so that it loads offline:
`evaluate.load(<path of this folder>)`.
"""

import datasets
import evaluate
import numpy as np


class F1a(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__, citation="", inputs_description="predictions, references: 0/1 per answer option",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references):
        pred, ref = np.asarray(predictions), np.asarray(references)
        tp = np.sum((pred == 1) & (ref == 1))
        precision = tp / max(np.sum(pred == 1), 1)
        recall = tp / max(np.sum(ref == 1), 1)
        return {"f1a": float(2 * precision * recall / (precision + recall)) if precision + recall else 0.0}
