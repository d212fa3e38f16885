"""Schedules built from random feasible plans always validate, with concrete cores."""

from __future__ import annotations

import random

import pytest

from dstack.common.slices import CpuSlices, MpsSlices
from dstack.common.types import Cell, DeviceInfo, ModelSLO, Plan, Profile, SolverStatus
from dstack.policies.lane_planning import plan_lanes
from dstack.policies.schedule import ScheduleError, build_schedule, validate_schedule
from tests.unit._simulate_fixtures import config


def random_profiles(rng: random.Random, cores: int, n_models: int) -> dict[str, Profile]:
    pcts = sorted({100.0 * k / cores for k in range(1, cores + 1)})
    out = {}
    for i in range(n_models):
        name = f"m{i}"
        base = rng.uniform(2, 20)
        per_item = rng.uniform(0.5, 5)
        knee = rng.choice(pcts)
        cells = []
        for b in (1, 2, 4, 8):
            for p in pcts:
                ms = (base + per_item * b) * max(1.0, knee / p) ** rng.uniform(0.5, 1.0)
                cells.append(Cell(b, p, ms, ms * 1.05))
        out[name] = Profile(name, DeviceInfo("cpu", "rand", cores, "cores"), "cpu-affinity",
                            (1, 2, 4, 8), tuple(pcts), tuple(cells))
    return out


@pytest.mark.parametrize("seed", range(20))
def test_schedules_from_random_plans_validate(seed: int) -> None:
    rng = random.Random(seed)
    cores = rng.choice([2, 4])
    profiles = random_profiles(rng, cores, rng.randint(1, 3))
    slos = [ModelSLO(m, rng.uniform(40, 300), rng.uniform(1, 200)) for m in profiles]
    cfg = config([{"name": s.model, "slo_ms": s.slo_ms, "rate_rps": s.rate_rps,
                   "max_batch_size": 8} for s in slos], device="cpu")
    plan = plan_lanes(cfg, profiles, CpuSlices(tuple(range(cores))))[0]
    # A model no slice can serve within its SLO is left out (INFEASIBLE names it); the
    # schedule of those placed must validate all the same.
    assert plan.models, plan.shortfalls
    sched = build_schedule(plan, CpuSlices(tuple(range(cores))))
    assert validate_schedule(sched, [m.model for m in plan.models]) == []
    for s in sched.slots:
        assert len(s.units) == round(s.percent / 100 * cores)  # percent says what it gets
        m = plan.for_model(s.model)
        assert s.start_ms + m.latency_ms <= plan.cycle_ms + 1e-6
    gpu = build_schedule(plan, MpsSlices())
    assert validate_schedule(gpu, [m.model for m in plan.models]) == []


def test_a_plan_that_overbooks_the_cores_is_refused() -> None:
    from dstack.common.types import ModelPlan

    plan = Plan((ModelPlan("a", 1, 100, 5, 1, 1, 1, 50), ModelPlan("b", 1, 50, 5, 1, 1, 1, 50)),
                20.0, 2.0, SolverStatus.OPTIMAL)
    with pytest.raises(ScheduleError, match="b needs 1 cores"):
        build_schedule(plan, CpuSlices((0, 1)))
