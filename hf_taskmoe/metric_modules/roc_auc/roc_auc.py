"""ROC AUC of binary scores (MMoE census-income tables): the probability that a random positive row
scores higher than a random negative one (scikit-learn's `roc_auc_score`).

Shipped with hf_taskmoe as a local `evaluate` module so that it loads offline:
`evaluate.load(<path of this folder>)`.
"""

import datasets
import evaluate
from sklearn.metrics import roc_auc_score


class RocAuc(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__, citation="", inputs_description="prediction_scores: score of the positive class; references: 0/1",
            features=datasets.Features({"prediction_scores": datasets.Value("float64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, prediction_scores, references):
        return {"roc_auc": float(roc_auc_score(references, prediction_scores))}
