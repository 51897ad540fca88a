"""What a metric's name says about it (is its best value its lowest or its highest) and how smoothed a curve of
so many points is drawn by default: one rule for the live dashboards and the comparison of runs."""

from __future__ import annotations

# the words of a metric name that say its best value is its lowest, or its highest
LOWER_IS_BETTER = ("loss", "error", "mse", "mae", "nll", "perplexity")
HIGHER_IS_BETTER = ("acc", "score", "f1", "auc", "reward", "precision", "recall", "iou", "bleu")
SPARSE_POINTS = 30  # curves of fewer points are drawn raw: an evaluation logged once an epoch is not lagged
MOST_SMOOTHING = 0.9


def lower_is_better(metric: str) -> bool:
    """Lower is better, and its curve spans decades (a log-y view): loss, error, mse, nll, perplexity, ..."""
    return any(word in metric.lower() for word in LOWER_IS_BETTER)


def higher_is_better(metric: str) -> bool:
    """A metric whose best value is its maximum (accuracy, score, f1, auc, reward, precision, ...)."""
    return not lower_is_better(metric) and any(word in metric.lower() for word in HIGHER_IS_BETTER)


def smoothing_default(points_per_curve: float) -> float:
    """The smoothing weight that suits curves of this many points: 0 (raw) under 30 points; more, growing with
    the density, an average over about 3 % of the curve (``1 - 30 / n``), at most 0.9.

    >>> [smoothing_default(n) for n in (10, 60, 100, 1000)]
    [0.0, 0.5, 0.7, 0.9]
    """
    if not points_per_curve or points_per_curve < SPARSE_POINTS:
        return 0.0
    return round(min(MOST_SMOOTHING, 1.0 - SPARSE_POINTS / points_per_curve), 2)
