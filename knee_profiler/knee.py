"""Knee detection on a latency-vs-slice curve: pure functions over plain dicts.

A curve maps slice percent -> latency (ms) for one model and one batch size. The knee is
the smallest slice that is "nearly as fast" as the whole device (ARCHITECTURE.md); the
max-curvature rule is kept beside it so the two can be compared on the same data.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

DEFAULT_EPSILON = 0.10


def _checked(curve: Mapping[float, float]) -> list[tuple[float, float]]:
    if not curve:
        raise ValueError("empty curve: no percentages measured")
    pts = sorted((float(p), float(lat)) for p, lat in curve.items())
    for p, lat in pts:
        if not (p > 0 and math.isfinite(lat) and lat > 0):
            raise ValueError(f"bad curve point {p}% -> {lat} ms (need percent > 0, latency > 0)")
    return pts


def knee(curve: Mapping[float, float], epsilon: float = DEFAULT_EPSILON) -> float:
    """The smallest percent whose latency is <= (1 + epsilon) x the latency at the largest
    percent of the curve (100% on a full sweep).

    Taken literally: on a noisy, non-monotone curve the first percent under the threshold
    wins even if a larger one lies above it. Raises ValueError on an empty curve, a
    non-positive latency or a negative epsilon.
    """
    if epsilon < 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon}")
    pts = _checked(curve)
    threshold = (1.0 + epsilon) * pts[-1][1]
    for p, lat in pts:
        if lat <= threshold * (1 + 1e-12):
            return p
    return pts[-1][0]  # unreachable: the last point always passes


def knee_max_curvature(curve: Mapping[float, float]) -> float | None:
    """The interior percent of maximum curvature, on axes normalised to [0, 1].

    Both axes are scaled by their ranges (so ms and % weigh alike), then the curvature
    |y''| / (1 + y'^2)^1.5 is estimated at every interior point with the three-point
    formulas for uneven spacing. Returns None when the curve has fewer than three points
    (no interior point) or is flat (all latencies equal). Ties go to the smaller percent.
    """
    pts = _checked(curve)
    if len(pts) < 3:
        return None
    xs = [p for p, _ in pts]
    ys = [lat for _, lat in pts]
    x_span = xs[-1] - xs[0]
    y_span = max(ys) - min(ys)
    if y_span <= 0:
        return None
    x = [(v - xs[0]) / x_span for v in xs]
    y = [(v - min(ys)) / y_span for v in ys]
    best: tuple[float, float] | None = None
    for i in range(1, len(x) - 1):
        h0, h1 = x[i] - x[i - 1], x[i + 1] - x[i]
        d1 = (
            -h1 / (h0 * (h0 + h1)) * y[i - 1]
            + (h1 - h0) / (h0 * h1) * y[i]
            + h0 / (h1 * (h0 + h1)) * y[i + 1]
        )
        d2 = 2 * (y[i - 1] / (h0 * (h0 + h1)) - y[i] / (h0 * h1) + y[i + 1] / (h1 * (h0 + h1)))
        k = abs(d2) / (1 + d1 * d1) ** 1.5
        if best is None or k > best[1] + 1e-12:
            best = (xs[i], k)
    assert best is not None
    return best[0]


def knees(
    curves: Mapping[int, Mapping[float, float]], epsilon: float = DEFAULT_EPSILON
) -> dict[int, float]:
    """`knee` for every batch size of {batch: curve}; batch sizes with an empty curve are
    left out."""
    return {b: knee(c, epsilon) for b, c in sorted(curves.items()) if c}
