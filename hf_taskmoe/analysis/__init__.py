"""Analysis utilities: parameter accounting, routing statistics, gate distributions and plots."""

from .gates import GateDistribution, gate_distribution
from .parameters import ParameterReport, parameter_report
from .routing import RoutingStatistics, normalised_entropy

__all__ = [
    "GateDistribution",
    "gate_distribution",
    "ParameterReport",
    "parameter_report",
    "RoutingStatistics",
    "normalised_entropy",
]
