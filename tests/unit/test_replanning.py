"""Re-planning for measured rates: taken only when it predicts more than the plan in force,
and run by the simulator on its virtual clock as the server runs it."""

from __future__ import annotations

from pathlib import Path

import pytest

from dstack.common.config import DeployConfig, PolicyName, parse_config
from dstack.common.slices import CpuSlices, MpsSlices
from dstack.policies.latency import LinearLatency
from dstack.policies.planning import (
    REPLAN_GAIN,
    Replan,
    corrected_profiles,
    latency_ratios,
    moved_workers,
    replan,
    served_of,
    served_profiles,
    setup_policy,
)
from dstack.policies.replicas import public_name
from dstack.simulate import generate, simulate

ROOT = Path(__file__).resolve().parents[2]


def mix() -> DeployConfig:
    """vgg19 and resnet50 on the reference V100, the device a little under half used."""
    return parse_config({
        "device": "cuda", "policy": "dstack",
        "profiles": str(ROOT / "profiles" / "reference-v100"),
        "models": [
            {"name": "vgg19", "slo_ms": 65, "max_batch_size": 32, "rate_rps": 170},
            {"name": "resnet50", "slo_ms": 82, "max_batch_size": 8, "rate_rps": 240},
        ]})


def test_a_replan_is_taken_only_when_it_predicts_clearly_more() -> None:
    cfg = mix()
    backend = MpsSlices(80)
    profiles = served_profiles(cfg, check_device=False)
    current = setup_policy(cfg, backend, origin=0.0, profiles=profiles)
    planned = {m.name: m.rate_rps for m in cfg.models}
    # the rates it was planned for, or within noise of them: the plan in force stays
    assert replan(cfg, backend, current, origin=1.0, rates=planned,
                  profiles=profiles) == Replan(None)
    near = {m: r * 1.05 for m, r in planned.items()}
    assert replan(cfg, backend, current, origin=1.0, rates=near,
                  profiles=profiles) == Replan(None)
    # resnet50 at 3x: the plan for that predicts more than the one in force; on a GPU a
    # worker's start costs the device nothing, so it is taken however young the plan is
    hot = {**planned, "resnet50": 3 * planned["resnet50"]}
    new = replan(cfg, backend, current, origin=1.0, rates=hot, profiles=profiles,
                 horizon_s=0.0, start_s={w: 30.0 for w in current.policy.slices()}).setup
    assert new is not None and new.plan is not None and current.plan is not None
    assert new.replicas == current.replicas  # the workers it has
    assert new.plan.for_model("resnet50").percent > current.plan.for_model("resnet50").percent
    assert REPLAN_GAIN > 0


def test_the_simulator_replans_during_a_burst_as_the_server_would() -> None:
    cfg = mix()
    profiles = served_profiles(cfg, check_device=False)
    arrivals = generate("burst:x3@2s+10s:resnet50", {m.name: m.rate_rps for m in cfg.models},
                        14.0, 3)
    on = simulate(cfg, profiles, arrivals, [PolicyName.DSTACK], 14.0)
    off_cfg = cfg.model_copy(update={"adapt": cfg.adapt.model_copy(update={"enabled": False})})
    off = simulate(off_cfg, profiles, arrivals, [PolicyName.DSTACK], 14.0)
    assert on.results["dstack"].replans >= 1 and off.results["dstack"].replans == 0
    # resnet50's burst is served better with the plan grown for it
    assert on.reports[0].per_model_goodput_rps["resnet50"] \
        > off.reports[0].per_model_goodput_rps["resnet50"]


