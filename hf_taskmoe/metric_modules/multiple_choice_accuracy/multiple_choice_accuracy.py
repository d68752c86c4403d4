"""Multiple-choice accuracy: the choice with the highest score must be the reference choice.

Shipped with hf_taskmoe as a local `evaluate` module so that it loads offline:
`evaluate.load(<path of this folder>)`.
"""

import datasets
import evaluate
import numpy as np


class MultipleChoiceAccuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__, citation="", inputs_description="predictions: one score per choice; references: index of the right choice",
            features=datasets.Features(
                {"predictions": datasets.Sequence(datasets.Value("float64")), "references": datasets.Value("int64")}
            ),
        )

    def _compute(self, predictions, references):
        chosen = np.array([int(np.argmax(scores)) for scores in predictions])
        return {"multiple_choice_accuracy": float(np.mean(chosen == np.asarray(references))) if len(chosen) else 0.0}
