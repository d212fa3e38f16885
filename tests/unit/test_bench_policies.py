"""The policy suite (bench/bench_policies.py): what it draws, and that its runner gives a row
for every policy."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from bench import bench_policies as bp
from dstack.simulate import generate, latency_ms


@pytest.fixture(scope="module")
def suite() -> list[bp.Mix]:
    return bp.draw_suite(1, 40)


def test_the_same_seed_draws_the_same_suite_and_another_seed_another(
        suite: list[bp.Mix]) -> None:
    assert bp.draw_suite(1, 40) == suite
    assert bp.draw_suite(2, 40) != suite
    # A mix does not depend on how many are drawn.
    assert bp.draw_mix(1, 17) == suite[17]
    assert bp.draw_suite(1, 5) == suite[:5]


def test_mixes_respect_the_stated_ranges(suite: list[bp.Mix]) -> None:
    for mix in suite:
        profiles = bp.load_profiles(bp.PROFILES / mix.device_dir)
        assert 2 <= len(mix.models) <= 6
        assert len({m.name for m in mix.models}) == len(mix.models)
        assert bp.LOAD_RANGE[0] <= mix.load <= bp.LOAD_RANGE[1]
        assert sum(m.rate_rps * m.cost_s for m in mix.models) == pytest.approx(mix.load)
        assert sum(m.share for m in mix.models) == pytest.approx(1.0)
        for m in mix.models:
            prof = profiles[m.zoo]  # an alias names a model of the mix's directory
            assert bp.SLO_FACTOR_RANGE[0] <= m.slo_factor <= bp.SLO_FACTOR_RANGE[1]
            assert m.slo_ms == pytest.approx(
                m.slo_factor * latency_ms(prof, 1, max(prof.percentages)))
            assert m.max_batch in bp.MAX_BATCHES
            assert 0 < m.cost_s < float("inf")
            assert m.base_rate_rps > 0
        # Distinct models first: an alias only when the directory has run out of them.
        zoos = [m.zoo for m in mix.models]
        assert len(set(zoos)) == min(len(zoos), len(profiles))
        assert 0 < mix.duration_s <= bp.DEFAULT_DURATION_S
    devices = Counter(m.device_dir for m in suite)
    assert set(devices) == set(bp.DEVICES)
    assert all(abs(c - len(suite) / 3) <= 1 for c in devices.values())
    kinds = Counter(m.arrival_kind for m in suite)
    assert kinds["poisson"] >= 10
    assert sum(c for k, c in kinds.items() if k != "poisson") >= 10
    assert {k for k in kinds if k != "poisson"} <= {"burst", "burst1", "ramp"}
    assert any(m.zoo != m.name for mix in suite for m in mix.models)  # aliases occur


def test_the_configured_rate_is_the_mean_rate_of_the_arrivals(suite: list[bp.Mix]) -> None:
    shaped = [m for m in suite if m.arrival_kind != "poisson"]
    for mix in sorted(shaped, key=lambda m: sum(x.rate_rps for x in m.models))[:6]:
        arr = generate(mix.workload, {m.name: m.base_rate_rps for m in mix.models},
                       mix.duration_s, mix.seed)
        for m in mix.models:
            expected = m.rate_rps * mix.duration_s
            assert abs(arr.count(m.name) - expected) <= 5 * np.sqrt(expected) + 5, mix.id


def test_one_tiny_mix_gives_a_row_for_every_policy() -> None:
    mix = bp.draw_mix(1, 22, duration_s=2.0)  # reference V100, two models, ~900 requests
    assert mix.device_dir == "reference-v100" and mix.duration_s == 2.0
    r = bp.run_mix(mix)
    assert set(r.goodput_rps) == set(bp.POLICIES) == set(r.ratio_ideal)
    assert r.requests > 0 and r.ideal_rps > 0
    for p in bp.POLICIES:
        assert r.ratio_ideal[p] <= 1.0 + 1e-9
        if p in r.errors:
            assert r.goodput_rps[p] == 0.0
    assert r.best_baseline in bp.BASELINES
    assert "m22" in bp.format_row(r)


def test_a_policy_that_crashes_counts_as_goodput_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    real = bp.simulate

    def flaky(cfg, profiles, arrivals, policies, duration_s):  # noqa: ANN001, ANN202
        if str(policies[0]) == "dstack":
            raise RuntimeError("boom")
        return real(cfg, profiles, arrivals, policies, duration_s)

    monkeypatch.setattr(bp, "simulate", flaky)
    r = bp.run_mix(bp.draw_mix(1, 22, duration_s=1.0))
    assert r.goodput_rps["dstack"] == 0.0 and "boom" in r.errors["dstack"]
    assert r.vs_best == 0.0 or max(r.goodput_rps[p] for p in bp.BASELINES) == 0.0
    assert bp.served_nothing(r) == any(r.goodput_rps[p] > 0 for p in bp.BASELINES)


def _result(mix: bp.Mix, goodput: dict[str, float], ideal: float = 100.0) -> bp.MixResult:
    base = {p: goodput[p] for p in bp.BASELINES}
    best = max(base, key=lambda p: base[p])
    vs = goodput["dstack"] / base[best] if base[best] > 0 else 1.0
    return bp.MixResult(mix, ideal, 1000, goodput, {p: g / ideal for p, g in goodput.items()},
                        {}, vs, best, 0.1)


def test_the_summary_counts_and_the_ratio_is_one_when_every_baseline_serves_nothing(
        suite: list[bp.Mix]) -> None:
    rows = [
        _result(suite[0], {"temporal": 50, "shared": 60, "spatial": 80, "dstack": 90}),
        _result(suite[1], {"temporal": 50, "shared": 60, "spatial": 80, "dstack": 40}),
        _result(suite[2], {"temporal": 0, "shared": 0, "spatial": 0, "dstack": 0}),
        _result(suite[3], {"temporal": 10, "shared": 0, "spatial": 0, "dstack": 0}),
    ]
    assert rows[2].vs_best == 1.0
    fig, lines = bp.summarise(rows, None, 1.0)
    assert fig["dstack_ge_target_vs_best"] == 2
    assert fig["worst_mix"] == suite[3].id and fig["worst_vs_best"] == 0.0
    assert fig["dstack_served_nothing"] == [suite[3].id]
    assert fig["every_policy_served_nothing"] == [suite[2].id]
    assert fig["targets_met"]["vs_best_every_mix"] is False
    assert any("[MISSED]" in line for line in lines)
