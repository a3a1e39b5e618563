"""Confidence intervals of the scores the evaluations report."""

from __future__ import annotations

import math

Z95 = 1.959964  # the standard normal quantile of a two-sided 95 % interval


def wilson_interval(accuracy: float, n: int, z: float = Z95) -> list[float]:
    """The Wilson score interval of a success fraction `accuracy` seen over `n` trials (exact for a
    mean of 0/1 scores; a fractional mean counts as that many successes)."""
    shrink = 1 + z * z / n
    center = (accuracy + z * z / (2 * n)) / shrink
    half = z / shrink * math.sqrt(accuracy * (1 - accuracy) / n + z * z / (4 * n * n))
    # at 0 or 1 an end is exactly 0 or 1 (the formula gets there only up to rounding)
    return [0.0 if accuracy <= 0 else center - half, 1.0 if accuracy >= 1 else center + half]
