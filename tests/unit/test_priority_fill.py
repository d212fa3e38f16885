"""`priority: low` (FIKIT): a low model takes no lane width, runs only in the gaps its
lane's planned models can spare, and does not cost them their SLOs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dstack.common.config import DeployConfig, PolicyName, parse_config
from dstack.common.slices import MpsSlices
from dstack.policies.contract import QueueView
from dstack.policies.lane_policy import GAP_SAFETY, LanePlan
from dstack.policies.planning import served_profiles, setup_policy
from dstack.policies.replicas import public_name
from dstack.simulate import generate, simulate

ROOT = Path(__file__).resolve().parents[2]
PLANNED = [{"name": "resnet50", "slo_ms": 50, "max_batch_size": 16, "rate_rps": 150},
           {"name": "alexnet", "slo_ms": 20, "max_batch_size": 16, "rate_rps": 300}]


def cfg_with(low: dict[str, Any] | None, policy: str = "dstack") -> DeployConfig:
    models = PLANNED + ([low] if low else [])
    return parse_config({"device": "cuda", "policy": policy,
                         "profiles": str(ROOT / "profiles" / "reference-v100"),
                         "models": models})


LOW = {"name": "vgg19", "slo_ms": 500, "max_batch_size": 32, "priority": "low",
       "rate_rps": 2000}


def plan_of(cfg: DeployConfig) -> LanePlan:
    setup = setup_policy(cfg, MpsSlices(80), origin=0.0,
                         profiles=served_profiles(cfg, check_device=False))
    assert isinstance(setup.plan, LanePlan)
    return setup.plan


def test_a_low_model_takes_no_width_and_fills_each_lane_it_fits() -> None:
    alone, with_low = plan_of(cfg_with(None)), plan_of(cfg_with(LOW))
    planned = [(lane.percent, tuple(m for m in lane.models if m not in lane.fill))
               for lane in with_low.lanes]
    assert planned == [(lane.percent, lane.models) for lane in alone.lanes]  # unchanged
    fills = [m for lane in with_low.lanes for m in lane.fill]
    assert fills and all(public_name(m) == "vgg19" for m in fills)
    assert len(fills) == len(set(fills)) == len(alone.lanes)  # one worker per lane here
    by_name = {m.model: m for m in with_low.models}
    for lane in with_low.lanes:
        for m in lane.fill:  # its planned batch ends within the lane's gap
            assert lane.gap_ms is not None
            assert by_name[m].latency_ms <= GAP_SAFETY * lane.gap_ms + 1e-9


def test_a_low_model_no_gap_fits_is_left_out_with_the_numbers() -> None:
    # vgg19 needs ~5 ms at batch 1 on the whole V100; alexnet's 6 ms SLO leaves no gap
    tight = [{**PLANNED[1], "slo_ms": 6, "max_batch_size": 1}]
    cfg = parse_config({"device": "cuda", "policy": "dstack",
                        "profiles": str(ROOT / "profiles" / "reference-v100"),
                        "models": [*tight, LOW]})
    plan = plan_of(cfg)
    why = dict(plan.unserved)["vgg19"]
    assert "priority low" in why and "gap" in why and "ms" in why
    arrivals = generate("poisson", {"alexnet": 300.0, "vgg19": 50.0}, 2.0, 1)
    rep = simulate(cfg, served_profiles(cfg, check_device=False), arrivals,
                   [PolicyName.DSTACK], 2.0).results["dstack"]
    assert rep.counts["vgg19"].refused["unplanned"] == rep.counts["vgg19"].arrived > 0
    assert rep.counts["alexnet"].served > 0


def test_the_gap_filler_waits_for_its_lane_and_cuts_its_batch_to_the_gap() -> None:
    cfg = cfg_with(LOW)
    setup = setup_policy(cfg, MpsSlices(80), origin=0.0,
                         profiles=served_profiles(cfg, check_device=False))
    lane = next(lane for lane in setup.plan.lanes if lane.fill)  # type: ignore[union-attr]
    planned, fill = next(m for m in lane.models if m not in lane.fill), lane.fill[0]
    pol = setup.policy

    def views(planned_items: int, fill_items: int) -> dict[str, QueueView]:
        return {planned: QueueView(planned, planned_items, 0.0 if planned_items else None,
                                   1.0 if planned_items else None, False),
                fill: QueueView(fill, fill_items, 0.0, 10.0, False)}

    both = [x.model for x in pol.decide(0.0, views(1, 40)).launches]
    assert both == [planned]  # the planned model first, whatever the deadlines
    only = pol.decide(0.0, views(0, 40)).launches
    assert [x.model for x in only] == [fill]
    est = setup.estimates[fill]
    assert lane.gap_ms is not None
    assert est.estimate_s(only[0].max_items) <= GAP_SAFETY * lane.gap_ms / 1000 + 1e-9


def test_a_low_flood_costs_the_planned_models_nothing_in_the_simulator() -> None:
    rates = {m["name"]: float(m["rate_rps"]) for m in PLANNED}
    alone = simulate(cfg_with(None), served_profiles(cfg_with(None), check_device=False),
                     generate("poisson", rates, 5.0, 2), [PolicyName.DSTACK], 5.0)
    cfg = cfg_with(LOW)
    flood = simulate(cfg, served_profiles(cfg, check_device=False),
                     generate("poisson", {**rates, "vgg19": 2000.0}, 5.0, 2),
                     [PolicyName.DSTACK], 5.0).results["dstack"]
    base = alone.results["dstack"]
    for m in rates:  # the same arrivals of the planned models in both runs
        assert flood.counts[m].arrived == base.counts[m].arrived
        lost = (base.counts[m].within_slo - flood.counts[m].within_slo) / base.counts[m].arrived
        assert lost <= 0.01, (m, lost)
    assert flood.counts["vgg19"].within_slo > 0  # it did run, in the gaps
    assert flood.busy_integral > base.busy_integral
