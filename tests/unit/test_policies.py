"""Policies on a fake clock: what runs when, batch sizes, idle reuse, re-plan hysteresis."""

from __future__ import annotations

import pytest

from dstack.common.config import PolicyName
from dstack.common.slices import CpuSlices, MpsSlices
from dstack.policies.baselines import TakeNow, WaitUntil, batch_window, gslice_adapt
from dstack.policies.contract import Launch, ModelParams, QueueView
from dstack.policies.latency import LinearLatency
from dstack.policies.registry import make_policy
from dstack.runtime.adapt import RateTracker, ReplanTrigger

A, B = "a", "b"


def params(slo_s: float = 0.1, cap: int = 8, delay_s: float = 0.005) -> dict[str, ModelParams]:
    return {m: ModelParams(m, cap, delay_s, slo_s) for m in (A, B)}


def q(model: str, items: int = 0, arrival: float | None = None, running: bool = False,
      slo_s: float = 0.1) -> QueueView:
    if items and arrival is None:
        arrival = 0.0
    return QueueView(model, items, arrival, None if arrival is None else arrival + slo_s, running)


# --------------------------------------------------------------------------- batch window


def test_batch_window_takes_a_full_batch_at_once() -> None:
    assert batch_window(0.0, 9, 0.0, None, 8, 0.01) == TakeNow(8)


def test_batch_window_waits_from_the_first_request_then_takes_what_is_there() -> None:
    assert batch_window(0.002, 3, 0.0, None, 8, 0.01) == WaitUntil(0.01)
    assert batch_window(0.010, 3, 0.0, None, 8, 0.01) == TakeNow(3)


def test_batch_window_stops_waiting_when_the_deadline_needs_it() -> None:
    lat = LinearLatency(0.030, 0.005)  # a batch of 8 takes 70 ms
    # head arrived at 0 with a 100 ms SLO: must start by 30 ms although delay is 50 ms
    w = batch_window(0.0, 1, 0.0, 0.1, 8, 0.05, lat)
    assert isinstance(w, WaitUntil) and w.t == pytest.approx(0.03)
    assert batch_window(0.031, 1, 0.0, 0.1, 8, 0.05, lat) == TakeNow(1)


# --------------------------------------------------------------------------- shared / temporal


def test_shared_runs_every_model_concurrently_and_never_a_busy_one() -> None:
    pol = make_policy(PolicyName.SHARED, params(), CpuSlices((0, 1)))
    d = pol.decide(0.01, {A: q(A, 3), B: q(B, 2)})
    assert set(d.launches) == {Launch(A, 3), Launch(B, 2)}
    d = pol.decide(0.01, {A: q(A, 3, running=True), B: q(B, 0)})
    assert d.launches == ()
    assert all(s.units == (0, 1) for s in pol.slices().values())


def test_temporal_runs_one_model_at_a_time_in_round_robin() -> None:
    pol = make_policy(PolicyName.TEMPORAL, params(), CpuSlices((0, 1)),
                      temporal_batch={A: 4, B: 2})
    both = {A: q(A, 10), B: q(B, 10)}
    first = pol.decide(0.0, both).launches
    assert first == (Launch(A, 4),)  # its best batch under the SLO, not everything queued
    # while A runs nothing else starts
    assert pol.decide(0.001, {A: q(A, 6, running=True), B: q(B, 10)}).launches == ()
    assert pol.decide(0.002, {A: q(A, 6), B: q(B, 10)}).launches == (Launch(B, 2),)
    assert pol.decide(0.003, {A: q(A, 6), B: q(B, 8)}).launches == (Launch(A, 4),)


# --------------------------------------------------------------------------- spatial


def test_spatial_gives_disjoint_knee_slices_that_fit() -> None:
    pol = make_policy(PolicyName.SPATIAL, params(), CpuSlices((0, 1, 2, 3)),
                      knees={A: 50.0, B: 75.0})
    s = pol.slices()
    assert len(s[A].units) + len(s[B].units) == 4  # 2 + 3 cores scaled down to fit 4
    assert not set(s[A].units) & set(s[B].units)
    mps = make_policy(PolicyName.SPATIAL, params(), MpsSlices(), knees={A: 60.0, B: 90.0})
    assert sum(x.percent for x in mps.slices().values()) == pytest.approx(100.0)


def test_gslice_rule_shrinks_over_the_target_and_grows_well_under_it() -> None:
    # target 50 ms; 8 items took 80 ms (10 ms each): 30 ms over -> 3 fewer
    assert gslice_adapt(8, 8, 0.080, 0.050, 32) == 5
    # 4 items took 20 ms: 30 ms headroom -> 6 more
    assert gslice_adapt(4, 4, 0.020, 0.050, 32) == 10
    # within 10% of the target: unchanged
    assert gslice_adapt(5, 5, 0.047, 0.050, 32) == 5
    assert gslice_adapt(8, 8, 1.0, 0.050, 32) == 1
    assert gslice_adapt(30, 30, 0.001, 0.050, 32) == 32


