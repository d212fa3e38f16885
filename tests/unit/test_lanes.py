"""The lane planner (optimizer.lanes), the dstack plan (dstack.policies.lane_planning) and
the lane policy (dstack.policies.lane_policy)."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from dstack.common.slices import CpuSlices, MpsSlices
from dstack.common.types import Priority, SolverStatus
from dstack.policies.contract import QueueView
from dstack.policies.lane_planning import plan_lanes
from dstack.policies.lane_policy import LanePolicy
from dstack.policies.latency import LinearLatency
from dstack.policies.planning import model_params
from optimizer.lanes import (
    DROP_GAIN,
    ISOLATION_GAIN,
    LaneInstance,
    LaneModel,
    brute_force,
    capped,
    solve_lanes,
)
from optimizer.packing import validate_schedule
from tests.unit._simulate_fixtures import config, knee50, make_profile


def synthetic(base: float, per_item: float, knee: float):
    """L(b, p): base + per_item * b from the knee up, work-conserving below it."""
    def lat(b: int, p: float) -> float:
        return (base + per_item * b) * max(1.0, knee / p)
    return lat


@st.composite
def instances(draw, max_models: int = 5, widths=(25.0, 50.0, 75.0, 100.0)):
    n = draw(st.integers(1, max_models))
    models = []
    for i in range(n):
        base = draw(st.floats(0.5, 10.0))
        per = draw(st.floats(0.05, 2.0))
        knee = draw(st.sampled_from([25.0, 50.0, 75.0, 100.0]))
        lat = synthetic(base, per, knee)
        slo = draw(st.floats(1.5, 15.0)) * lat(1, 100.0)
        rate = draw(st.floats(1.0, 2000.0))
        weight = draw(st.sampled_from([p.weight for p in Priority]))
        models.append(LaneModel(f"m{i}", slo, rate, weight, (1, 2, 4, 8, 16), lat))
    return LaneInstance(tuple(models), tuple(widths))


@settings(max_examples=40, deadline=None)
@given(instances(), st.data())
def test_plan_beats_spatial_and_temporal_assignments(inst, data):
    n = len(inst.models)
    spatial_w = [100.0 / n] * n
    temporal_caps = [data.draw(st.sampled_from(m.batches)) for m in inst.models]
    best, ref = solve_lanes(inst, spatial_widths=spatial_w, temporal_caps=temporal_caps)
    assert ref.spatial is not None and ref.temporal is not None
    assert best.value >= ref.spatial.value - 1e-9
    assert best.value >= ref.temporal.value - 1e-9
    assert sum(e.width for e in best.lanes) <= inst.capacity + 1e-6
    placed = sorted(i for e in best.lanes for i in e.members)
    assert sorted(placed + list(best.dropped(n))) == list(range(n))  # each model once
    if best.dropped(n):  # left out only when that serves more than placing it
        kept, _ = solve_lanes(inst, spatial_widths=spatial_w, temporal_caps=temporal_caps,
                              drop=False)
        assert sorted(i for e in kept.lanes for i in e.members) == list(range(n))
        assert best.value > kept.value


def test_overload_leaves_the_expensive_model_out_to_serve_the_cheap_one():
    # Both need the whole device: a cheap, tight-SLO model the slow one would block.
    cheap = LaneModel("cheap", 3.0, 2000.0, 1.0, (1, 2, 4, 8), synthetic(0.5, 0.2, 100.0))
    dear = LaneModel("dear", 200.0, 20.0, 1.0, (1, 2, 4, 8), synthetic(40.0, 5.0, 100.0))
    inst = LaneInstance((cheap, dear), (50.0, 100.0))
    best, _ = solve_lanes(inst)
    assert best.dropped(2) == (1,)
    assert [e.members for e in best.lanes] == [(0,)] and best.lanes[0].width == 100.0
    kept, _ = solve_lanes(inst, drop=False)
    assert best.value > kept.value and len(kept.dropped(2)) == 0


@settings(max_examples=25, deadline=None)
@given(instances(max_models=4, widths=(25.0, 50.0, 100.0)))
def test_exact_search_equals_brute_force(inst):
    kept, _ = solve_lanes(inst, drop=False)
    every = brute_force(inst, drop=False)
    assert math.isclose(kept.value, every, rel_tol=1e-9, abs_tol=1e-9)
    # Leaving models out: the best over every kept subset, taken when it gains > DROP_GAIN.
    best, _ = solve_lanes(inst)
    fewer = brute_force(inst)
    if fewer > every * (1 + DROP_GAIN) + 1e-9:
        assert math.isclose(best.value, fewer, rel_tol=1e-9, abs_tol=1e-9)
    else:
        assert math.isclose(best.value, every, rel_tol=1e-9, abs_tol=1e-9)


@settings(max_examples=10, deadline=None)
@given(instances(max_models=5, widths=(25.0, 50.0, 100.0)))
def test_greedy_never_below_one_lane_per_model_or_temporal(inst):
    n = len(inst.models)
    best, ref = solve_lanes(inst, exact_max=0, spatial_widths=[100.0 / n] * n,
                            temporal_caps=[1] * n)
    assert best.value >= max(ref.spatial.value, ref.temporal.value) - 1e-9


@settings(max_examples=5, deadline=None)
@given(st.lists(instances(max_models=1), min_size=9, max_size=12))
def test_greedy_fits_more_models_than_lanes_the_device_holds(singles):
    models = tuple(m for inst in singles for m in inst.models)
    models = tuple(LaneModel(f"m{i}", m.slo_ms, m.rate_rps, m.weight, m.batches, m.latency)
                   for i, m in enumerate(models))
    inst = LaneInstance(models, (25.0, 50.0, 100.0))  # at most 4 lanes
    n = len(models)
    best, ref = solve_lanes(inst, temporal_caps=[1] * n, drop=False)
    assert best.source in ("milp", "greedy") or best.value == ref.temporal.value
    assert best.value >= ref.temporal.value - 1e-9
    assert sum(e.width for e in best.lanes) <= 100 + 1e-6
    assert sorted(i for e in best.lanes for i in e.members) == list(range(n))


def _cfg(models, **top):
    return config(models, **top)  # plan_lanes reads the models, not the policy


def test_a_model_no_lane_can_fit_does_not_stop_the_others():
    # slow: 50 ms at batch 1 on the whole device, SLO 20 ms: no plan serves it.
    profiles = {
        "fast": make_profile("fast", knee50),
        "other": make_profile("other", knee50),
        "slow": make_profile("slow", lambda b, p: 50.0 + b),
    }
    cfg = _cfg([
        {"name": "fast", "slo_ms": 80, "rate_rps": 100, "max_batch_size": 16},
        {"name": "other", "slo_ms": 120, "rate_rps": 50, "max_batch_size": 16},
        {"name": "slow", "slo_ms": 20, "rate_rps": 10, "max_batch_size": 16},
    ])
    plan, sched, _ = plan_lanes(cfg, profiles, MpsSlices(100))
    assert {m.model for m in plan.models} == {"fast", "other"}
    assert dict(plan.unserved).keys() == {"slow"}
    assert "needs 51.0 ms at batch 1 on 100%; its SLO is 20 ms" in dict(plan.unserved)["slow"]
    assert validate_schedule(sched, ["fast", "other"]) == []
    policy = LanePolicy(model_params(cfg), MpsSlices(100), plan, sched)
    assert set(policy.unserved()) == {"slow"}
    assert set(policy.slices()) == {"fast", "other", "slow"}


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.floats(2.0, 15.0), st.floats(0.0, 400.0),
                          st.sampled_from([4, 8, 16])), min_size=1, max_size=5),
       st.sampled_from(["cpu", "cuda"]))
def test_every_plan_packs_into_a_valid_schedule(specs, kind):
    units = 4 if kind == "cpu" else 100
    percents = (25.0, 50.0, 75.0, 100.0)
    profiles, models = {}, []
    for i, (f, rate, cap) in enumerate(specs):
        name = f"m{i}"
        profiles[name] = make_profile(name, knee50, percents=percents, kind=kind, units=units)
        models.append({"name": name, "slo_ms": f * knee50(1, 100.0), "rate_rps": rate,
                       "max_batch_size": cap})
    backend = CpuSlices(tuple(range(units))) if kind == "cpu" else MpsSlices(units)
    cfg = _cfg(models)
    plan, sched, ref = plan_lanes(cfg, profiles, backend)
    left_out = dict(plan.unserved)
    assert all("left out" in why for why in left_out.values())
    assert validate_schedule(sched, [m["name"] for m in models
                                     if m["name"] not in left_out]) == []
    lane_units = [u for lane in plan.lanes for u in lane.units]
    assert len(lane_units) == len(set(lane_units))
    assert sum(lane.percent for lane in plan.lanes) <= 100 + 1e-6
    # Never below either baseline's assignment; below the searched plan only where the
    # planner kept spatial's isolation for a gain of at most ISOLATION_GAIN.
    for c in ref.candidates:
        slack = ISOLATION_GAIN * c.value if c.source not in ("spatial", "temporal") else 0.0
        assert plan.objective >= c.value - slack - 1e-9, c.source


def _view(model, items, deadline, running=False):
    return QueueView(model, items, None if not items else 0.0, deadline, running)


def _lane_policy():
    profiles = {m: make_profile(m, knee50) for m in ("a", "b", "c")}
    cfg = _cfg([
        {"name": "a", "slo_ms": 200, "rate_rps": 10, "max_batch_size": 8},
        {"name": "b", "slo_ms": 200, "rate_rps": 10, "max_batch_size": 8},
        {"name": "c", "slo_ms": 200, "rate_rps": 10, "max_batch_size": 8},
    ])
    plan, sched, _ = plan_lanes(cfg, profiles, MpsSlices(100))
    return LanePolicy(model_params(cfg), MpsSlices(100), plan, sched), plan


def test_policy_runs_earliest_deadline_first_within_a_lane_and_lanes_concurrently():
    policy, plan = _lane_policy()
    for lane in policy.lanes:
        names = lane.models
        views = {m: _view(m, 0, None) for m in policy.models}
        for k, m in enumerate(names):
            views[m] = _view(m, 3, 1.0 - 0.1 * k)  # the last has the earliest deadline
        d = policy.decide(0.0, views)
        mine = [la for la in d.launches if la.model in names]
        assert [la.model for la in mine] == [names[-1]]
        assert mine[0].max_items == min(3, policy.batch_cap(names[-1]))
        # A busy lane launches nothing.
        views[names[0]] = _view(names[0], 3, 0.5, running=True)
        d = policy.decide(0.0, views)
        assert not [la for la in d.launches if la.model in names]
    # Every lane with work launches at once.
    views = {m: _view(m, 1, 1.0) for m in policy.models}
    d = policy.decide(0.0, views)
    assert len(d.launches) == len(policy.lanes)


def test_policy_takes_a_full_batch_and_a_lone_model_grows_with_its_slo():
    policy, _ = _lane_policy()
    views = {n: _view(n, 0, None) for n in policy.models}
    for lane in policy.lanes:
        m = lane.models[0]
        views[m] = _view(m, 100, 0.0001)  # the head cannot make it: still a full batch
        d = policy.decide(0.0, views)
        (la,) = [la for la in d.launches if la.model == m]
        assert la.max_items == policy.batch_cap(m) >= lane.caps[0]
        views[m] = _view(m, 0, None)
    alone = [lane.models[0] for lane in policy.lanes if len(lane.models) == 1]
    for m in alone:  # SLO 200 ms: 10 ms + 10 ms per item fits 8 (the max) in 100 ms
        policy.use_estimates({m: LinearLatency.from_points(1, 0.020, 8, 0.090)})
        assert policy.batch_cap(m) == 8


def test_a_lone_model_grows_its_batch_by_its_profiles_shape_at_the_live_speed():
    """tiny_cnn's CPU profile steps from 0.36 ms at batch 1 to 0.86 ms at 2: the straight
    line through batches 1 and 8 says 0.59 ms for 2, inside 0.6 of a 1.06 ms SLO, and
    batches of 2 were answered late (the simulator suite's m32). The profile's shape keeps
    the batch at 1; on a machine twice as fast as the profile, batches of 4 fit."""
    step = {1: 0.355, 2: 0.863, 4: 1.036, 8: 2.006}
    prof = make_profile("tiny", lambda b, p: step[b] * 100.0 / p, batches=(1, 2, 4, 8),
                        percents=(100.0,))
    cfg = _cfg([{"name": "tiny", "slo_ms": 1.06, "rate_rps": 2000, "max_batch_size": 8,
                 "max_queue_delay_ms": 0.2}])
    plan, sched, _ = plan_lanes(cfg, {"tiny": prof}, MpsSlices(100))
    (lane,) = plan.lanes
    assert lane.models == ("tiny",) and lane.lone_ms[:2] == (0.355, 0.863)
    policy = LanePolicy(model_params(cfg), MpsSlices(100), plan, sched)
    line = LinearLatency.from_points(1, 0.000355, 8, 0.002006)
    assert line.max_batch_within(0.6 * 0.00106, 8) == 2  # the line alone would take 2
    policy.use_estimates({"tiny": line})
    assert policy.batch_cap("tiny") == 1
    policy.use_estimates({"tiny": LinearLatency.from_points(1, 0.000355 / 2, 8, 0.001003)})
    assert policy.batch_cap("tiny") == 4  # 0.52 ms at half the profile's latency


def _lone_tiny(step: dict[int, float], slo_ms: float) -> LanePolicy:
    """tiny alone on a lane, profiled at `step` (ms by batch), live at the profile's speed."""
    prof = make_profile("tiny", lambda b, p: step[b] * 100.0 / p, batches=(1, 2, 4, 8),
                        percents=(100.0,))
    cfg = _cfg([{"name": "tiny", "slo_ms": slo_ms, "rate_rps": 2000, "max_batch_size": 8,
                 "max_queue_delay_ms": 0.2}])
    plan, sched, _ = plan_lanes(cfg, {"tiny": prof}, MpsSlices(100))
    policy = LanePolicy(model_params(cfg), MpsSlices(100), plan, sched)
    policy.use_estimates({"tiny": LinearLatency.from_points(1, step[1] / 1000, 8,
                                                            step[8] / 1000)})
    return policy


def test_a_lone_model_never_takes_a_batch_slower_per_item_than_a_smaller_one():
    """tiny_cnn on one core: a batch of 2 (0.86 ms) serves fewer items a second than a
    batch of 1 (0.36 ms). Within 0.6 of a 1.5 ms SLO both fit; the lane keeps batches of 1."""
    policy = _lone_tiny({1: 0.355, 2: 0.863, 4: 1.036, 8: 2.006}, 1.5)
    assert policy.batch_cap("tiny") == 1


def test_a_lone_model_with_a_backlog_takes_the_batch_its_oldest_request_can_wait_for():
    """tiny_cnn on two cores (0.22 ms at batch 1, 1.23 ms at 8), SLO 1.84 ms. Calm, its
    batch runs within 0.6 of the SLO: 6. With 20 queued and the oldest just arrived, it
    takes 8, the most items a second, and admission counts its queue at that batch; with
    the oldest due in 1.1 ms it keeps 6, which that request can wait for; 5 queued go
    as one batch of 5."""
    policy = _lone_tiny({1: 0.2213, 2: 0.5804, 4: 0.8427, 8: 1.2348}, 1.84)

    def launched(items: int, due_in_ms: float) -> int:
        (la,) = policy.decide(0.0, {"tiny": _view("tiny", items, due_in_ms / 1000)}).launches
        return la.max_items

    assert policy.batch_cap("tiny") == 6
    assert launched(20, 1.8) == 8 and policy.batch_cap("tiny") == 8
    assert launched(20, 1.1) == 6 and policy.batch_cap("tiny") == 6
    assert launched(5, 1.8) == 5 and policy.batch_cap("tiny") == 6


def test_an_overloaded_lane_runs_its_costly_models_only_in_its_slack():
    lat = synthetic(1.0, 0.5, 100.0)
    cheap = LaneModel("cheap", 20.0, 900.0, 1.0, (1, 2, 4), lat)  # 0.75 ms a request at 4
    dear = LaneModel("dear", 20.0, 900.0, 1.0, (1, 2, 4), synthetic(4.0, 2.0, 100.0))
    # Together 0.675 + 2.7 of the lane at batch 4: cheap keeps its demand, dear is capped.
    assert capped([cheap, dear], [4, 4], 100.0) == (1,)
    assert capped([dear, cheap], [4, 4], 100.0) == (0,)
    # Priority weights count: dear at `high` (4) costs less per weight than cheap at `low`.
    heavy = LaneModel("dear", 20.0, 200.0, 4.0, (1, 2, 4), synthetic(4.0, 2.0, 100.0))
    light = LaneModel("cheap", 20.0, 900.0, 0.25, (1, 2, 4), lat)
    assert capped([light, heavy], [4, 4], 100.0) == (0,)
    # Not overloaded, or a lone model: nobody is capped.
    calm = LaneModel("dear", 20.0, 10.0, 1.0, (1, 2, 4), dear.latency)
    assert capped([cheap, calm], [4, 4], 100.0) == ()
    assert capped([dear], [4], 100.0) == ()


def test_plan_leaves_out_a_costly_model_only_for_demand_it_knows():
    def quick(b, p):  # 0.5 ms + 0.2 ms per item on the whole device, work-conserving below
        return (0.5 + 0.2 * b) * max(1.0, 100.0 / p)

    def slow(b, p):
        return (40.0 + 5.0 * b) * max(1.0, 100.0 / p)

    profiles = {"quick": make_profile("quick", quick, batches=(1, 2, 4, 8)),
                "slow": make_profile("slow", slow, batches=(1, 2, 4, 8))}
    models = [{"name": "quick", "slo_ms": 3, "rate_rps": 2000, "max_batch_size": 8},
              {"name": "slow", "slo_ms": 200, "rate_rps": 20, "max_batch_size": 8}]
    plan, sched, _ = plan_lanes(_cfg(models), profiles, MpsSlices(100))
    assert dict(plan.unserved).keys() == {"slow"}
    assert "left out" in dict(plan.unserved)["slow"]
    assert plan.status is SolverStatus.PARTIAL
    assert [lane.models for lane in plan.lanes] == [("quick",)]
    assert validate_schedule(sched, ["quick"]) == []
    # Rates unknown (0): a guessed demand never leaves a model out.
    unknown = [{**m, "rate_rps": 0} for m in models]
    plan, _, _ = plan_lanes(_cfg(unknown), profiles, MpsSlices(100))
    assert plan.unserved == () and {m.model for m in plan.models} == {"quick", "slow"}
