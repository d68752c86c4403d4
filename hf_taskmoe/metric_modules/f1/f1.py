"""F1 score: binary (positive class 1), macro (mean over classes) or micro (global counts; multi-label rows
are flattened, config `multilabel`).

Shipped with hf_taskmoe as a local `evaluate` module so that it loads offline:
`evaluate.load(<path of this folder>)`.
"""

import datasets
import evaluate
import numpy as np


class F1(evaluate.Metric):
    def _info(self):
        value = datasets.Sequence(datasets.Value("int64")) if self.config_name == "multilabel" else datasets.Value("int64")
        return evaluate.MetricInfo(
            description=__doc__, citation="", inputs_description="predictions, references: class indices or multi-hot rows",
            features=datasets.Features({"predictions": value, "references": value}),
        )

    @staticmethod
    def _binary(pred, ref, positive):
        tp = np.sum((pred == positive) & (ref == positive))
        fp = np.sum((pred == positive) & (ref != positive))
        fn = np.sum((pred != positive) & (ref == positive))
        return float(2 * tp / (2 * tp + fp + fn)) if (tp + fp + fn) else 0.0

    def _compute(self, predictions, references, average="binary", pos_label=1):
        pred, ref = np.asarray(predictions), np.asarray(references)
        if pred.ndim == 2:  # multi-label: every (row, label) decision counts
            pred, ref = pred.reshape(-1), ref.reshape(-1)
            if average == "macro":
                raise ValueError("macro F1 needs class indices, not multi-hot rows")
            return {"f1": self._binary(pred, ref, 1)}
        if average == "binary":
            return {"f1": self._binary(pred, ref, pos_label)}
        classes = np.union1d(pred, ref)
        if average == "macro":
            return {"f1": float(np.mean([self._binary(pred, ref, c) for c in classes]))}
        if average == "micro":  # single-label micro F1 equals accuracy
            return {"f1": float(np.mean(pred == ref))}
        raise ValueError(f"average must be 'binary', 'macro' or 'micro', got {average!r}")
