"""Binary programs solved with PuLP + CBC. The only module that imports PuLP.

The lane planner (`optimizer.lane_milp`) and the MIG advisor (`optimizer.mig`) state their
MILPs as plain data: binary variables 0..n-1, linear rows (<= or ==), and objectives to
maximise lexicographically: objective k is maximised over the points whose earlier
objectives are within `TOL` (relative) of the values found for them.

Each objective takes one CBC run at most. The first starts from the warm start. Each later
one asks only what could change the answer: the best point *other than the best so far*
whose objective comes within `TOL` of that point's (less `MARGIN`, for CBC's own
tolerances), a point that replaces it only if better by more than `TOL`. Where CBC finds
no such point, the best so far is the only one left within the bands and the runs stop:
most lane plans take two CBC runs, not three.

CBC runs single-threaded, so on the same input it returns the same answer: a plan is
deterministic unless the wall-clock limit stops CBC, and then the answer is CBC's best
solution so far with its relative gap to the bound (`Solution.gap`).
"""

from __future__ import annotations

import re
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pulp

#: A later objective keeps an earlier one within this share of its value.
TOL = 1e-7
#: A point must miss an objective's `TOL` band by this share as well before it is ruled
#: out without a run of its own (CBC's feasibility tolerances are far below it).
MARGIN = 1e-6
#: These programs are solved at CBC's root node, where its primal heuristics and cut
#: generators (`cuts=False` below) took about half of each run (docs/optimizer.md,
#: "Speed"). Preprocessing stays on: CBC 2.10 crashed without it on a program that
#: bound tightening proved infeasible, as the later objectives' runs often are.
CBC_OPTIONS = ("heuristicsOnOff off",)



@dataclass(frozen=True, slots=True)
class Row:
    """sum_j a_j x_j (== or <=) rhs, `terms` as (variable, a_j)."""

    terms: tuple[tuple[int, float], ...]
    rhs: float
    equal: bool = False


@dataclass(frozen=True, slots=True)
class Solution:
    chosen: tuple[int, ...]  # the variables at 1, ascending
    proven: bool  # CBC proved the first objective optimal (the others break its ties)
    gap: float  # CBC's relative gap on the first objective when it stopped (0: optimal)
    solve_s: float
    runs: int = 0  # CBC runs it took


class NoSolution(RuntimeError):
    """CBC found no feasible point (infeasible rows, or none before the time limit)."""


def _band(value: float, share: float) -> float:
    return share * max(1.0, abs(value))


def maximise(n: int, rows: Sequence[Row], objectives: Sequence[Sequence[float]], *,
             time_limit_s: float, warm: Sequence[int] = (), name: str = "dstack",
             fresh: Sequence[int] = ()) -> Solution:
    """Maximise `objectives` in turn over x in {0,1}^n subject to `rows`; `warm`: the
    variables at 1 in a feasible point to start from (CBC keeps the better of it and what
    it finds).

    `fresh`: the variables added since `warm` was the answer of this call without them
    (the same rows and objectives over the other variables). The first run then looks
    only at points that use a fresh variable; where none comes within the first
    objective's band of `warm`'s, `warm` is the answer (`NoSolution`: CBC could not tell
    before the time limit). A later objective cut short by the time limit keeps the
    point found before it."""
    t0 = time.perf_counter()
    deadline = t0 + time_limit_s
    prob = pulp.LpProblem(name, pulp.LpMaximize)
    x = [prob.add_variable(f"x{j}", cat=pulp.LpBinary) for j in range(n)]

    def expr(coef: Sequence[float]) -> pulp.LpAffineExpression:
        # From pairs: lpSum over products is slow on many columns.
        return pulp.LpAffineExpression([(x[j], c) for j, c in enumerate(coef) if c])

    for k, row in enumerate(rows):
        lhs = pulp.LpAffineExpression([(x[j], a) for j, a in row.terms])
        prob += (lhs == row.rhs) if row.equal else (lhs <= row.rhs), f"r{k}"
    proven, gap, runs = True, 0.0, 0
    best: tuple[int, ...] | None = tuple(sorted(set(warm))) if fresh else None
    with tempfile.TemporaryDirectory(prefix="dstack-cbc-") as tmp:
        log = Path(tmp) / "cbc.log"

        def solve(p: pulp.LpProblem, start: Sequence[int] | None = None
                  ) -> tuple[int, tuple[int, ...]]:
            """CBC on `p` from `start`: (PuLP's status of the solution, the variables
            at 1)."""
            nonlocal runs
            if start is not None:
                on = set(start)
                for j, v in enumerate(x):
                    v.setInitialValue(1 if j in on else 0)
            with warnings.catch_warnings():
                # PuLP 3 deprecates the bundled-CBC class for 4.0; it is the CBC we have.
                warnings.simplefilter("ignore", DeprecationWarning)
                solver = pulp.PULP_CBC_CMD(
                    msg=False, timeLimit=max(0.05, deadline - time.perf_counter()),
                    warmStart=start is not None, logPath=str(log), cuts=False,
                    options=list(CBC_OPTIONS))
            p.solve(solver)
            runs += 1
            return p.sol_status, tuple(j for j, v in enumerate(x) if (v.value() or 0.0) > 0.5)

        for stage, coef in enumerate(objectives):
            if best is not None and not any(coef):
                continue  # it ranks every point alike (and PuLP cannot copy an empty row)
            obj = expr(coef)
            if best is None:  # the first objective, from the warm start
                prob.setObjective(obj)
                status, best = solve(prob, warm or None)
                if status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
                    raise NoSolution(f"CBC found no solution ({pulp.LpStatus[prob.status]})")
                if status != pulp.LpSolutionOptimal:
                    proven, gap = False, _gap(log)
            else:
                # The best point other than `best` that could still change the answer.
                mine = sum(coef[j] for j in best)
                other = prob.copy()
                other.setObjective(obj)
                if stage == 0:  # `fresh`: `best` is the answer over the other variables
                    use = set(fresh)
                    other += expr([1.0 if j in use else 0.0 for j in range(n)]) >= 1, "fresh"
                else:
                    inside = set(best)
                    other += expr([1.0 if j in inside else -1.0 for j in range(n)]) \
                        <= len(inside) - 1, "other"
                other += obj >= mine - _band(mine, TOL) - _band(mine, MARGIN), "floor"
                status, point = solve(other)
                if other.status == pulp.LpStatusInfeasible:
                    break  # none: `best` is the only point left within the bands
                if status != pulp.LpSolutionOptimal:  # the time limit: keep `best`
                    if stage == 0:
                        raise NoSolution("CBC could not tell before the time limit "
                                         f"({pulp.LpStatus[other.status]})")
                    break
                if sum(coef[j] for j in point) > mine + _band(mine, TOL):
                    best = point
            if any(coef):
                top = sum(coef[j] for j in best)
                prob += obj >= top - _band(top, TOL), f"keep{stage}"
    return Solution(best, proven, gap, time.perf_counter() - t0, runs)


def _gap(log: Path) -> float:
    """CBC's relative gap from its log (`Gap: -0.08` for a maximisation), inf if none."""
    try:
        text = log.read_text()
    except OSError:
        return float("inf")
    found = re.findall(r"^Gap:\s*(-?[0-9.eE+-]+)", text, re.MULTILINE)
    return abs(float(found[-1])) if found else float("inf")
