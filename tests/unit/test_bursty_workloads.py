"""Shaped workloads (`replay:` a timestamp trace's burst shape, `bursty` on/off) and the
re-planner's rules for bursty rates: noise-aware drift, and lulls that do not shrink a plan."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dstack.runtime.adapt import RateTracker, ReplanTrigger
from dstack.simulate.workload import WorkloadError, generate, trace_counts


def _cv(times: np.ndarray, window_s: float, duration_s: float) -> float:
    n = int(duration_s // window_s)
    c = np.bincount((times // window_s).astype(int), minlength=n)[:n]
    return float(c.std() / c.mean())


def test_bursty_arrivals_have_the_statistics_of_a_bursty_trace() -> None:
    duration = 3600.0
    cv1, cv10, cv60, mean = [], [], [], []
    for seed in range(6):
        t = generate("bursty", {"m": 50.0}, duration, seed).times
        cv1.append(_cv(t, 1, duration))
        cv10.append(_cv(t, 10, duration))
        cv60.append(_cv(t, 60, duration))
        mean.append(t.size / duration / 50.0)
    assert 1.4 <= np.median(cv1) <= 3.0  # Poisson at 50/s would give 0.14
    assert 1.2 <= np.median(cv10) <= 2.4
    assert 0.6 <= np.median(cv60) <= 1.6
    assert np.median(mean) == pytest.approx(1.0, rel=0.3)
    # `mean=run`: each model's count is its rate times the duration, bursts and all
    short = generate("bursty:compress=10:mean=run", {"a": 100.0, "b": 30.0}, 20.0, 4)
    assert short.count("a") == pytest.approx(2000, rel=0.1)
    assert short.count("b") == pytest.approx(600, rel=0.15)


def test_models_burst_independently_and_compress_shortens_the_bursts() -> None:
    a = generate("bursty", {"x": 50.0, "y": 50.0}, 600.0, 1)
    cx = np.bincount(a.times_of("x").astype(int), minlength=600)[:600]
    cy = np.bincount(a.times_of("y").astype(int), minlength=600)[:600]
    assert abs(np.corrcoef(cx, cy)[0, 1]) < 0.3
    slow = generate("bursty", {"x": 50.0}, 600.0, 1).times
    fast = generate("bursty:compress=10", {"x": 50.0}, 600.0, 1).times
    # the same shape 10x faster: 10-s windows of the compressed run average many bursts
    assert _cv(fast, 10, 600) < _cv(slow, 10, 600)


def test_replay_follows_the_trace_shape_from_each_models_own_offset(tmp_path: Path) -> None:
    # 100 s of trace: quiet (1 a second) except a burst of 40 a second in seconds 50-59
    stamps = [f"2023-11-16 18:00:{s // 1:02.0f}.{k:03d}" for s in range(60) for k in
              range(40 if s >= 50 else 1)]
    stamps += [f"2023-11-16 18:01:{s:02d}.000" for s in range(40)]
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,tokens\n" + "\n".join(f"{s},7" for s in stamps) + "\n")
    counts = trace_counts(trace)
    assert counts.size == 100 and counts[55] == 40 and counts[10] == 1
    bare = tmp_path / "bare.csv"  # no header: the first date is a request too
    bare.write_text("\n".join(stamps) + "\n")
    assert trace_counts(bare).tolist() == counts.tolist()
    arr = generate(f"replay:{trace}", {"a": 10.0, "b": 10.0}, 100.0, 3)
    for m in ("a", "b"):
        c = np.bincount(arr.times_of(m).astype(int), minlength=100)[:100]
        hot = int(np.argmax(np.convolve(c, np.ones(10), "valid")))  # where its burst is
        assert c[hot:hot + 10].sum() > 0.6 * c.sum()  # the trace's burst holds most of it
    # the whole trace, once round from any offset: the mean rate is the model's rate
    assert arr.count("a") == pytest.approx(1000, rel=0.15)
    # superposing offsets smooths the shape
    smooth = generate(f"replay:{trace}:superpose=8", {"a": 10.0}, 100.0, 3).times
    assert _cv(smooth, 5, 100) < _cv(arr.times_of("a"), 5, 100)


def test_shaped_specs_say_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="no such trace"):
        generate("replay:/nonexistent.csv", {"x": 1.0}, 1.0, 1)
    with pytest.raises(WorkloadError, match="not an option of bursty"):
        generate("bursty:superpose=2", {"x": 1.0}, 1.0, 1)
    with pytest.raises(WorkloadError, match="compress must be positive"):
        generate("bursty:compress=0", {"x": 1.0}, 1.0, 1)
    bad = tmp_path / "bad.csv"
    bad.write_text("when\nyesterday\nlater\n")
    with pytest.raises(WorkloadError, match="neither seconds nor dates"):
        generate(f"replay:{bad}", {"x": 1.0}, 1.0, 1)


def test_a_swinging_rate_does_not_drift_where_a_steady_one_does() -> None:
    steady, swinging = RateTracker(["m"]), RateTracker(["m"])
    rng = np.random.default_rng(0)
    for k in range(30):  # 100/s, Poisson; and on/off between 0 and 200/s
        steady.record("m", float(k), int(rng.poisson(100)))
        swinging.record("m", float(k), 200 if k % 4 < 2 else 0)
        steady.sample(k + 1.0), swinging.sample(k + 1.0)
    trig = ReplanTrigger({"m": 70.0})  # planned 70/s: both averages are ~100/s
    assert trig.drifting({"m": 100.0}, steady.noise()) == ["m"]
    assert trig.drifting({"m": 100.0}, swinging.noise()) == []


def test_a_lull_of_one_model_keeps_its_planned_rate_while_another_rises() -> None:
    trig = ReplanTrigger({"a": 100.0, "b": 100.0}, hold_s=0.0, down_hold_s=60.0)
    rates = {"a": 5.0, "b": 300.0}  # a in a lull, b in a burst
    assert not trig.should_replan(1.0, rates)  # confirm: two samples
    assert trig.should_replan(2.0, rates)
    assert trig.plan_rates(2.0, rates) == {"a": 100.0, "b": 300.0}
    trig.planned(2.0, trig.plan_rates(2.0, rates))
    # a lull alone re-plans only once it has lasted down_hold_s, then for its rate
    low = {"a": 5.0, "b": 300.0}
    assert not any(trig.should_replan(t, low) for t in (3.0, 30.0, 60.0))
    assert trig.should_replan(62.0, low) or trig.should_replan(63.0, low)
    assert trig.plan_rates(63.0, low) == low
