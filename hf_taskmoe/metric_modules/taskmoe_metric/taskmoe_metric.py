"""Any metric registered in `hf_taskmoe.metrics` (`METRIC_REGISTRY`) as an `evaluate` module; `config_name` names it.

Shipped with hf_taskmoe as a local `evaluate` module so that it loads offline:
`evaluate.load(<path of this folder>, "f1_macro")`, or `hf_taskmoe.metrics.load_metric("f1_macro")`.
"""

import datasets
import evaluate

from hf_taskmoe.metrics import METRIC_INPUTS, get_metric


def _feature(kind):
    """`"int64"` -> a value, `["int64"]` -> a sequence of values (the notation of `METRIC_INPUTS`)."""
    return datasets.Sequence(datasets.Value(kind[0])) if isinstance(kind, list) else datasets.Value(kind)


class TaskMoEMetric(evaluate.Metric):
    def _info(self):
        metric = get_metric(self.config_name)
        options = [datasets.Features({column: _feature(kind) for column, kind in columns.items()})
                   for columns in METRIC_INPUTS[metric.inputs]]
        return evaluate.MetricInfo(
            description=metric.description, citation="", inputs_description=metric.inputs,
            features=options[0] if len(options) == 1 else options,
        )

    def _compute(self, references, predictions=None, prediction_scores=None, **kwargs):
        scores = predictions if predictions is not None else prediction_scores
        return {self.config_name: get_metric(self.config_name)(scores, references, **kwargs)}