def test_a_server_given_fewer_cores_than_were_profiled_plans_with_their_latencies() -> None:
    """The CPU mix was profiled on 2 cores. A server with one of them (taskset, a container's
    cpuset) must plan its one-core lane with the one-core cells, not the two-core ones."""
    cfg = parse_config({
        "device": "cpu", "policy": "dstack", "profiles": str(ROOT / "profiles" / "cpu"),
        "models": [{"name": "mobilenet_v3_small", "slo_ms": 60, "max_batch_size": 8,
                    "rate_rps": 20},
                   {"name": "resnet18", "slo_ms": 250, "max_batch_size": 8, "rate_rps": 5}]})
    profiles = served_profiles(cfg, check_device=False)
    one = profiles["resnet18"].on_cores(1)
    assert one.device.units == 1 and one.percentages == (100.0,)
    assert one.latency_ms(2, 100.0) == profiles["resnet18"].latency_ms(2, 50.0)
    assert profiles["resnet18"].on_cores(2) is profiles["resnet18"]

    setup = setup_policy(cfg, CpuSlices((0,)), origin=0.0, profiles=profiles)
    assert setup.plan is not None
    lane = setup.plan.lanes[0]
    assert lane.percent == 100.0 and lane.units == (0,)
    # its round is what the two models' batches take on one core
    expect = sum(profiles[m].latency_ms(b, 50.0)
                 for m, b in zip(lane.models, lane.caps, strict=True))
    assert lane.round_ms == pytest.approx(expect * 1.1, rel=1e-6)  # the planning margin
    est = setup.estimates["mobilenet_v3_small"]
    one_core_ms = profiles["mobilenet_v3_small"].latency_ms(1, 50.0)
    assert est.estimate_s(1) * 1000 == pytest.approx(one_core_ms, rel=0.05)


def test_a_machine_slower_than_its_profiles_is_planned_with_the_latencies_it_measured() -> None:
    """Warm-up batches 3x slower than the profile (a machine 3x slower than the one the
    profiles came from): that model's profile is scaled 3x before planning, so the plan
    no longer promises what the machine cannot do; within the margin, nothing changes."""
    cfg = parse_config({
        "device": "cpu", "policy": "dstack", "profiles": str(ROOT / "profiles" / "cpu"),
        "profile_margin": 0.3,
        "models": [{"name": "mobilenet_v3_small", "slo_ms": 60, "max_batch_size": 8,
                    "rate_rps": 20},
                   {"name": "resnet18", "slo_ms": 250, "max_batch_size": 8, "rate_rps": 5}]})
    profiles = served_profiles(cfg, check_device=False)
    setup = setup_policy(cfg, CpuSlices((0, 1)), origin=0.0, profiles=profiles)
    said = {w: (1, e.estimate_s(1)) for w, e in setup.estimates.items()}
    warm = {w: (1, s * (3.0 if w.startswith("resnet18") else 1.1))
            for w, (_, s) in said.items()}
    ratios = latency_ratios(setup, warm)
    assert ratios["resnet18"][0] == pytest.approx(3 * ratios["resnet18"][1])
    fixed, factors = corrected_profiles(cfg, profiles, ratios)
    assert factors == {"resnet18": pytest.approx(3.0)}  # mobilenet's 1.1 is within 0.3
    assert fixed["mobilenet_v3_small"] is profiles["mobilenet_v3_small"]
    assert fixed["resnet18"].latency_ms(4, 50.0) == pytest.approx(
        3 * profiles["resnet18"].latency_ms(4, 50.0))
    before = setup.plan
    after = setup_policy(cfg, CpuSlices((0, 1)), origin=0.0, profiles=fixed).plan
    assert before is not None and after is not None
    # the plan counts resnet18's batches at what they take here: its lane's round is longer
    def round_ms(plan: object) -> float:
        return next(lane.round_ms for lane in plan.lanes  # type: ignore[attr-defined]
                    if "resnet18" in lane.models)
    assert round_ms(after) > 2 * round_ms(before)
    assert corrected_profiles(cfg, profiles, latency_ratios(setup, said))[1] == {}


