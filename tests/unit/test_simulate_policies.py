"""The simulator on hand-made instances: who reaches the ideal, determinism, trace replay,
and the ideal bound as a property over random instances."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dstack.common.config import PolicyName
from dstack.simulate import generate, read_trace, simulate, write_trace
from dstack.simulate.workload import WorkloadError
from tests.unit._simulate_fixtures import config, knee50, make_profile

ALL = [PolicyName.DSTACK, PolicyName.TEMPORAL, PolicyName.SHARED, PolicyName.SPATIAL]


def _two_knees(headroom: float = 0.2) -> tuple:
    """Two models whose knees (50%) sum to 100%, offered 400 rps each. On its knee a batch
    of 16 takes 26 ms, so side by side each can do 615 rps: the ideal serves everything.
    Taking turns on the whole device each request costs 26/16 ms of the whole device: at
    most 615 rps in all, short of the 800 offered.

    The config declares 400 rps and plans for 400 x (1 + headroom) (`rate_headroom`, 20%
    by default): the solver picks the longest cycle that serves exactly the planned rate,
    so a plan for exactly 400 rps has little slack for Poisson bursts (see
    test_a_plan_without_headroom_still_keeps_up_with_spatial)."""
    cfg = config([
        {"name": "a", "slo_ms": 100, "max_batch_size": 16, "rate_rps": 400.0},
        {"name": "b", "slo_ms": 100, "max_batch_size": 16, "rate_rps": 400.0},
    ], rate_headroom=headroom)
    profiles = {m: make_profile(m, knee50) for m in ("a", "b")}
    return cfg, profiles


def test_knees_summing_to_100_dstack_and_spatial_reach_the_ideal_temporal_does_not() -> None:
    cfg, profiles = _two_knees()
    arr = generate("poisson", {"a": 400.0, "b": 400.0}, 10.0, seed=1)
    sim = simulate(cfg, profiles, arr, ALL, 10.0)
    by = {r.policy: r for r in sim.reports}
    assert sim.ideal_rps >= arr.times.size / 10.0 * 0.999  # everything can be served
    assert by["dstack"].ratio >= 0.97, by["dstack"]
    assert by["spatial"].ratio >= 0.97, by["spatial"]
    assert by["temporal"].ratio <= 0.85, by["temporal"]
    assert by["temporal"].goodput_rps <= 16 / 0.026 + 1  # one device, taking turns
    for r in sim.reports:
        assert r.goodput_rps <= sim.ideal_rps + 1e-9


def test_a_plan_without_headroom_still_keeps_up_with_spatial() -> None:
    # Declared rate = offered rate: the lane plan still gives each model its own lane
    # (the planned rate is a floor for its caps, not a ceiling), so Poisson bursts are
    # absorbed as under spatial.
    cfg, profiles = _two_knees(headroom=0.0)
    arr = generate("poisson", {"a": 400.0, "b": 400.0}, 10.0, seed=1)
    sim = simulate(cfg, profiles, arr, [PolicyName.DSTACK, PolicyName.SPATIAL], 10.0)
    dstack, spatial = sim.reports
    assert dstack.ratio >= 0.98 * spatial.ratio


def test_same_seed_same_report_and_another_seed_differs() -> None:
    cfg, profiles = _two_knees()
    runs = [
        simulate(cfg, profiles, generate("burst:x2@1s+1s", {"a": 400.0, "b": 400.0}, 3.0, s),
                 ALL, 3.0).reports
        for s in (7, 7, 8)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_trace_replay_gives_the_same_result_as_the_arrivals_it_was_written_from(tmp_path) -> None:
    cfg, profiles = _two_knees()
    arr = generate("poisson", {"a": 300.0, "b": 100.0}, 2.0, seed=5)
    path = tmp_path / "trace.csv"
    write_trace(arr, path)
    back = generate(f"trace:{path}", {"a": 300.0, "b": 100.0}, 2.0, seed=99)
    assert np.array_equal(back.times, arr.times) and np.array_equal(back.models, arr.models)
    a = simulate(cfg, profiles, arr, ALL, 2.0).reports
    b = simulate(cfg, profiles, back, ALL, 2.0).reports
    assert a == b


def test_a_hand_written_trace_is_sorted_and_cut_at_the_duration(tmp_path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("arrival_s,model\n0.5,b\n0.1,a\n\n0.3,a\n7,a\n")
    t = read_trace(path, ["a", "b"], 5.0)
    assert t.times.tolist() == [0.1, 0.3, 0.5]
    assert [t.names[i] for i in t.models.tolist()] == ["a", "a", "b"]
    cfg, profiles = _two_knees()
    sim = simulate(cfg, profiles, t, [PolicyName.SHARED], 5.0)
    assert sim.reports[0].arrived == 3 and sim.reports[0].slo_attainment_pct == 100.0
    path.write_text("0.1,c\n")
    with pytest.raises(WorkloadError, match="'c' is not served"):
        read_trace(path, ["a", "b"], 5.0)


@st.composite
def instances(draw: st.DrawFn, slo_factor: tuple[float, float] = (2.5, 8.0),
              max_rate: float = 600.0) -> tuple:
    n = draw(st.integers(2, 3))
    models, profiles, rates = [], {}, {}
    for i in range(n):
        name = f"m{i}"
        k = draw(st.floats(1.0, 20.0))  # ms fixed cost at the knee
        t = draw(st.floats(0.1, 5.0))  # ms per item at the knee
        knee = draw(st.sampled_from([25.0, 50.0, 100.0]))
        curve = draw(st.floats(0.5, 1.0))  # how work-conserving below the knee

        def lat(b: int, p: float, k: float = k, t: float = t, knee: float = knee,
                curve: float = curve) -> float:
            return (k + t * b) * max(1.0, (knee / p) ** curve)

        profiles[name] = make_profile(name, lat, knee=knee)
        slo = draw(st.floats(*slo_factor)) * (k + t)
        rate = draw(st.floats(20.0, max_rate))
        rates[name] = rate
        models.append({"name": name, "slo_ms": slo, "max_batch_size": 16, "rate_rps": rate,
                       "max_queue_delay_ms": min(2.0, slo / 4)})
    return config(models), profiles, rates, draw(st.integers(0, 2**16))


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_no_policy_ever_beats_the_ideal_bound(inst: tuple) -> None:
    cfg, profiles, rates, seed = inst
    arr = generate("burst:x2@0.5s+0.5s", rates, 2.0, seed)
    sim = simulate(cfg, profiles, arr, ALL, 2.0)
    for r in sim.reports:
        if r.error:
            continue
        assert r.goodput_rps <= sim.ideal_rps * (1 + 1e-9), (r, sim.ideal_rps)
        for m, g in r.per_model_goodput_rps.items():
            assert g * 2.0 <= arr.count(m)


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(instances(slo_factor=(1.05, 3.0), max_rate=3000.0), st.sampled_from(
    ["poisson", "burst:x4@0.3s+0.4s", "ramp:0.2..3"]))
def test_no_policy_beats_the_trace_bound_where_slos_are_tight_and_load_bursts(
        inst: tuple, workload: str) -> None:
    """The trace bound charges each request the batch its arrivals can form within its SLO
    and keeps a burst to the device time around it (dstack.simulate.ideal): tight SLOs and
    bursts are where it sits far below the fluid LP, so where a mistake in it would show."""
    cfg, profiles, rates, seed = inst
    arr = generate(workload, rates, 2.0, seed)
    sim = simulate(cfg, profiles, arr, ALL, 2.0)
    for r in sim.reports:
        if not r.error:
            assert r.goodput_rps <= sim.ideal_rps * (1 + 1e-9), (r.policy, r, sim.ideal_rps)
