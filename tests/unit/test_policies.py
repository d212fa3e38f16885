"""Policies on a fake clock: what runs when, batch sizes, idle reuse, re-plan hysteresis."""

from __future__ import annotations

import random

import pytest

from dstack.common.config import PolicyName
from dstack.common.slices import CpuSlices, MpsSlices
from dstack.common.types import ModelPlan, Plan, Schedule, Slot, SolverStatus
from dstack.policies.baselines import TakeNow, WaitUntil, batch_window, gslice_adapt
from dstack.policies.contract import Launch, ModelParams, QueueView
from dstack.policies.dstack_policy import DStackPolicy
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


def two_shelf(percent_a: float = 100, percent_b: float = 100) -> tuple[Plan, Schedule]:
    """A runs at 0-10 ms, B at 10-20 ms, cycle 25 ms."""
    plan = Plan(
        (ModelPlan(A, 4, percent_a, 10.0, 160.0, 100.0, 100.0, 100.0, offset_ms=0.0),
         ModelPlan(B, 2, percent_b, 10.0, 80.0, 50.0, 50.0, 100.0, offset_ms=10.0)),
        25.0, 150.0, SolverStatus.OPTIMAL,
    )
    sched = Schedule(25.0, (Slot(A, 0.0, 10.0, percent_a), Slot(B, 10.0, 10.0, percent_b)))
    return plan, sched


def dstack_policy(plan: Plan, sched: Schedule, lat_s: float = 0.008) -> DStackPolicy:
    pol = make_policy(PolicyName.DSTACK, params(), MpsSlices(), plan=plan, schedule=sched,
                      origin=0.0)
    assert isinstance(pol, DStackPolicy)
    for m in (A, B):
        pol.latency[m] = LinearLatency(lat_s, 0.0)
    return pol


def test_dstack_runs_each_model_in_its_slot_with_its_planned_batch() -> None:
    pol = dstack_policy(*two_shelf())
    d = pol.decide(0.0, {A: q(A, 10), B: q(B, 10)})
    assert d.launches == (Launch(A, 4),)  # B's slot has not begun and A holds 100%
    assert d.wake_at == pytest.approx(0.010)
    d = pol.decide(0.010, {A: q(A, 6), B: q(B, 10)})
    assert d.launches == (Launch(B, 2),)
    d = pol.decide(0.025, {A: q(A, 6), B: q(B, 8, running=True)})
    assert d.launches == (Launch(A, 4),)  # next cycle


@pytest.mark.parametrize("origin", [-7.3, 0.0, 4.2])
def test_dstack_wakes_at_the_next_slot_start_wherever_the_clock_began(origin: float) -> None:
    # The dispatcher's clock (time.monotonic) may put the origin anywhere, below 0 too.
    pol = dstack_policy(*two_shelf())
    pol.origin = origin
    idle = {A: q(A), B: q(B)}
    assert pol.decide(origin + 0.004, idle).wake_at == pytest.approx(origin + 0.010)
    assert pol.decide(origin + 0.010, idle).wake_at == pytest.approx(origin + 0.025)
    assert pol.decide(origin + 0.030, idle).wake_at == pytest.approx(origin + 0.035)


def test_dstack_reuses_a_forfeited_slot_but_never_its_neighbours_busy_one() -> None:
    pol = dstack_policy(*two_shelf())
    # A has nothing at its slot's start: the slot is forfeited, B may use it.
    d = pol.decide(0.0, {A: q(A), B: q(B, 3)})
    assert d.launches == (Launch(B, 2, reuse=True),)
    # At 5 ms B's batch (8 ms) runs on into its own slot at 10 ms: that is its own
    # capacity, and the occurrence counts as used: no second launch at 10 ms while the
    # batch runs. At 13 ms an 8 ms batch ends past its slot (20 ms) but before A's next
    # one (25 ms): idle time, so it goes as reuse; at 20.5 ms it would run into A's slot.
    pol2 = dstack_policy(*two_shelf())
    pol2.decide(0.0, {A: q(A), B: q(B)})
    assert pol2.decide(0.005, {A: q(A), B: q(B, 3, arrival=0.005)}).launches == (
        Launch(B, 2, reuse=True),)
    assert pol2.decide(0.010, {A: q(A), B: q(B, 1, 0.006, running=True)}).launches == ()
    assert pol2.decide(0.013, {A: q(A), B: q(B, 1, 0.006)}).launches == (
        Launch(B, 1, reuse=True),)
    assert pol2.decide(0.0125 + 0.008, {A: q(A), B: q(B, 1, 0.014)}).launches == ()
    # A's slot in use: B may not squeeze in beside a 100% slot
    pol3 = dstack_policy(*two_shelf())
    assert pol3.decide(0.0, {A: q(A, 1), B: q(B, 3)}).launches == (Launch(A, 1),)


