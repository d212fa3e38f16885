"""The lane plan as a set-partitioning MILP over candidate lanes (docs/optimizer.md).

Columns. A candidate lane c = (M_c, p_c) is a set of models and a width, with its caps
fixed by the scan of `lanes.best_lane` and its scores (G_c, Ĝ_c, H_c) from `score_lane`.
Up to `EXACT_MAX` models every subset at every width is a candidate (2^n - 1 subsets x
|W|), so the MILP is exact over all plans. Above that the candidates are every lane the
greedy merge search scored (each model alone, each pair, each merge it tried: the greedy
plan is one of the MILP's solutions and its warm start), then `NEIGHBOUR_ROUNDS` round(s)
of the lanes of the MILP's plan (of at most `NEIGHBOUR_MAX` models) with one model added
or taken out, at their width; each round solves again, asking CBC first only for plans
with a new lane (`milp.maximise`'s `fresh`). The MILP is then exact over those
candidates, not over every plan: `SearchStatus.complete` says which.

MILP. y_c in {0, 1}:

    sum_{c : m in M_c} y_c = 1     for every model m     (<= 1 where models may be left out)
    sum_c u(p_c) y_c <= U          widths in units of the widths' common step (CPU: cores,
                                   so the lanes take disjoint cores)
    max sum_c G_c y_c, then sum_c Ĝ_c y_c, then sum_c H_c y_c   (lexicographic)
        then, where models may be left out, min sum_c |M_c| y_c
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import replace

from optimizer import milp
from optimizer.lanes import EXACT_MAX, LaneChoice, LaneEval, Lanes, SearchStatus

#: Rounds of neighbour lanes above `EXACT_MAX` models (each: one more CBC solve), and
#: the largest lane whose neighbours are scored.
NEIGHBOUR_ROUNDS = 1
NEIGHBOUR_MAX = 6
#: Wall-clock limit of one search, every CBC solve together; on it, CBC's best plan.
TIME_LIMIT_S = 5.0


def _all_lanes(lanes: Lanes) -> list[LaneEval]:
    n = len(lanes.inst.models)
    return [lanes.lane(mask, w) for mask in range(1, 1 << n) for w in lanes.inst.widths]


def _mask(ev: LaneEval) -> int:
    return sum(1 << i for i in ev.members)


def _neighbours(lanes: Lanes, choice: LaneChoice) -> None:
    """Score (into `lanes`' memo) each lane of `choice` of at most `NEIGHBOUR_MAX` models
    with one model more or one fewer, at its width (a lane's scan costs about the square of
    its size: larger lanes would take the time of every other step)."""
    n = len(lanes.inst.models)
    for ev in choice.lanes:
        if len(ev.members) > NEIGHBOUR_MAX:
            continue
        mask = _mask(ev)
        for i in range(n):
            if mask ^ (1 << i):
                lanes.lane(mask ^ (1 << i), ev.width)


def _solve(lanes: Lanes, cols: Sequence[LaneEval], *, drop: bool, warm: Sequence[LaneEval],
           time_limit_s: float, complete: bool, fresh: int = 0) -> LaneChoice:
    """The MILP over `cols`; `fresh`: the last `fresh` of them were added since `warm` was
    this MILP's plan over the others (`milp.maximise`'s `fresh`)."""
    n = len(lanes.inst.models)
    index = {(_mask(e), e.width): j for j, e in enumerate(cols)}
    rows = [milp.Row(tuple((j, 1.0) for j, e in enumerate(cols) if i in e.members), 1.0,
                     equal=not drop) for i in range(n)]
    rows.append(milp.Row(tuple((j, float(lanes.units[e.width])) for j, e in enumerate(cols)),
                         float(lanes.cap_units)))
    objectives = [[e.value for e in cols], [e.grown for e in cols], [e.robust for e in cols]]
    if drop:  # a model a plan would serve nothing is better left out than placed
        objectives.append([-float(len(e.members)) for e in cols])
    sol = milp.maximise(len(cols), rows, objectives,
                        time_limit_s=time_limit_s, name="dstack_lanes",
                        warm=[index[(_mask(e), e.width)] for e in warm],
                        fresh=range(len(cols) - fresh, len(cols)))
    chosen = sorted((cols[j] for j in sol.chosen), key=lambda e: min(e.members))
    status = SearchStatus(sol.proven, complete, sol.gap, len(cols))
    return LaneChoice(tuple(chosen), sum(e.value for e in chosen),
                      sum(e.robust for e in chosen), "milp", status)


def search(lanes: Lanes, *, drop: bool, exact_max: int = EXACT_MAX,
           time_limit_s: float = TIME_LIMIT_S, neighbours: bool = True) -> LaneChoice:
    """The best lane plan over the candidates (module docstring). `drop`: models may be
    left out. Above `exact_max` models the greedy plan is kept if it scores higher (only
    possible where CBC stopped at its time limit); `neighbours`: score the neighbour
    lanes of the plan and solve again (a second search on the same `lanes` has them)."""
    deadline = time.perf_counter() + time_limit_s
    n = len(lanes.inst.models)
    complete = n <= exact_max
    warm: tuple[LaneEval, ...] = ()
    greedy = None
    if not complete:
        greedy = lanes.greedy_plan()
        warm = greedy.lanes
    cols = _all_lanes(lanes) if complete else list(lanes.scored())
    try:
        best = _solve(lanes, cols, drop=drop, warm=warm, complete=complete,
                      time_limit_s=deadline - time.perf_counter())
    except milp.NoSolution:
        # CBC stopped before it had a solution: the greedy plan, with no bound.
        return replace(lanes.greedy_plan(),
                       status=SearchStatus(False, False, math.inf, len(cols)))
    for _ in range(0 if complete or not neighbours else NEIGHBOUR_ROUNDS):
        if not best.status or not best.status.proven or time.perf_counter() >= deadline:
            break
        before = len(lanes.scored())
        _neighbours(lanes, best)
        if len(lanes.scored()) == before:
            break
        try:  # only a plan with a new lane can change the answer: CBC looks at those
            best = _solve(lanes, list(lanes.scored()), drop=drop, warm=best.lanes,
                          complete=False, time_limit_s=deadline - time.perf_counter(),
                          fresh=len(lanes.scored()) - before)
        except milp.NoSolution:
            break
    if greedy is not None and greedy.key > best.key:  # CBC's tolerances, or its time limit
        best = replace(greedy, status=best.status)
    return best
