"""How `make bench` turns alternating windows into issue 2's single-model figure."""

from __future__ import annotations

import numpy as np
import pytest

from bench.bench_mix import ceiling_ratio


def test_the_ceiling_is_the_best_batch_sizes_mean_over_its_own_windows() -> None:
    # b2 and b4 take turns beside the server; b4 is faster in process.
    batch = [2, 4] * 6
    ceiling = [40.0, 44.0] * 6
    goodput = [42.0] * 12
    fig = ceiling_ratio(goodput, ceiling, batch)
    assert fig["per_batch"] == {2: 40.0, 4: 44.0}
    assert fig["best_batch"] == 4
    assert fig["ceiling_items_s"] == 44.0
    assert fig["ratio_to_ceiling"] == pytest.approx(42 / 44)


def test_the_interval_holds_the_figure_and_widens_with_the_noise() -> None:
    rng = np.random.default_rng(1)
    batch = [2, 4, 8] * 12

    def width(noise: float) -> tuple[float, list[float]]:
        ceiling = list(40 * (1 + noise * rng.standard_normal(36)))
        goodput = list(38 * (1 + noise * rng.standard_normal(36)))
        fig = ceiling_ratio(goodput, ceiling, batch)
        lo, hi = fig["ci95"]
        assert lo < fig["ratio_to_ceiling"] < hi
        return hi - lo, fig["ci95"]

    quiet, _ = width(0.01)
    noisy, (lo, hi) = width(0.08)
    assert noisy > 3 * quiet
    assert lo < 0.95 < hi  # 95% true; 8% noise per window leaves it undecided


def test_rounds_must_line_up() -> None:
    with pytest.raises(ValueError, match="one entry per round"):
        ceiling_ratio([1.0, 2.0], [1.0], [4, 4])
    with pytest.raises(ValueError, match="one entry per round"):
        ceiling_ratio([], [], [])