def test_spatial_batch_adapts_after_each_batch() -> None:
    pol = make_policy(PolicyName.SPATIAL, params(slo_s=0.1, cap=32), CpuSlices((0, 1)),
                      knees={A: 50.0, B: 50.0})
    assert pol.decide(0.1, {A: q(A, 5), B: q(B)}).launches == (Launch(A, 1),)
    pol.on_batch_done(A, 1, 0.005, 0.11)  # 5 ms per item, target 50 ms
    assert pol.decide(0.2, {A: q(A, 20, arrival=0.2), B: q(B)}).launches == (Launch(A, 10),)


# --------------------------------------------------------------------------- dstack
# The lane policy and its planner: tests/unit/test_lanes.py.


# --------------------------------------------------------------------------- adapting


def test_rate_tracker_measures_a_moving_rate() -> None:
    rt = RateTracker([A], alpha=0.5)
    rt.sample(0.0)
    for i in range(10):
        rt.record(A, 0.1 * i)
    assert rt.sample(1.0)[A] == pytest.approx(10.0)
    assert rt.sample(2.0)[A] == pytest.approx(5.0)  # no arrivals: halfway to 0


def test_replan_needs_persistent_drift_and_respects_the_hold_time() -> None:
    t = ReplanTrigger({A: 10.0}, drift=0.25, hold_s=5.0, confirm=2)
    assert not t.should_replan(0.0, {A: 10.0})
    assert not t.should_replan(1.0, {A: 20.0})  # one drifting sample is a burst
    assert not t.should_replan(2.0, {A: 10.5})  # back within 25%: streak reset
    assert not t.should_replan(3.0, {A: 20.0})
    assert not t.should_replan(4.0, {A: 20.0})  # confirmed, but inside the hold time
    assert t.should_replan(5.0, {A: 20.0})
    t.planned(5.0, {A: 20.0})
    # the new plan is the reference now: the same rate no longer drifts
    assert not t.should_replan(11.0, {A: 21.0})
    assert not t.should_replan(12.0, {A: 22.0})


def test_a_lull_replans_only_after_down_hold_but_a_rise_at_once() -> None:
    t = ReplanTrigger({A: 10.0, B: 10.0}, drift=0.25, hold_s=5.0, confirm=2, down_hold_s=30.0)
    t.should_replan(0.0, {A: 10.0, B: 10.0})
    # Both fall: confirmed and past the hold time at 10 s, but a lull shorter than 30 s
    # keeps the plan (and its slices) for the next burst.
    assert not any(t.should_replan(s, {A: 2.0, B: 10.0}) for s in range(6, 35))
    assert t.should_replan(36.0, {A: 2.0, B: 10.0})  # low since 6 s: 30 s of it
    t.planned(36.0, {A: 2.0, B: 10.0})
    # A lull that ends starts the count again.
    assert not t.should_replan(42.0, {A: 2.0, B: 5.0})
    assert not t.should_replan(43.0, {A: 2.0, B: 10.0})
    assert not t.should_replan(44.0, {A: 2.0, B: 5.0})
    assert not t.should_replan(45.0, {A: 2.0, B: 10.0})
    # A rise re-plans as soon as it is confirmed, even while another model's rate is low.
    assert not t.should_replan(46.0, {A: 4.0, B: 5.0})
    assert t.should_replan(47.0, {A: 4.0, B: 5.0})


def test_the_latency_estimate_learns_the_fixed_and_the_per_item_cost_apart() -> None:
    """Seeded through the origin (a warm-up that put all the time in the per-item cost:
    5.5 ms an item), fed mostly batches of 1 and some of 2 to 8 that really take 3.3 ms +
    2.9 ms an item, with +-15% noise: the line must come to pass through both ends. An
    error split by the two costs' shares of the prediction kept the seed's proportions and
    overestimated a batch of 8 by half while it matched a batch of 1."""
    import random

    rng = random.Random(3)
    est = LinearLatency(1e-6, 0.0055)
    for _ in range(400):
        n = rng.choice([1, 1, 1, 1, 1, 2, 3, 4, 6, 8])
        est.observe(n, (0.0033 + 0.0029 * n) * rng.uniform(0.85, 1.15))
    for n in (1, 4, 8):
        assert est.estimate_s(n) == pytest.approx(0.0033 + 0.0029 * n, rel=0.1)
    assert est.refusal_s(8) <= est.estimate_s(8) < est.high_s(8) < 1.3 * est.estimate_s(8)


