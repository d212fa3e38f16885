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


def _lexicographic(n: int, rows: list[milp.Row],
                   objectives: list[list[float]]) -> tuple[float, ...] | None:
    """The lexicographic maximum of `objectives` by enumeration (integer data: no bands)."""
    import itertools

    points = []
    for xs in itertools.product((0, 1), repeat=n):
        ok = all((sum(a * xs[j] for j, a in r.terms) == r.rhs) if r.equal
                 else (sum(a * xs[j] for j, a in r.terms) <= r.rhs) for r in rows)
        if ok:
            points.append(tuple(sum(c * v for c, v in zip(o, xs, strict=True))
                                for o in objectives))
    return max(points) if points else None


@st.composite
def programs(draw):
    """Small binary programs with many ties (integer coefficients from a short range, some
    objectives all zero) and rows that x = 0 satisfies."""
    n = draw(st.integers(3, 7))
    coef = st.integers(0, 3)
    rows = [milp.Row(tuple((j, float(draw(coef))) for j in range(n)),
                     float(draw(st.integers(1, 5)))) for _ in range(draw(st.integers(1, 3)))]
    top = [draw(st.sampled_from([0, 1, 3])) for _ in range(3)]
    objectives = [[float(draw(st.integers(0, t))) for _ in range(n)] for t in top]
    return n, rows, objectives


@settings(max_examples=15, deadline=None)
@given(programs(), st.integers(1, 6))
def test_each_objective_breaks_the_ties_of_the_ones_before_as_enumeration_does(prog, split):
    n, rows, objectives = prog
    best = _lexicographic(n, rows, objectives)
    assert best is not None  # x = 0 is feasible
    sol = milp.maximise(n, rows, objectives, time_limit_s=30)
    assert sol.proven
    assert tuple(sum(o[j] for j in sol.chosen) for o in objectives) == best
    # Variables added to a solved program (the lane search's neighbour lanes): the answer
    # over them all, whether or not a new variable is in it.
    split = min(split, n - 1)
    old = [j for j in range(n) if j < split]
    first = milp.maximise(n, [*rows, milp.Row(tuple((j, 1.0) for j in range(split, n)), 0.0)],
                          objectives, time_limit_s=30)
    assert set(first.chosen) <= set(old)
    again = milp.maximise(n, rows, objectives, time_limit_s=30, warm=first.chosen,
                          fresh=range(split, n))
    assert again.proven
    assert tuple(sum(o[j] for j in again.chosen) for o in objectives) == best


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
