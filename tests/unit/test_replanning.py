"""Re-planning for measured rates: taken only when it predicts more than the plan in force,
and run by the simulator on its virtual clock as the server runs it."""

from __future__ import annotations

from pathlib import Path

from dstack.common.config import DeployConfig, PolicyName, parse_config
from dstack.common.slices import MpsSlices
from dstack.policies.planning import REPLAN_GAIN, replan, served_profiles, setup_policy
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
    assert replan(cfg, backend, current, origin=1.0, rates=planned, profiles=profiles) is None
    near = {m: r * 1.05 for m, r in planned.items()}
    assert replan(cfg, backend, current, origin=1.0, rates=near, profiles=profiles) is None
    # resnet50 at 3x: the plan for that predicts more than the one in force
    hot = {**planned, "resnet50": 3 * planned["resnet50"]}
    new = replan(cfg, backend, current, origin=1.0, rates=hot, profiles=profiles)
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