def test_batches_that_stay_slower_than_the_plan_says_make_it_plan_again_with_them() -> None:
    """Live estimates 3x the plan's for two samples running, the plan `hold_s` old: the
    re-planner plans again with that model's profile scaled 3x, once; a single slow
    sample, or one within the margin, changes nothing. Faster batches are followed only
    once they have stayed faster for `down_hold_s`."""
    import asyncio

    from dstack.runtime.replanner import Replanner

    cfg = parse_config({
        "device": "cpu", "policy": "dstack", "profiles": str(ROOT / "profiles" / "cpu"),
        "adapt": {"hold_s": 5.0},
        "models": [{"name": "mobilenet_v3_small", "slo_ms": 60, "max_batch_size": 8,
                    "rate_rps": 20},
                   {"name": "resnet18", "slo_ms": 250, "max_batch_size": 8, "rate_rps": 5}]})
    backend = CpuSlices((0, 1))
    setup = setup_policy(cfg, backend, origin=0.0)
    # live estimates are compared with the plan at the size their batches run: 4 here
    planned = {w: e.estimate_s(4) for w, e in setup.estimates.items()}
    slow = {"resnet18": 3.0}
    applied: list[object] = []

    async def apply(new: object, rates: dict[str, float]) -> None:
        applied.append(new)

    # every worker of a model (its guests on other lanes too) runs that much slower
    live = {w: (4, s * slow.get(public_name(w), 1.1)) for w, s in planned.items()}
    rp = Replanner(cfg, backend, apply, lambda: 0.0, setup, None, lambda: dict(live))
    assert rp._drifted(1.0) is None  # one sample
    assert rp._drifted(2.0) is None  # two, but the plan is not hold_s old
    drift = rp._drifted(6.0)
    assert drift is not None and "resnet18" in drift[1] and "x3.00" in drift[1]
    assert "a batch of 4" in drift[1]
    got = drift[0]
    assert got["resnet18"].latency_ms(2, 50.0) == pytest.approx(
        3 * setup.profiles["resnet18"].latency_ms(2, 50.0))
    assert got["mobilenet_v3_small"] is setup.profiles["mobilenet_v3_small"]
    assert asyncio.run(rp.replan({"mobilenet_v3_small": 20.0, "resnet18": 5.0}, got))
    assert len(applied) == 1 and rp.setup is applied[0]
    # the new plan's estimates are the live ones: nothing drifts any more
    live = {w: (4, e.estimate_s(4)) for w, e in rp.setup.estimates.items()}
    assert [rp._drifted(t) for t in (20.0, 21.0, 30.0)] == [None, None, None]

    # Faster than planned (a burst's slow batches are over): followed only once they have
    # been faster for down_hold_s (60 s), not in the next lull of a burst.
    faster = {w: e.estimate_s(4) for w, e in rp.setup.estimates.items()}
    live = {w: (4, s * (0.5 if public_name(w) == "resnet18" else 1.0))
            for w, s in faster.items()}
    assert [rp._drifted(t) for t in (40.0, 41.0, 50.0, 99.0)] == [None] * 4
    live = {w: (4, s) for w, s in faster.items()}  # back as planned: the hold starts again
    assert rp._drifted(100.0) is None
    live = {w: (4, s * (0.5 if public_name(w) == "resnet18" else 1.0))
            for w, s in faster.items()}
    assert [rp._drifted(t) for t in (101.0, 102.0, 150.0)] == [None] * 3
    assert rp._drifted(161.0) is None  # one sample past the hold; confirmed by the next
    drift = rp._drifted(162.0)
    assert drift is not None and "x0.50" in drift[1]


def test_live_latencies_are_compared_with_the_plan_where_batches_run_not_at_one_item(
        ) -> None:
    """Under load every batch is full, and the live line is measured only there: its batch
    of one is an extrapolation (on a loaded 2-core machine mobilenet_v3_small's read 124 ms,
    against 17 ms at warm-up, and re-planned the model with every latency x3.7, refusing
    most of its requests). The re-planner compares it with the plan at the size its batches
    had."""
    cfg = cpu_mix()
    setup = setup_policy(cfg, CpuSlices((0, 1)), origin=0.0)
    worker = next(w for w in setup.estimates if public_name(w) == "mobilenet_v3_small")
    est = setup.estimates[worker]
    live = LinearLatency(est.k_s, est.t_s)
    for _ in range(30):  # full batches, as the plan says
        live.observe(8, est.estimate_s(8))
    assert live.typical_n() == 8
    eight = est.estimate_s(8)  # a line through the same batch of 8, nearly flat
    steep = LinearLatency(0.9 * eight, 0.1 * eight / 8)
    assert steep.estimate_s(8) == pytest.approx(est.estimate_s(8))
    assert steep.estimate_s(1) > 2 * est.estimate_s(1)  # its batch of one reads far slower
    ratios = latency_ratios(setup, {worker: (8, steep.estimate_s(8))})
    assert corrected_profiles(cfg, setup.profiles, ratios)[1] == {}  # nothing to correct
    for _ in range(60):  # then batches of one: the size followed
        live.observe(1, est.estimate_s(1))
    assert live.typical_n() == 1