def test_a_lone_stall_at_a_batch_size_seldom_seen_moves_the_estimate_little() -> None:
    """Batches of 1 and 2 (7 and 10 ms) for a while, then one batch of 8 stalls for 500 ms
    (a busy machine): the estimate of a batch of 8 may rise by the usual step for an
    outlier, not jump toward the stall (a fit step in a direction the recent batches do not
    measure would move it most of the way, and refuse on one outlier)."""
    est = LinearLatency(0.004, 0.003)
    for i in range(300):
        est.observe(1 + i % 2, 0.007 if i % 2 == 0 else 0.010)
    before = {n: est.estimate_s(n) for n in (1, 8)}
    est.observe(8, 0.5)
    for n in (1, 8):
        assert est.estimate_s(n) <= 1.11 * before[n]
    est.observe(8, 0.5)  # twice in a row: believed, the line moves most of the way
    assert est.estimate_s(8) > 3 * before[8]


def test_a_line_wrong_at_one_size_comes_back_instead_of_running_away() -> None:
    """Seen under overload: a line through 4 ms for a batch of 1 and 14 ms for 2 (a
    negative fixed cost), fed batches of 1 and 2 that take 9 and 11 ms, alternating. Each
    batch of 1 was far off but never twice running, so it only scaled the line, which made
    it steeper; the fit at 2 held it there. The line ran away (0 ms for 1, 86 ms for 2
    after 80 batches) and admission then refused every request that would wait behind
    another. Far off twice at one size with only another size between is believed."""
    est = LinearLatency(-0.006, 0.010, observations=10, p_kk=1.0, p_kt=0.0, p_tt=1.0)
    for _ in range(40):
        est.observe(1, 0.009)
        est.observe(2, 0.011)
    assert 0.006 < est.estimate_s(1) <= 0.012
    assert 0.008 < est.estimate_s(2) < 0.014
    assert est.t_s < 0.010  # flatter than it started, as the batches are


def test_lone_stalls_at_one_size_do_not_run_a_sloped_line_away() -> None:
    """Seen on a server under 8 closed-loop gRPC clients: a line with a negative fixed cost
    (0.3 ms for 1, 4.5 ms for 8), then thousands of batches of 1 of about 0.5 ms, every
    seventh a lone 3x stall. Each stall scaled both costs up and the fit took the rise
    back through the fixed cost alone, so the line grew steeper without end: a batch of 8
    read 112 s and the server refused every request that would wait behind another (and
    the compiled code then divided by zero). The line must stay where the batches put it."""
    import random

    rng = random.Random(5)
    est = LinearLatency(-0.0003, 0.0006, observations=10, p_kk=1.0, p_kt=0.0, p_tt=1.0)
    start8 = est.estimate_s(8)
    for i in range(3000):
        est.observe(1, 0.0005 * rng.uniform(0.8, 1.2) * (3 if i % 7 == 3 else 1))
    assert 0.0004 < est.estimate_s(1) < 0.0008
    assert est.estimate_s(8) < 1.5 * start8


def test_probes_do_not_run_a_sloped_line_away() -> None:
    """A probe (the estimate was refusing) moves the line through its batch at once. On a
    line with a negative fixed cost, probes 1.5x slow each followed by batches back at
    0.5 ms must leave it where the batches put it: scaling both costs for each probe read
    a batch of 8 at 15 s after 20 such rounds, and ever higher after more."""
    est = LinearLatency(-0.0003, 0.0006, observations=10, p_kk=1.0, p_kt=0.0, p_tt=1.0)
    start8 = est.estimate_s(8)
    for _ in range(100):
        probe = 1.5 * est.estimate_s(1)
        est.remeasure(1, probe)
        assert est.estimate_s(1) == pytest.approx(probe)  # through the probe at once
        for _ in range(20):
            est.observe(1, 0.0005)
    assert 0.0004 < est.estimate_s(1) < 0.0007
    assert est.estimate_s(8) < 1.5 * start8


def test_a_stall_at_one_size_between_others_is_still_a_lone_outlier() -> None:
    """Two stalls at a batch of 8, five batches of other sizes apart: neither is believed
    (only far-off batches at most FAR_WITHIN apart are)."""
    est = LinearLatency(0.004, 0.003)
    for i in range(300):
        est.observe(1 + i % 2, 0.007 if i % 2 == 0 else 0.010)
    before = est.estimate_s(8)
    est.observe(8, 0.5)
    for i in range(5):
        est.observe(1 + i % 2, 0.007 if i % 2 == 0 else 0.010)
    est.observe(8, 0.5)
    assert est.estimate_s(8) <= 1.25 * before
