"""Replicas: how many workers a hot model gets, how requests are routed among them, and
what that gains in the simulator on the same arrivals."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest

from dstack.common.config import DeployConfig, PolicyName, parse_config
from dstack.common.slices import CpuSlices, MpsSlices
from dstack.policies.contract import ModelParams, Policy
from dstack.policies.planning import served_profiles, setup_policy
from dstack.policies.registry import make_policy
from dstack.policies.replicas import (
    choose,
    expand,
    public_name,
    replica_names,
    split_rates,
    wanted,
)
from dstack.runtime.dispatch import CoreModel, DispatchCore, Refusal, Ticket
from dstack.simulate import generate, simulate
from optimizer.lanes import LaneInstance, LaneModel, score_lane

ROOT = Path(__file__).resolve().parents[2]
H100 = ROOT / "profiles" / "nvidia-h100-80gb-hbm3"


def h100_config(rate_rps: float, *, max_replicas: int = 4) -> DeployConfig:
    """mobilenet_v3_large at a 3.6 ms SLO beside densenet121: at 13,000 rps one worker of
    mobilenet cannot keep up on any slice (its batch is capped by the SLO)."""
    return parse_config({
        "device": "cuda", "policy": "dstack", "profiles": str(H100),
        "models": [
            {"name": "mobilenet_v3_large", "slo_ms": 3.65, "max_batch_size": 16,
             "max_queue_delay_ms": 0.5, "rate_rps": rate_rps, "max_replicas": max_replicas},
            {"name": "densenet121", "slo_ms": 24.5, "max_batch_size": 32,
             "rate_rps": 270.0},
        ]})


def test_replica_names_expansion_and_rates() -> None:
    cfg = h100_config(12_000)
    assert replica_names("m", 3) == ("m", "m#1", "m#2")
    assert public_name("m#2") == "m" and public_name("m") == "m"
    run = expand(cfg, {"mobilenet_v3_large": 3, "densenet121": 1})
    assert [m.name for m in run.models] == ["mobilenet_v3_large", "mobilenet_v3_large#1",
                                            "mobilenet_v3_large#2", "densenet121"]
    assert all(m.zoo == "mobilenet_v3_large" for m in run.models[:3])
    assert [m.rate_rps for m in run.models] == pytest.approx([4000, 4000, 4000, 270])
    assert expand(cfg, {}) is cfg
    assert split_rates({"a": 90.0, "b": 5.0}, {"a": 3}) == {"a": 30.0, "a#1": 30.0,
                                                          "a#2": 30.0, "b": 5.0}


def test_more_workers_must_predict_clearly_more() -> None:
    cfg = parse_config({"device": "cpu", "policy": "shared",
                        "models": [{"name": "a"}, {"name": "b"}]})
    scores = {1: 100.0, 2: 101.0, 3: 130.0}
    assert choose(cfg, {"a": 3, "b": 1}, lambda c: scores[c["a"]]) == {"a": 3, "b": 1}
    scores[3] = 101.5  # 1.5% over one worker: not worth two more processes
    assert choose(cfg, {"a": 3, "b": 1}, lambda c: scores[c["a"]]) == {"a": 1, "b": 1}
    assert choose(cfg, {"a": 1, "b": 1}, lambda c: pytest.fail("nothing to choose")) \
        == {"a": 1, "b": 1}


def test_a_hot_model_gets_replicas_and_the_plan_predicts_more() -> None:
    cfg = h100_config(13_000)
    backend = MpsSlices(132)
    profiles = served_profiles(cfg, check_device=False)
    got = setup_policy(cfg, backend, origin=0.0, profiles=profiles)
    single = setup_policy(cfg, backend, origin=0.0, profiles=profiles,
                          replicas={"mobilenet_v3_large": 1, "densenet121": 1})
    assert got.replicas["mobilenet_v3_large"] > 1 and got.replicas["densenet121"] == 1
    assert got.plan is not None and single.plan is not None
    assert got.plan.objective > 1.02 * single.plan.objective
    workers = [m.name for m in got.run_cfg.models if m.name not in got.guests]
    assert workers == [*replica_names("mobilenet_v3_large",
                                      got.replicas["mobilenet_v3_large"]), "densenet121"]
    # a slice per worker, its guests on other lanes (tests/unit/test_borrow_lanes.py) too
    assert set(got.policy.slices()) == set(workers) | set(got.guests)
    planned = [m for lane in got.plan.lanes for m in lane.models]
    assert sorted(planned + [m for m, _ in got.plan.unserved]) == sorted(workers)
    assert sum(lane.percent for lane in got.plan.lanes) <= 100.0 + 1e-9
    # a light load, or max_replicas 1, keeps one worker
    light = setup_policy(h100_config(500), backend, origin=0.0, profiles=profiles)
    assert light.replicas == {"mobilenet_v3_large": 1, "densenet121": 1}
    capped = setup_policy(h100_config(13_000, max_replicas=1), backend, origin=0.0,
                          profiles=profiles)
    assert capped.replicas["mobilenet_v3_large"] == 1


def test_replicas_serve_more_requests_within_slo_in_the_simulator() -> None:
    cfg = h100_config(13_000)
    profiles = served_profiles(cfg, check_device=False)
    arrivals = generate("poisson", {m.name: m.rate_rps for m in cfg.models}, 3.0, 7)
    many = simulate(cfg, profiles, arrivals, [PolicyName.DSTACK], 3.0).reports[0]
    one = simulate(h100_config(13_000, max_replicas=1), profiles, arrivals,
                   [PolicyName.DSTACK], 3.0).reports[0]
    assert set(many.per_model_goodput_rps) == {"mobilenet_v3_large", "densenet121"}
    assert many.goodput_rps > 1.1 * one.goodput_rps
    assert many.arrived == one.arrived == arrivals.times.size  # every request counted once


class LeavesOut:
    """A policy that leaves some models out of its plan (as a lane plan may leave out a
    replica it has no room for)."""

    def __init__(self, inner: Policy, out: Mapping[str, str]) -> None:
        self.inner, self.out = inner, dict(out)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def unserved(self) -> Mapping[str, str]:
        return self.out


def replica_core(left_out: Mapping[str, str] | None = None) -> DispatchCore:
    names = ("a", "a#1", "b")
    params = {m: ModelParams(m, 4, 0.0, 1.0) for m in names}
    policy: Policy = make_policy(PolicyName.SHARED, params, CpuSlices((0, 1)))
    if left_out:
        policy = LeavesOut(policy, left_out)  # type: ignore[assignment]
    return DispatchCore([CoreModel(m, 1.0, 4, 64) for m in names], policy, now=0.0,
                        groups={"a": ("a", "a#1")})


def test_requests_go_to_an_idle_replica_then_to_the_shortest_queue() -> None:
    core = replica_core()
    to = []
    for now in (0.0, 0.001):
        t = core.admit("a", 1, now)
        assert isinstance(t, Ticket)
        to.append(core.names[t.model])
        core.step(now)  # launches it: that replica is now busy
    assert to == ["a", "a#1"]
    assert core.running("a") and core.running("a#1")
    queued = [core.names[core.admit("a", 1, 0.002 + i / 1000).model] for i in range(4)]
    assert queued == ["a", "a#1", "a", "a#1"]  # both busy: the one with fewer waiting
    c = core.counters("a")  # the served model's counters: its replicas' summed
    assert (c.arrived, c.admitted) == (6, 6)
    assert core.counters("a#1").arrived == 3
    assert core.pending("a") == 6  # 4 queued + 2 running batches
    assert core.names[core.admit("b", 1, 0.01).model] == "b"  # one worker: no routing


def test_a_replica_left_out_of_the_plan_gets_no_requests() -> None:
    core = replica_core({"a#1": "no room for a second worker"})
    got = [core.admit("a", 1, i / 1000) for i in range(3)]
    assert all(isinstance(t, Ticket) and core.names[t.model] == "a" for t in got)
    both = replica_core({"a": "left out", "a#1": "left out"})
    r = both.admit("a", 1, 0.0)
    assert isinstance(r, Refusal) and r.reason.value == "unplanned"


def test_a_lone_replica_waits_for_the_first_free_worker_not_its_own() -> None:
    # L = 6 ms, SLO 8 ms: alone, a request may wait out a whole batch (6 + 6 > 8), so only
    # a third is credited; one of two workers is free after ~3 ms on average (3 + 6 > 8:
    # two thirds); one of three after ~2 ms (2 + 6 <= 8: all of them). The lane is
    # saturated (1,000 rps against 667 a worker), so this is the credit the score uses.
    def lane_model(workers: int) -> LaneModel:
        return LaneModel("m", 8.0, 1000.0, 1.0, (4,), lambda b, p: 6.0, workers=workers)

    credited = [score_lane(LaneInstance((lane_model(w),), (50.0,)), (0,), 50.0, (4,))
                .fraction[0] for w in (1, 2, 3)]
    assert credited == pytest.approx([1 / 3, 2 / 3, 1.0])


def test_replica_count_is_the_workers_the_rate_needs_where_the_wait_fits() -> None:
    # alexnet on the reference V100 at 2,000 rps within 8.2 ms (the suite's m10): batch 8
    # takes 5.1 ms on 50% (1,569 rps a worker); two of them wait ~2.6 ms: 7.7 ms, safe.
    cfg = parse_config({
        "device": "cuda", "policy": "dstack",
        "profiles": str(ROOT / "profiles" / "reference-v100"), "rate_headroom": 0.2,
        "models": [{"name": "alexnet", "slo_ms": 8.2, "max_batch_size": 8,
                    "rate_rps": 2000}]})
    profiles = served_profiles(cfg, check_device=False)
    assert wanted(cfg, profiles) == {"alexnet": 2}
    assert wanted(cfg.model_copy(update={"models": [cfg.models[0].model_copy(
        update={"rate_rps": 300.0})]}), profiles) == {"alexnet": 1}


def test_a_hold_taken_for_a_served_model_is_given_back_to_its_replica() -> None:
    """`refuse_early(hold=True)` for a model served by replicas holds a place on one of
    them (the idle one first, as `admit` routes); `release` gives it back there."""
    core = replica_core()
    for _ in range(2):
        assert core.refuse_early("a", 1, 0.0, hold=True) is None
    t = core.admit("a", 1, 0.0)  # both replicas hold one: it goes to either
    assert isinstance(t, Ticket)
    core.release("a")
    core.release("a")
    t2 = core.admit("a", 1, 0.0)  # the holds are gone: the replica with nothing queued
    assert isinstance(t2, Ticket) and t2.model != t.model