def cpu_mix() -> DeployConfig:
    return parse_config({
        "device": "cpu", "policy": "dstack", "profiles": str(ROOT / "profiles" / "cpu"),
        "models": [{"name": "mobilenet_v3_small", "slo_ms": 60, "max_batch_size": 8,
                    "rate_rps": 20},
                   {"name": "resnet18", "slo_ms": 250, "max_batch_size": 8, "rate_rps": 5}]})


def test_on_a_cpu_a_replan_that_restarts_workers_waits_until_its_gain_outweighs_the_starts(
        ) -> None:
    """resnet18 at 8x its planned rate: the plan for that puts both models on one lane of
    both cores, a few percent more goodput, but every worker must start again, each start
    taking a core from serving. A plan 60 s old, with starts of 10 s, is kept; once the
    plan in force has lasted long enough for the gain to outweigh the starts, it is
    taken. A new plan that moves no worker is taken at once."""
    cfg = cpu_mix()
    backend = CpuSlices((0, 1))
    current = setup_policy(cfg, backend, origin=0.0)
    profiles = served_of(current)
    starts = {w: 10.0 for w in current.policy.slices()}
    hot = {"mobilenet_v3_small": 20.0, "resnet18": 40.0}
    new = replan(cfg, backend, current, origin=1.0, rates=hot, profiles=profiles).setup
    assert new is not None and moved_workers(current, new)
    assert replan(cfg, backend, current, origin=1.0, rates=hot, profiles=profiles,
                  horizon_s=60.0, start_s=starts) == Replan(None, pending=True)
    assert replan(cfg, backend, current, origin=1.0, rates=hot, profiles=profiles,
                  horizon_s=3600.0, start_s=starts).setup is not None
    # mobilenet at 10x: the same lanes with other caps, no worker started
    busy = {"mobilenet_v3_small": 200.0, "resnet18": 5.0}
    same = replan(cfg, backend, current, origin=1.0, rates=busy, profiles=profiles,
                  horizon_s=0.0, start_s=starts).setup
    assert same is not None and not moved_workers(current, same)


def test_the_replanner_weighs_a_switch_against_the_time_its_plan_has_lasted() -> None:
    import asyncio

    from dstack.runtime.replanner import Replanner

    cfg = cpu_mix()
    backend = CpuSlices((0, 1))
    setup = setup_policy(cfg, backend, origin=0.0)
    applied: list[object] = []
    now = [0.0]

    async def apply(new: object, rates: dict[str, float]) -> None:
        applied.append(new)

    rp = Replanner(cfg, backend, apply, lambda: now[0], setup, None, None,
                   lambda: {w: 10.0 for w in setup.policy.slices()})
    hot = {"mobilenet_v3_small": 20.0, "resnet18": 40.0}
    now[0] = 60.0
    assert not asyncio.run(rp.replan(hot)) and not applied
    # not yet worth it is not "planned for": the trigger asks again for the same rates
    assert rp.trigger.planned_rates == {"mobilenet_v3_small": 20.0, "resnet18": 5.0}
    now[0] = 3600.0
    assert asyncio.run(rp.replan(hot)) and rp.setup is applied[0]
    # the new plan dates from its switch: another switch must be worth it over its own age
    assert rp._since == 3600.0
