"""Binary programs solved with PuLP + CBC. The only module that imports PuLP.

The lane planner (`optimizer.lane_milp`) and the MIG advisor (`optimizer.mig`) state their
MILPs as plain data: binary variables 0..n-1, linear rows (<= or ==), and objectives to
maximise lexicographically. Each objective is one CBC solve, warm-started from the last;
after it, a row keeps that objective within `TOL` (relative) of the value found.

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


class NoSolution(RuntimeError):
    """CBC found no feasible point (infeasible rows, or none before the time limit)."""


def maximise(n: int, rows: Sequence[Row], objectives: Sequence[Sequence[float]], *,
             time_limit_s: float, warm: Sequence[int] = (), name: str = "dstack") -> Solution:
    """Maximise `objectives` in turn over x in {0,1}^n subject to `rows`; `warm`: the
    variables at 1 in a feasible point to start from (CBC keeps the better of it and what
    it finds)."""
    t0 = time.perf_counter()
    deadline = t0 + time_limit_s
    prob = pulp.LpProblem(name, pulp.LpMaximize)
    x = [prob.add_variable(f"x{j}", cat=pulp.LpBinary) for j in range(n)]
    for k, row in enumerate(rows):
        # LpAffineExpression from pairs: lpSum over products is slow on many columns.
        expr = pulp.LpAffineExpression([(x[j], a) for j, a in row.terms])
        prob += (expr == row.rhs) if row.equal else (expr <= row.rhs), f"r{k}"
    start = set(warm)
    for j, v in enumerate(x):
        v.setInitialValue(1 if j in start else 0)
    proven, gap = True, 0.0
    with tempfile.TemporaryDirectory(prefix="dstack-cbc-") as tmp:
        log = Path(tmp) / "cbc.log"
        for stage, coef in enumerate(objectives):
            obj = pulp.LpAffineExpression([(x[j], c) for j, c in enumerate(coef) if c])
            prob.setObjective(obj)
            with warnings.catch_warnings():
                # PuLP 3 deprecates the bundled-CBC class for 4.0; it is the CBC we have.
                warnings.simplefilter("ignore", DeprecationWarning)
                solver = pulp.PULP_CBC_CMD(
                    msg=False, timeLimit=max(0.05, deadline - time.perf_counter()),
                    warmStart=bool(start) or stage > 0, logPath=str(log))
            prob.solve(solver)
            if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
                raise NoSolution(f"CBC found no solution ({pulp.LpStatus[prob.status]})")
            if stage == 0 and prob.sol_status != pulp.LpSolutionOptimal:
                proven, gap = False, _gap(log)
            best = sum(c * (x[j].value() or 0.0) for j, c in enumerate(coef))
            prob += obj >= best - TOL * max(1.0, abs(best)), f"keep{stage}"
            for v in x:  # warm start of the next stage: this one's answer
                v.setInitialValue(round(v.value() or 0.0))
    chosen = tuple(j for j, v in enumerate(x) if (v.value() or 0.0) > 0.5)
    return Solution(chosen, proven, gap, time.perf_counter() - t0)


def _gap(log: Path) -> float:
    """CBC's relative gap from its log (`Gap: -0.08` for a maximisation), inf if none."""
    try:
        text = log.read_text()
    except OSError:
        return float("inf")
    found = re.findall(r"^Gap:\s*(-?[0-9.eE+-]+)", text, re.MULTILINE)
    return abs(float(found[-1])) if found else float("inf")
