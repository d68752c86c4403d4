"""Exact match of generated and reference texts after stripping whitespace (optionally ignoring case).

Shipped with hf_taskmoe as a local `evaluate` module so that it loads offline:
`evaluate.load(<path of this folder>)`.
"""

import datasets
import evaluate
import numpy as np


class ExactMatch(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__, citation="", inputs_description="predictions, references: strings",
            features=datasets.Features({"predictions": datasets.Value("string"), "references": datasets.Value("string")}),
        )

    def _compute(self, predictions, references, ignore_case=False):
        def norm(text):
            text = " ".join(str(text).split())
            return text.lower() if ignore_case else text

        matches = [norm(p) == norm(r) for p, r in zip(predictions, references)]
        return {"exact_match": float(np.mean(matches)) if matches else 0.0}
