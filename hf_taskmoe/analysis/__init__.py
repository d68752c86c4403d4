"""Analysis utilities: parameter accounting, routing statistics, gate distributions and plots, covariance similarity,
task-level routes (heatmaps, correlation with task features, ARG)."""

from .covariance import covariance_similarity, first_layer_inputs, task_covariance_similarity

from .gates import GateDistribution, gate_distribution
from .parameters import ParameterReport, parameter_report
from .routing import RoutingStatistics, layer_label, normalised_entropy, routed_layers
from .task_routing import (
    average_relative_gain,
    plot_route_feature_correlation,
    plot_task_routing,
    route_feature_correlation,
)

__all__ = [
    "covariance_similarity",
    "first_layer_inputs",
    "task_covariance_similarity",
    "GateDistribution",
    "gate_distribution",
    "ParameterReport",
    "parameter_report",
    "RoutingStatistics",
    "layer_label",
    "normalised_entropy",
    "routed_layers",
    "average_relative_gain",
    "plot_route_feature_correlation",
    "plot_task_routing",
    "route_feature_correlation",
]
