"""Knee detection on synthetic curves with known answers."""

from __future__ import annotations

import math

import pytest

from knee_profiler.knee import knee, knee_max_curvature, knees

PCTS = [10.0 * k for k in range(1, 11)]


def inverse(a: float = 100.0) -> dict[float, float]:
    """Perfect scaling: latency a/p, so the knee is where a/p <= (1+eps) a/100."""
    return {p: a / p for p in PCTS}


def hinge(knee_at: float = 40.0) -> dict[float, float]:
    """Linear fall to `knee_at`, flat after: both rules must find the hinge."""
    return {p: 25.0 + max(0.0, knee_at - p) * 2.5 for p in PCTS}


def test_inverse_curve_knee_matches_closed_form() -> None:
    assert knee(inverse(), 0.10) == 100.0  # 90% gives 1.111x > 1.1x
    assert knee(inverse(), 0.20) == 90.0  # 1.111x <= 1.2x, 80% gives 1.25x
    assert knee(inverse(), 0.25) == 80.0  # 1.25x exactly on the threshold counts
    for eps in (0.05, 0.3, 0.5, 1.0):
        expected = min(p for p in PCTS if 100.0 / p <= 1 + eps + 1e-12)
        assert knee(inverse(), eps) == expected


def test_hinge_curve_both_rules_agree() -> None:
    for at in (30.0, 40.0, 70.0):
        assert knee(hinge(at), 0.10) == at
        assert knee_max_curvature(hinge(at)) == at


def test_flat_curve_knee_is_smallest_percent() -> None:
    flat = {p: 5.0 for p in PCTS}
    assert knee(flat) == 10.0
    assert knee_max_curvature(flat) is None


def test_epsilon_zero_needs_the_full_speed() -> None:
    curve = {50.0: 10.0, 80.0: 8.0, 100.0: 8.0}
    assert knee(curve, 0.0) == 80.0


def test_knee_is_relative_to_largest_measured_percent() -> None:
    partial = {p: 100.0 / p for p in (10.0, 20.0, 30.0, 40.0)}  # sweep stopped at 40%
    assert knee(partial, 0.10) == 40.0
    assert knee(partial, 0.40) == 30.0  # 3.33 <= 1.4 x 2.5


def test_noisy_curve_takes_first_point_under_threshold() -> None:
    noisy = {25.0: 20.0, 50.0: 10.5, 75.0: 11.5, 100.0: 10.0}
    assert knee(noisy, 0.10) == 50.0


def test_unsorted_keys_and_int_percentages() -> None:
    curve = {100: 1.0, 10: 10.0, 50: 1.05}
    assert knee(curve) == 50.0


@pytest.mark.parametrize(
    "curve",
    [{}, {50.0: 0.0, 100.0: 1.0}, {50.0: math.nan, 100.0: 1.0}, {0.0: 1.0, 100.0: 1.0}],
)
def test_bad_curves_are_rejected(curve: dict[float, float]) -> None:
    with pytest.raises(ValueError):
        knee(curve)


def test_negative_epsilon_is_rejected() -> None:
    with pytest.raises(ValueError, match="epsilon"):
        knee(inverse(), -0.1)


def test_max_curvature_needs_three_points() -> None:
    assert knee_max_curvature({50.0: 2.0, 100.0: 1.0}) is None


def test_max_curvature_uneven_spacing() -> None:
    # Hinge at 30 on an uneven grid: the only interior point with a bend.
    curve = {10.0: 50.0, 20.0: 37.5, 30.0: 25.0, 60.0: 25.0, 100.0: 25.0}
    assert knee_max_curvature(curve) == 30.0


def test_knees_per_batch_skips_empty_curves() -> None:
    got = knees({1: hinge(30.0), 8: hinge(70.0), 16: {}}, 0.10)
    assert got == {1: 30.0, 8: 70.0}
