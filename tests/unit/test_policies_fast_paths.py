"""DStackPolicy's fast paths (cycle skipping, slots sorted by start) give exactly the answers
of the plain scans they replace, on random schedules and random queue histories."""

from __future__ import annotations

import math
import random

import pytest

from dstack.config import PolicyName
from dstack.latency import LinearLatency
from dstack.policies import DStackPolicy, ModelParams, QueueView, make_policy
from dstack.slices import MpsSlices
from dstack.types import ModelPlan, Plan, Schedule, Slot, SolverStatus


def random_policy(rng: random.Random) -> DStackPolicy:
    n = rng.randint(2, 6)
    names = [f"m{i}" for i in range(n)]
    cycle = rng.choice([10.0, 25.0, 36.1, 100.0 / 3])
    slots = []
    for i, m in enumerate(names):
        for _ in range(rng.choice([1, 1, 2])):
            start = rng.choice([0.0, cycle / 3, rng.uniform(0, cycle * 0.99)])
            # Some slots straddle the cycle boundary; percents sum near 100 on purpose.
            dur = rng.uniform(0.05, 0.7) * cycle
            pct = rng.choice([10.0, 20.0, 100.0 / 3, 40.0, 50.0, 60.0, 100.0])
            units = tuple(sorted(rng.sample(range(8), rng.randint(0, 3)))) if i % 2 else ()
            slots.append(Slot(m, start, dur, pct, units))
    plan = Plan(tuple(ModelPlan(m, rng.randint(1, 8), 50.0, 5.0, 100.0, 100.0, 100.0, 200.0)
                      for m in names), cycle, 100.0, SolverStatus.OPTIMAL)
    params = {m: ModelParams(m, 8, 0.002, 0.2) for m in names}
    pol = make_policy(PolicyName.DSTACK, params, MpsSlices(), plan=plan,
                      schedule=Schedule(cycle, tuple(slots)), origin=rng.uniform(-1, 5))
    assert isinstance(pol, DStackPolicy)
    for m in names:
        pol.latency[m] = LinearLatency(rng.uniform(0.0005, 0.004), rng.uniform(0, 0.002))
    return pol


def plain_next_start(pol: DStackPolicy, now: float, k_now: int) -> float | None:
    """The definition `DStackPolicy._next_start` implements: the earliest slot start after
    `now` in cycles k_now and k_now + 1, by a plain scan."""
    best: float | None = None
    for k in (k_now, k_now + 1):
        base = pol.origin + k * pol.cycle_s
        for s in pol._slots:
            start = base + s.start_s
            if start > now + 1e-9 and (best is None or start < best):
                best = start
    return best


def plain_fits(pol: DStackPolicy, model: str, t0: float, t1: float, k_now: int) -> bool:
    """The definition `DStackPolicy._fits` implements, as a plain scan of every slot of
    every cycle the run may touch."""
    mine = pol._own[model]
    load = mine.percent
    k_hi = math.floor((t1 - pol.origin) / pol.cycle_s) + 1
    for k in range(k_now - 1, k_hi + 1):
        base = pol.origin + k * pol.cycle_s
        for s in pol._slots:
            start = base + s.start_s
            if start + s.dur_s <= t0 + 1e-9 or start >= t1 - 1e-9 or s.model == model:
                continue
            state = pol._occ.get((s.index, k))
            if state == "forfeited" and start <= t0 + 1e-9:
                continue
            if state == "used" and s.model not in pol._busy:
                continue
            load += s.percent
            if mine.units & s.units:
                return False
    for b in pol._busy.values():
        if b.model != model and b.until > t0:
            load += b.percent
            if mine.units & b.units:
                return False
    return load <= 100.0 + 1e-9


@pytest.mark.parametrize("seed", range(12))
def test_fast_fits_and_next_start_equal_the_plain_scans(seed: int) -> None:
    rng = random.Random(seed)
    pol = random_policy(rng)
    names = list(pol.models)
    now = pol.origin + rng.uniform(0, 3)
    running: dict[str, float] = {}
    items = dict.fromkeys(names, 0)
    checked = 0
    for _ in range(150):
        now += rng.choice([0.0, 1e-9, 0.0004, 0.001, 0.004, pol.cycle_s])
        for m in [m for m, end in running.items() if end <= now]:
            del running[m]
            pol.on_batch_done(m, 1, 0.001, now)
        for m in names:
            if rng.random() < 0.3:
                items[m] += rng.randint(1, 4)
        views = {m: QueueView(m, items[m], now if items[m] else None,
                              now + 0.2 if items[m] else None, m in running) for m in names}
        k_now = math.floor((now - pol.origin) / pol.cycle_s)
        # Both before deciding (the state the decision sees) and at slot boundaries.
        for t in (now, plain_next_start(pol, now, k_now) or now):
            k = math.floor((t - pol.origin) / pol.cycle_s)
            assert pol._next_start(t, k) == plain_next_start(pol, t, k)
            for m in names:
                for dur in (1e-4, 0.003, rng.uniform(0, 2.5) * pol.cycle_s):
                    assert pol._fits(m, t, t + dur, k) == plain_fits(pol, m, t, t + dur, k)
                    checked += 1
        for launch in pol.decide(now, views).launches:
            running[launch.model] = now + rng.uniform(0.0005, 0.005)
            items[launch.model] = max(0, items[launch.model] - launch.max_items)
    assert checked > 1000
