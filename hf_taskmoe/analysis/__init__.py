"""Analysis utilities: parameter accounting, routing statistics, gate distributions and plots, covariance similarity,
task-level routes (heatmaps, correlation with task features, ARG). Each name loads its module on first use."""

from .. import _lazy_exports

_EXPORTS: dict[str, tuple[str, ...]] = {
    ".covariance": ("covariance_similarity", "first_layer_inputs", "task_covariance_similarity"),
    ".gates": ("GateDistribution", "gate_distribution"),
    ".parameters": ("ParameterReport", "parameter_report"),
    ".routing": ("RoutingStatistics", "layer_label", "normalised_entropy", "routed_layers"),
    ".task_routing": (
        "average_relative_gain",
        "plot_route_feature_correlation",
        "plot_task_routing",
        "route_feature_correlation",
    ),
}

__all__ = [name for names in _EXPORTS.values() for name in names]

__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)


def _pyplot():
    """matplotlib's pyplot on the Agg backend: the plots are written to files, no display is needed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save_figure(fig, path):
    """Lay `fig` out, write it to `path` (PNG, 120 dpi) and close it; returns `path`."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