def test_dstack_reuse_fits_beside_a_running_slot_when_there_is_room() -> None:
    pol = dstack_policy(*two_shelf(percent_a=40, percent_b=60))
    pol.decide(0.0, {A: q(A), B: q(B)})  # A forfeits, B idle
    # B, 60%, during A's (forfeited) slot and before its own: fits
    d = pol.decide(0.0005, {A: q(A), B: q(B, 1, arrival=0.0005)})
    assert d.launches == (Launch(B, 1, reuse=True),)


def test_dstack_first_look_at_a_slot_launches_even_when_the_dispatcher_is_late() -> None:
    pol = dstack_policy(*two_shelf())
    pol.decide(0.0, {A: q(A), B: q(B)})
    # B's slot began at 10 ms; the dispatcher only gets to it at 13 ms: its planned batch
    # still goes, although by the estimate it ends 3 ms after the slot.
    assert pol.decide(0.013, {A: q(A), B: q(B, 5)}).launches == (Launch(B, 2),)


def test_dstack_runs_again_in_its_own_slot_while_the_batch_still_fits() -> None:
    plan = Plan((ModelPlan(A, 8, 100, 20.0, 400.0, 100.0, 100.0, 100.0),
                 ModelPlan(B, 8, 100, 20.0, 400.0, 100.0, 100.0, 100.0, offset_ms=20.0)),
                40.0, 200.0, SolverStatus.OPTIMAL)
    sched = Schedule(40.0, (Slot(A, 0.0, 20.0, 100.0), Slot(B, 20.0, 20.0, 100.0)))
    pol = dstack_policy(plan, sched)  # every batch estimated at 8 ms
    # nothing queued at A's slot start: forfeited, but A's own work may still use it
    assert pol.decide(0.0, {A: q(A), B: q(B)}).launches == ()
    assert pol.decide(0.002, {A: q(A, 3, 0.002), B: q(B)}).launches == (Launch(A, 3),)
    assert pol.decide(0.011, {A: q(A, 2, 0.004), B: q(B)}).launches == (Launch(A, 2),)
    # at 13 ms an 8 ms batch would spill past the slot's end at 20 ms: wait for next cycle
    d = pol.decide(0.013, {A: q(A, 2, 0.012), B: q(B)})
    assert d.launches == () and d.wake_at == pytest.approx(0.020)


def _check_capacity(pol: DStackPolicy, seed: int) -> None:
    """Drive the policy with random arrivals on a fake clock; at every instant the slices
    of the batches running must sum to <= 100% and use disjoint units."""
    rng = random.Random(seed)
    running: dict[str, float] = {}  # model -> end time
    items = {A: 0, B: 0}
    now = 0.0
    slot_of = {s.model: s for s in pol.the_schedule.slots}
    for _ in range(400):
        now += rng.choice([0.0005, 0.001, 0.003])
        for m in list(running):
            if running[m] <= now:
                del running[m]
                pol.on_batch_done(m, 1, 0.008, now)
        for m in items:
            if rng.random() < 0.3:
                items[m] += rng.randint(1, 3)
        views = {m: q(m, items[m], arrival=now if items[m] else None, running=m in running)
                 for m in items}
        for launch in pol.decide(now, views).launches:
            assert launch.model not in running
            running[launch.model] = now + 0.008 * rng.uniform(0.5, 1.0)  # never slower
            items[launch.model] = max(0, items[launch.model] - launch.max_items)
        load = sum(slot_of[m].percent for m in running)
        assert load <= 100.0 + 1e-9, (now, running)
        units = [u for m in running for u in slot_of[m].units]
        assert len(units) == len(set(units))


@pytest.mark.parametrize("seed", range(5))
def test_dstack_idle_reuse_never_exceeds_the_device(seed: int) -> None:
    pa = random.Random(seed).choice([40.0, 60.0, 100.0])
    _check_capacity(dstack_policy(*two_shelf(pa, 100 - pa if pa < 100 else 100)), seed)


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
