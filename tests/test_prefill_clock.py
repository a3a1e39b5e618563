"""The prefill ETA: a token's cost grows with its depth, and the clock's prediction follows."""

import math

import pytest

from kvlocal.prefill_clock import MIN_POINTS, fit_cost, remaining_seconds
from kvlocal.session import PrefillProgress


def timeline(a: float, b: float, ubatch: int, n: int) -> list[tuple[int, float]]:
    return [(k * ubatch, a * k * ubatch + b * (k * ubatch) ** 2) for k in range(1, n + 1)]


def test_a_cost_growing_with_depth_is_recovered_and_extrapolated_exactly():
    points = timeline(0.01, 2e-6, 512, 6)
    a, b = fit_cost(points)
    assert a == pytest.approx(0.01) and b == pytest.approx(2e-6)
    total = 32 * 512
    truth = (0.01 * total + 2e-6 * total ** 2) - points[-1][1]
    assert remaining_seconds(points, total) == pytest.approx(truth)
    # the average rate promises the end several times too early for this document
    linear = (total - points[-1][0]) * points[-1][1] / points[-1][0]
    assert linear < truth / 3


def test_a_flat_cost_gives_the_linear_estimate():
    points = timeline(0.02, 0.0, 256, 5)
    assert remaining_seconds(points, 256 * 20) == pytest.approx(0.02 * 256 * 15)


def test_few_points_fall_back_to_the_average_rate():
    points = timeline(0.01, 1e-5, 512, MIN_POINTS - 1)
    done, elapsed = points[-1]
    assert remaining_seconds(points, 10 * 512) == pytest.approx((10 * 512 - done) * elapsed / done)


def test_noisy_timings_never_give_a_negative_term():
    # a slow first ubatch (warm-up) then a flat rate: the fit keeps both terms non-negative
    points = [(512, 3.0), (1024, 3.5), (1536, 4.0), (2048, 4.5)]
    a, b = fit_cost(points)
    assert a >= 0 and b >= 0
    assert 0 < remaining_seconds(points, 4096) < math.inf


def test_edges():
    assert remaining_seconds([], 100) == math.inf
    assert remaining_seconds([(100, 1.0)], 100) == 0.0
    assert remaining_seconds([(0, 0.0)], 100) == math.inf


def test_progress_reports_the_clock_when_it_has_one():
    assert PrefillProgress(500, 1000, 10.0).eta == pytest.approx(10.0)
    assert PrefillProgress(500, 1000, 10.0, "dense", 42.0).eta == 42.0
