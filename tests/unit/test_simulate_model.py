"""The simulator's latency model, contention model, ideal bound and workloads, worked by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dstack.common.slices import MpsSlices
from dstack.policies.baselines import ModelParams, SharedPolicy
from dstack.simulate import (
    SimModel,
    TraceModel,
    cost_per_request_s,
    fluid_bound,
    generate,
    ideal_bound_rps,
    latency_ms,
    run,
    trace_bound_rps,
)
from dstack.simulate.ideal import request_costs_s
from dstack.simulate.workload import WorkloadError, parse_duration
from tests.unit._simulate_fixtures import knee50, make_profile


def test_latency_interpolates_between_batches_and_extrapolates_past_the_last() -> None:
    prof = make_profile("m", lambda b, p: {1: 2.0, 8: 9.0, 16: 25.0}[b] * 100 / p,
                        percents=(50.0, 100.0))
    assert latency_ms(prof, 8, 100) == 9.0  # a profiled point is exact
    assert latency_ms(prof, 4, 100) == pytest.approx(2.0 + 7.0 * 3 / 7)  # between 1 and 8
    assert latency_ms(prof, 12, 100) == pytest.approx(17.0)  # between 8 and 16
    assert latency_ms(prof, 24, 100) == pytest.approx(41.0)  # last two: 2 ms per item
    assert latency_ms(prof, 8, 75) == 18.0  # a slice between measured ones: the one below
    assert latency_ms(prof, 8, 25) == pytest.approx(36.0)  # below the smallest: p*L kept


def _shared(n: int) -> tuple[SharedPolicy, list[SimModel]]:
    names = [f"m{i}" for i in range(n)]
    params = {m: ModelParams(m, 4, 0.0, 1.0) for m in names}
    pol = SharedPolicy(params, MpsSlices(100))
    table = [0.010] * 5  # 10 ms solo for any batch
    return pol, [SimModel(m, 1.0, 4, 100, 100.0, table) for m in names]


def test_two_concurrent_batches_on_the_whole_device_share_it() -> None:
    pol, models = _shared(2)
    r = run(pol, models, [0.0, 0.0], [0, 1], 1.0)
    # Both at 100%: S = 200, each progresses at half speed, so both end at 20 ms.
    assert sorted(np.frombuffer(r.latencies_s)) == pytest.approx([0.020, 0.020])
    assert r.busy_integral == pytest.approx(0.020)


def test_processor_sharing_recomputes_finish_times_on_every_start_and_finish() -> None:
    pol, models = _shared(2)
    r = run(pol, models, [0.0, 0.005], [0, 1], 1.0)
    # m0 alone for 5 ms (5 ms of work left), then both at half speed: m0 ends at 15 ms;
    # m1 has done 5 of its 10 ms by then and runs alone to 20 ms (latency 15 ms).
    assert list(np.frombuffer(r.latencies_s)) == pytest.approx([0.015, 0.015])
    assert r.end_s == pytest.approx(0.020)


def test_ideal_cost_is_the_cheapest_slo_feasible_configuration() -> None:
    prof = make_profile("m", knee50)
    # Cheapest per request: batch 16 at 25% or 50% (work-conserving): 0.5 * 26 ms / 16.
    assert cost_per_request_s(prof, 100.0, 16) == pytest.approx(0.5 * 0.026 / 16)
    # SLO 40 ms: 25% (52 ms) is out, 50% at batch 16 (26 ms) is in: same cost.
    assert cost_per_request_s(prof, 40.0, 16) == pytest.approx(0.5 * 0.026 / 16)
    # SLO 15 ms: at most batch 5 (15 ms) at 50% or more.
    assert cost_per_request_s(prof, 15.0, 16) == pytest.approx(0.5 * 0.015 / 5)
    assert cost_per_request_s(prof, 5.0, 16) == math.inf


def test_a_request_with_no_neighbours_in_reach_costs_a_batch_of_one() -> None:
    """Arrivals 1 s apart under a 100 ms SLO can never share a batch: each is charged a
    batch of 1 on its cheapest slice, not the batch-of-16 cost the fluid LP uses."""
    prof = make_profile("m", knee50)
    alone = np.arange(20, dtype=float)
    got = request_costs_s(alone, prof, 100.0, 16)
    one = min(p / 100 * latency_ms(prof, 1, p) / 1000 for p in prof.percentages
              if latency_ms(prof, 1, p) <= 100.0)
    assert got == pytest.approx(np.full(20, one))
    assert one > cost_per_request_s(prof, 100.0, 16)
    # 16 arrivals within a millisecond can share one batch: the fluid cost is reached.
    together = np.linspace(0.0, 0.001, 16)
    assert request_costs_s(together, prof, 100.0, 16) == pytest.approx(
        np.full(16, cost_per_request_s(prof, 100.0, 16)))


def test_the_trace_bound_never_lets_a_burst_borrow_the_quiet_seconds() -> None:
    """A model at 5 ms of device time a request (200 a device-second), flooded for 1 s at
    1,000 rps and idle for 9 s: the fluid LP serves the whole flood with the device time of
    all 10 s; within a 100 ms SLO the flood has 1.1 s of device, 220 requests, and the
    trace bound says no more."""
    prof = make_profile("m", lambda b, p: 10.0 * b * max(1.0, 50.0 / p))
    cost = cost_per_request_s(prof, 100.0, 8)
    assert cost == pytest.approx(0.005)
    times = np.linspace(0.0, 0.999, 1000)
    lp = ideal_bound_rps({"m": cost}, {"m": 1000}, 10.0, 0.1)
    tb = trace_bound_rps([TraceModel(times, 100.0, prof, 8)], 10.0)
    assert lp == pytest.approx(100.0)  # all of it
    assert tb == pytest.approx(1.1 / cost / 10.0)


def test_ideal_bound_fills_the_cheapest_models_first() -> None:
    costs = {"cheap": 0.001, "dear": 0.004, "never": math.inf}
    # 1 s of device: 600 cheap requests use 0.6 s; the 0.4 s left serve 100 dear ones.
    assert fluid_bound(costs, {"cheap": 600, "dear": 500, "never": 50}) == pytest.approx(700)
    # Arrivals over 2 s with a 0.5 s SLO: 2.5 device-seconds.
    assert ideal_bound_rps(costs, {"cheap": 1000, "dear": 1000, "never": 9}, 2.0, 0.5) \
        == pytest.approx((1000 + 1.5 / 0.004) / 2.0)


def test_poisson_rates_bursts_and_ramps() -> None:
    a = generate("poisson", {"x": 200.0, "y": 50.0}, 20.0, seed=3)
    assert np.all(np.diff(a.times) >= 0)
    assert a.count("x") == pytest.approx(4000, rel=0.06)
    assert a.count("y") == pytest.approx(1000, rel=0.12)
    b = generate("burst:x2@5s+5s:x", {"x": 200.0, "y": 50.0}, 20.0, seed=3)
    t = b.times[b.models == 0]
    assert np.count_nonzero((t >= 5) & (t < 10)) == pytest.approx(2000, rel=0.08)
    assert np.count_nonzero(t < 5) == pytest.approx(1000, rel=0.12)
    assert b.count("y") == a.count("y")  # the burst is for x only; y's stream is untouched
    r = generate("ramp:0.5..2", {"x": 200.0}, 20.0, seed=3)
    t = r.times
    early, late = np.count_nonzero(t < 4), np.count_nonzero(t >= 16)
    assert late / early == pytest.approx((1.85) / (0.65), rel=0.15)


def test_bad_specs_say_what_is_wrong() -> None:
    with pytest.raises(WorkloadError, match="unknown workload"):
        generate("zipf", {"x": 1.0}, 1.0, 1)
    with pytest.raises(WorkloadError, match="not a served model"):
        generate("burst:x2@1s+1s:nope", {"x": 1.0}, 1.0, 1)
    assert parse_duration("250ms") == 0.25
    assert parse_duration("10m") == 600.0
    with pytest.raises(WorkloadError):
        parse_duration("ten")
