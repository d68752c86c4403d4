"""Analysis utilities: parameter accounting, routing statistics, gate distributions and plots, covariance similarity."""

from .covariance import covariance_similarity, first_layer_inputs, task_covariance_similarity

from .gates import GateDistribution, gate_distribution
from .parameters import ParameterReport, parameter_report
from .routing import RoutingStatistics, normalised_entropy

__all__ = [
    "covariance_similarity",
    "first_layer_inputs",
    "task_covariance_similarity",
    "GateDistribution",
    "gate_distribution",
    "ParameterReport",
    "parameter_report",
    "RoutingStatistics",
    "normalised_entropy",
]
