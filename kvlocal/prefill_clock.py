"""How long a prefill has left: the cost of a token grows with its depth, so the ETA is not linear.

A dense prefill's ubatch costs its weight products (the same at every depth) plus its attention over every
earlier cell (growing with the depth). The time spent after n tokens is therefore close to a·n + b·n², and a
remaining-tokens / average-rate estimate promises a long document's end far too early. `PrefillClock` fits a and
b (both ≥ 0, least squares) to the times this prefill has taken so far and extrapolates; until it has seen
enough ubatches it falls back to the average rate.
"""

from __future__ import annotations

import math
import time

MIN_POINTS = 3  # ubatches timed before the depth term is trusted


def fit_cost(points: list[tuple[int, float]]) -> tuple[float, float]:
    """The (a, b) ≥ 0 of elapsed ≈ a·n + b·n² that fit `points` (done, elapsed) best in the least-squares sense."""
    s2 = sum(n * n for n, _ in points)
    s3 = sum(n ** 3 for n, _ in points)
    s4 = sum(n ** 4 for n, _ in points)
    t1 = sum(n * e for n, e in points)
    t2 = sum(n * n * e for n, e in points)
    det = s2 * s4 - s3 * s3
    if s2 <= 0:
        return 0.0, 0.0
    if det > 0:
        a = (t1 * s4 - t2 * s3) / det
        b = (s2 * t2 - s3 * t1) / det
        if a >= 0 and b >= 0:
            return a, b
    # a constraint is active: the best fit with one of the two terms alone
    linear = (max(t1 / s2, 0.0), 0.0)
    quadratic = (0.0, max(t2 / s4, 0.0)) if s4 > 0 else linear
    return min(linear, quadratic, key=lambda ab: _residual(points, *ab))


def _residual(points: list[tuple[int, float]], a: float, b: float) -> float:
    return sum((a * n + b * n * n - e) ** 2 for n, e in points)


def remaining_seconds(points: list[tuple[int, float]], total: int) -> float:
    """Seconds left until `total` tokens, from the (done, elapsed) points seen so far (inf when none tell)."""
    if not points:
        return math.inf
    done, elapsed = points[-1]
    if done >= total:
        return 0.0
    if done <= 0 or elapsed <= 0:
        return math.inf
    if len(points) < MIN_POINTS:
        return (total - done) * elapsed / done
    a, b = fit_cost(points)
    predicted = (a * total + b * total * total) - (a * done + b * done * done)
    if predicted <= 0:
        return (total - done) * elapsed / done
    return predicted


class PrefillClock:
    """Times one prefill: `mark(done)` after each ubatch, then `eta(total)`."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.points: list[tuple[int, float]] = []

    def mark(self, done: int) -> float:
        elapsed = time.perf_counter() - self.start
        self.points.append((done, elapsed))
        return elapsed

    def eta(self, total: int) -> float:
        return remaining_seconds(self.points, total)
