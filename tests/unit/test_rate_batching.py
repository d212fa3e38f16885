"""`batching: rate` (Zhang et al.): b* from the measured arrival rate, its caps, the policy's
decisions on a fake clock, and the simulator on a load that steps up and down."""

from __future__ import annotations

import math

import pytest

from dstack.common.config import Batching, PolicyName, parse_config
from dstack.common.slices import CpuSlices
from dstack.policies.baselines import TakeNow, WaitUntil, rate_window
from dstack.policies.contract import Launch, ModelParams, QueueView
from dstack.policies.latency import LinearLatency
from dstack.policies.rate_batching import ArrivalRate, RateBatch, rate_batch
from dstack.policies.registry import make_policy
from dstack.simulate import generate, simulate
from tests.unit._simulate_fixtures import config, make_profile

LAT = LinearLatency(0.010, 0.001)  # T(b) = 10 ms + 1 ms per item

# --------------------------------------------------------------------------- b*


def test_b_star_is_zhangs_formula_rounded_up() -> None:
    # c = 500/s: b* = k*c / (1 - t*c) = 0.01 * 500 / (1 - 0.5) = 10
    rb = rate_batch(LAT, 500.0, slo_s=1.0, max_batch=64)
    assert rb is not None and rb.target == 10
    assert rb.fill_s == pytest.approx(10 / 500)
    # c = 300/s: 3 / 0.7 = 4.29 -> 5, the smallest batch that keeps up
    rb = rate_batch(LAT, 300.0, slo_s=1.0, max_batch=64)
    assert rb is not None and rb.target == 5
    assert 5 / (LAT.estimate_s(5)) >= 300 > 4 / LAT.estimate_s(4)
    # a light load: one item at a time
    rb = rate_batch(LAT, 20.0, slo_s=1.0, max_batch=64)
    assert rb is not None and rb.target == 1


def test_b_star_is_capped_by_half_the_slo_and_by_max_batch() -> None:
    # SLO 40 ms: a batch may take 20 ms (wait to fill + run = 2 T(b)): b <= 10
    rb = rate_batch(LAT, 800.0, slo_s=0.040, max_batch=64)  # b* = 8 / 0.2 = 40
    assert rb is not None and rb.target == 10
    rb = rate_batch(LAT, 800.0, slo_s=1.0, max_batch=8)
    assert rb is not None and rb.target == 8
    # t*c >= 1: no batch size keeps up, wait for the largest the caps allow
    rb = rate_batch(LAT, 1000.0, slo_s=0.1, max_batch=64)
    assert rb is not None and rb.target == 40
    # even one item takes over half the SLO: wait for nobody
    rb = rate_batch(LinearLatency(0.030, 0.001), 100.0, slo_s=0.050, max_batch=8)
    assert rb is not None and rb.target == 1


def test_no_rate_or_no_estimate_means_the_window() -> None:
    assert rate_batch(LAT, 0.0, 0.1, 8) is None
    assert rate_batch(None, 100.0, 0.1, 8) is None


def test_the_arrival_rate_follows_a_steady_count_and_a_step() -> None:
    r = ArrivalRate(tau_s=1.0)
    n = 0
    for i in range(1, 5001):  # 500 items/s for 10 s, looked at every 2 ms
        n += 1
        r.update(i * 0.002, n)
    assert r.rps == pytest.approx(500.0, rel=0.02)
    for i in range(1, 2001):  # then nothing for 4 s: down by e^-4
        r.update(10 + i * 0.002, n)
    assert r.rps == pytest.approx(500.0 * math.exp(-4), rel=0.05)
    assert r.update(14.0, n - 5) == pytest.approx(r.rps)  # a count that goes back adds 0


# --------------------------------------------------------------------------- the decision


def test_rate_window_waits_for_b_star_items_then_takes_them_and_a_backlog() -> None:
    rb = RateBatch(target=10, fill_s=0.020)
    assert rate_window(0.005, 4, 0.0, 1.0, 16, rb, LAT) == WaitUntil(0.020)
    assert rate_window(0.006, 10, 0.0, 1.0, 16, rb, LAT) == TakeNow(10)
    assert rate_window(0.006, 30, 0.0, 1.0, 16, rb, LAT) == TakeNow(16)  # a backlog
    # the fill time is up: what is there goes
    assert rate_window(0.020, 4, 0.0, 1.0, 16, rb, LAT) == TakeNow(4)
    # the head's deadline comes first: 30 ms SLO, a batch of 10 takes 20 ms
    w = rate_window(0.0, 1, 0.0, 0.030, 16, RateBatch(10, 0.050), LAT)
    assert isinstance(w, WaitUntil) and w.t == pytest.approx(0.010)


def params(batching: Batching, slo_s: float = 1.0, cap: int = 64,
           delay_s: float = 0.002) -> dict[str, ModelParams]:
    return {"a": ModelParams("a", cap, delay_s, slo_s, batching)}


