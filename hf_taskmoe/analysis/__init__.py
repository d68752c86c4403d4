"""Analysis utilities: parameter accounting, routing statistics and plots."""

from .parameters import ParameterReport, parameter_report
from .routing import RoutingStatistics, normalised_entropy

__all__ = ["ParameterReport", "parameter_report", "RoutingStatistics", "normalised_entropy"]
