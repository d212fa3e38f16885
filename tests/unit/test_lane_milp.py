"""The lane plan's MILP (optimizer.lane_milp, optimizer.milp) against the exact dynamic
programme over set partitions (optimizer.lanes.Lanes.exact), and above six models against
the greedy merge search."""

from __future__ import annotations

import math
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from optimizer import milp
from optimizer.lanes import DROP_GAIN, LaneInstance, LaneModel, Lanes, solve_lanes
from tests.unit.test_lanes import instances, synthetic


def _dp(inst: LaneInstance, drop: bool) -> tuple[float, float, float]:
    """The exact DP's key, with the rule for leaving models out that `solve_lanes` applies."""
    lanes = Lanes(inst)
    kept = lanes.exact()
    if not drop:
        return kept.key
    lanes.drop = True
    fewer = lanes.exact()
    return fewer.key if fewer.value > kept.value * (1 + DROP_GAIN) + 1e-9 else kept.key


def _close(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return all(math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-6) for x, y in zip(a, b, strict=True))


@settings(max_examples=12, deadline=None)
@given(instances(max_models=6, widths=(25.0, 50.0, 100.0)), st.booleans())
def test_milp_equals_the_exact_dp_up_to_six_models(inst, drop):
    best, _ = solve_lanes(inst, drop=drop)
    assert _close(best.key, _dp(inst, drop)), (best.key, _dp(inst, drop))
    assert best.status is not None and best.status.optimal
    assert sum(e.width for e in best.lanes) <= inst.capacity + 1e-6


def _many(n: int, seed: int) -> LaneInstance:
    import random

    rng = random.Random(seed)
    models = []
    for i in range(n):
        lat = synthetic(rng.uniform(0.5, 10), rng.uniform(0.05, 2), rng.choice([25.0, 50.0]))
        models.append(LaneModel(f"m{i}", rng.uniform(3, 15) * lat(1, 100.0),
                                rng.uniform(5, 300), rng.choice([4.0, 1.0]), (1, 2, 4, 8), lat))
    return LaneInstance(tuple(models), (25.0, 50.0, 75.0, 100.0))


def test_above_six_models_the_milp_is_never_below_the_greedy_and_says_it_is_not_exact():
    for seed in range(3):
        inst = _many(9, seed)
        greedy = Lanes(inst).greedy()
        best, _ = solve_lanes(inst, drop=False)
        assert best.value >= greedy.value * (1 - 1e-6)
        assert sorted(i for e in best.lanes for i in e.members) == list(range(9))
        assert sum(e.width for e in best.lanes) <= 100 + 1e-6
        assert best.status is not None and not best.status.complete
        assert "not over every lane" in best.status.describe()


def test_planning_is_deterministic():
    inst = _many(8, 5)
    runs = [solve_lanes(inst)[0] for _ in range(2)]
    plans = [[(e.members, e.width, e.caps) for e in r.lanes] for r in runs]
    assert plans[0] == plans[1]


def test_later_objectives_only_break_ties_of_the_first():
    # x0 + x1 <= 1, x1 + x2 <= 1: the first objective ties {x0, x2} with {x1}; the second
    # prefers x1; the first must not be given up for it.
    rows = [milp.Row(((0, 1.0), (1, 1.0)), 1.0), milp.Row(((1, 1.0), (2, 1.0)), 1.0)]
    sol = milp.maximise(3, rows, [[1.0, 2.0, 1.0], [0.0, 5.0, 0.0]], time_limit_s=10)
    assert sol.chosen == (1,) and sol.proven and sol.gap == 0.0
    sol = milp.maximise(3, rows, [[1.0, 1.9, 1.0], [0.0, 5.0, 0.0]], time_limit_s=10)
    assert sol.chosen == (0, 2)


def test_the_gap_is_read_from_cbcs_log(tmp_path: Path):
    log = tmp_path / "cbc.log"
    log.write_text("Result - Stopped on time limit\n\nObjective value:  9395.04\n"
                   "Upper bound:  10177.456\nGap:  -0.08\nEnumerated nodes: 0\n")
    assert milp._gap(log) == 0.08
    log.write_text("Result - Stopped on time limit\n")  # no solution, no gap
    assert milp._gap(log) == math.inf


def test_a_search_out_of_time_still_returns_a_plan_at_least_as_good_as_the_greedy():
    inst = _many(9, 1)
    best, _ = solve_lanes(inst, drop=False, time_limit_s=0.0)
    assert sorted(i for e in best.lanes for i in e.members) == list(range(9))
    assert best.value >= Lanes(inst).greedy().value * (1 - 1e-6)
    assert best.status is not None and not best.status.optimal