def view(items: int, arrived: int, head: float | None = 0.0, running: bool = False,
         slo_s: float = 1.0) -> dict[str, QueueView]:
    if not items:
        head = None
    return {"a": QueueView("a", items, head, None if head is None else head + slo_s, running,
                           arrived)}


@pytest.mark.parametrize("policy", [PolicyName.SHARED, PolicyName.SPATIAL])
def test_the_policy_uses_the_window_until_a_rate_is_measured_then_b_star(
        policy: PolicyName) -> None:
    pol = make_policy(policy, params(Batching.RATE), CpuSlices((0, 1)), knees={"a": 100.0})
    pol.use_estimates({"a": LAT})
    # nothing has arrived yet: the window's 2 ms from the head
    d = pol.decide(0.0, view(0, 0))
    assert d.launches == () and d.wake_at is None
    # 300 items/s for 6 s (looked at every 10 ms while the worker is busy)
    n = 0
    for i in range(1, 601):
        n += 3
        pol.decide(i * 0.010, view(0, n, running=True))
    rb = pol.rate_batches["a"]  # type: ignore[attr-defined]
    assert rb.target == 5  # 300/s measured within a few %: 3 / 0.7 = 4.3 -> 5
    assert pol.batch_cap("a") == 64  # a backlog goes whole
    # 4 queued: wait for the rest of b* (the fill time of 10 items from the head)
    d = pol.decide(6.001, view(4, n + 4, head=6.0))
    rb = pol.rate_batches["a"]  # type: ignore[attr-defined]
    assert d.launches == () and d.wake_at == pytest.approx(6.0 + rb.fill_s)
    d = pol.decide(6.002, view(7, n + 7, head=6.0))
    assert d.launches == (Launch("a", 7),)


def test_window_batching_is_unchanged_by_the_rate() -> None:
    pol = make_policy(PolicyName.SHARED, params(Batching.WINDOW), CpuSlices((0, 1)))
    pol.use_estimates({"a": LAT})
    for i in range(1, 201):
        pol.decide(i * 0.010, view(0, 5 * i, running=True))
    d = pol.decide(2.001, view(4, 1004, head=2.0))
    assert d.launches == () and d.wake_at == pytest.approx(2.002)
    assert pol.batch_cap("a") == 64


def test_the_config_key() -> None:
    cfg = parse_config({"models": [{"name": "a", "batching": "rate"}, {"name": "b"}]})
    assert [m.batching for m in cfg.models] == [Batching.RATE, Batching.WINDOW]
    from dstack.common.config import ConfigError

    with pytest.raises(ConfigError, match="batching"):
        parse_config({"models": [{"name": "a", "batching": "sometimes"}]})


# --------------------------------------------------------------------------- simulated


def _lat(b: int, p: float) -> float:
    return (10.0 + 1.0 * b) * max(1.0, 100.0 / p)  # 10 ms + 1 ms per item on the device


@pytest.mark.parametrize("policy", [PolicyName.SHARED, PolicyName.SPATIAL])
def test_simulated_rate_batching_serves_a_load_that_steps_up_and_down(
        policy: PolicyName) -> None:
    # Capacity within the SLO (batches of 16 in 26 ms) is about 600/s: 0.3x -> 1.2x -> 0.3x.
    profiles = {"a": make_profile("a", _lat, knee=100.0)}
    model = {"name": "a", "slo_ms": 100, "max_batch_size": 16, "rate_rps": 180,
             "max_queue_delay_ms": 2}
    arrivals = generate("burst:x4@3s+3s", {"a": 180.0}, 9.0, 1)
    out, goodput = {}, {}
    for batching in ("window", "rate"):
        cfg = config([{**model, "batching": batching}])
        sim = simulate(cfg, profiles, arrivals, [policy], 9.0, timeline_s=9.0)
        r = sim.reports[0]
        # 1.2x for a third of the run: some refused there, the rest served in time
        assert not r.error and r.slo_attainment_pct > 80 and r.late == 0, r
        goodput[batching] = r.goodput_rps
        spans = sim.results[policy.value].timeline
        out[batching] = {part: [s.n for s in spans if lo <= s.start_s < hi]
                         for part, (lo, hi) in {"low": (1.0, 3.0), "high": (4.0, 6.0),
                                                "after": (7.5, 9.0)}.items()}
    assert goodput["rate"] >= 0.98 * goodput["window"], goodput
    rate = out["rate"]
    mean = {k: sum(v) / len(v) for k, v in rate.items()}
    # the batch follows the load up and back down
    assert mean["high"] > 2 * mean["low"] and mean["after"] < mean["high"] / 2, mean
    # at 0.3x, b* = k*c / (1 - t*c) = 10 ms * 180/s / 0.82 = 2.2 -> 3 (a backlog: more)
    assert mean["low"] <= 4, mean
