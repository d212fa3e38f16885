"""The shelf MILP, solved with PuLP + CBC. The only module that imports PuLP.

The cycle T is continuous. Throughput b/T is not linear in T, so the model is written in
u = 1/T: with x[m,c,k] binary (model m takes choice c on shelf k) and
z[m,c,k] = u * x[m,c,k] (exactly linearised: x binary, u in [u_lo, u_hi]),

    throughput_m = 1000 * sum b_c z[m,c,k]          (rps; T in ms)
    T + L_m <= SLO_m   <=>  sum (SLO_m - L_c) z[m,c,k] >= on_m
    D_k <= T shelf by shelf: E_k = D_k / T >= sum_c L_c z[m,c,k]  for each m, sum_k E_k <= 1
    device share = sum p_c L_c z[m,c,k] / 100

all linear. Symmetry: shelves are numbered by their lowest-numbered model, so model m may
only use shelves 0..m.

Stages (lexicographic, each a CBC solve warm-started from the last):
  A. only if not every model fits: maximise sum w_m on_m (models placed);
  B. maximise weighted goodput sum w_m s_m, s_m <= R_m, s_m <= throughput_m;
  C. keep goodput >= (1 - tol) * B's optimum and minimise the device share.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import pulp

from optimizer.formulation import Choice, ModelInput


@dataclass(frozen=True, slots=True)
class Assignment:
    picks: tuple[Choice | None, ...]
    shelves: tuple[int | None, ...]
    proven_optimal: bool


class SolverTimeout(RuntimeError):
    """CBC found no assignment at all before the deadline (which says nothing about
    whether one exists)."""


class _Timer:
    """One deadline (time.perf_counter() value) shared by every CBC call of a solve."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline

    def left(self) -> float:
        return max(0.5, self.deadline - time.perf_counter())


def solve_shelves(
    models: Sequence[ModelInput],
    *,
    max_shelves: int,
    deadline: float,
    goodput_rel_tol: float,
    require_all: bool,
) -> Assignment | None:
    """Best assignment of (choice, shelf) per model, or None if CBC finds none by the
    `deadline` (a time.perf_counter() value).

    `require_all`: every model must be placed (else the problem is infeasible and None is
    returned); otherwise models may be left out, the fewest (by weight) possible."""
    timer = _Timer(deadline)
    n = len(models)
    shelves_of = [range(min(max_shelves, i + 1)) for i in range(n)]
    if require_all:
        t_lo = max(min(c.latency_ms for c in m.choices) for m in models)
        t_hi = min(max(m.slo_ms - c.latency_ms for c in m.choices) for m in models)
    else:
        t_lo = min(min(c.latency_ms for c in m.choices) for m in models)
        t_hi = max(max(m.slo_ms - c.latency_ms for c in m.choices) for m in models)
    if t_hi < t_lo * (1 - 1e-9):
        return None
    u_lo, u_hi = 1.0 / t_hi, 1.0 / t_lo

    prob = pulp.LpProblem("dstack_shelves", pulp.LpMaximize)
    u = prob.add_variable("u", u_lo, u_hi)
    keys = [
        (i, j, k)
        for i, m in enumerate(models)
        for j in range(len(m.choices))
        for k in shelves_of[i]
    ]
    x = {key: prob.add_variable(f"x_{key[0]}_{key[1]}_{key[2]}", cat=pulp.LpBinary) for key in keys}
    z = {key: prob.add_variable(f"z_{key[0]}_{key[1]}_{key[2]}", 0, u_hi) for key in keys}
    n_shelves = min(max_shelves, n)
    e = [prob.add_variable(f"e_{k}", 0, 1) for k in range(n_shelves)]
    s = [prob.add_variable(f"s_{i}", 0, m.rate_rps) for i, m in enumerate(models)]
    on: list[pulp.LpAffineExpression | pulp.LpVariable] = []

    by_model: list[list[tuple[int, int, int]]] = [[] for _ in models]
    by_shelf: list[list[tuple[int, int, int]]] = [[] for _ in range(n_shelves)]
    for key in keys:
        by_model[key[0]].append(key)
        by_shelf[key[2]].append(key)

    for i, m in enumerate(models):
        mine = by_model[i]
        placed = pulp.lpSum(x[key] for key in mine)
        if require_all:
            prob += placed == 1
            prob += pulp.lpSum(z[key] for key in mine) == u
            on.append(placed)
        else:
            o = prob.add_variable(f"on_{i}", cat=pulp.LpBinary)
            prob += placed == o
            prob += pulp.lpSum(z[key] for key in mine) <= u
            prob += pulp.lpSum(z[key] for key in mine) >= u - u_hi * (1 - o)
            on.append(o)
        for key in mine:
            prob += z[key] <= u_hi * x[key]
            prob += z[key] >= u_lo * x[key]
        c_of = m.choices
        prob += (
            pulp.lpSum((m.slo_ms - c_of[j].latency_ms) * z[(i, j, k)] for (_, j, k) in mine)
            >= on[i]
        )
        prob += s[i] <= 1000.0 * pulp.lpSum(c_of[j].batch * z[(i, j, k)] for (_, j, k) in mine)
        for k in shelves_of[i]:
            prob += e[k] >= pulp.lpSum(c.latency_ms * z[(i, j, k)] for j, c in enumerate(c_of))
    for k in range(n_shelves):
        prob += (
            pulp.lpSum(models[i].choices[j].percent * x[(i, j, kk)] for (i, j, kk) in by_shelf[k])
            <= 100
        )
    prob += pulp.lpSum(e) <= 1
    share = (
        pulp.lpSum(
            models[i].choices[j].percent * models[i].choices[j].latency_ms * z[(i, j, k)]
            for (i, j, k) in keys
        )
        / 100.0
    )
    prob += share <= 1  # area: implied by the shelves, but a strong cut for the LP bound

    goodput = pulp.lpSum(m.weight * s[i] for i, m in enumerate(models))
    proven = True
    warm = False

    def run(objective: pulp.LpAffineExpression, sense: int) -> bool:
        nonlocal proven, warm
        prob.setObjective(objective)
        prob.sense = sense
        with warnings.catch_warnings():
            # PuLP 3 deprecates the bundled-CBC class for 4.0; it is the CBC we have.
            warnings.simplefilter("ignore", DeprecationWarning)
            solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=timer.left(), warmStart=warm)
        prob.solve(solver)
        if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            if prob.status != pulp.LpStatusInfeasible and time.perf_counter() >= timer.deadline:
                raise SolverTimeout("no assignment found before the time limit")
            return False
        proven = proven and prob.sol_status == pulp.LpSolutionOptimal
        warm = True
        return True

    if not require_all:
        placed_weight = pulp.lpSum(m.weight * on[i] for i, m in enumerate(models))
        if not run(placed_weight, pulp.LpMaximize):
            return None
        prob += placed_weight >= pulp.value(placed_weight) - 1e-6
    if not run(goodput, pulp.LpMaximize):
        return None
    best = pulp.value(goodput)
    prob += goodput >= best - goodput_rel_tol * max(1.0, abs(best))
    if not run(share, pulp.LpMinimize):
        return None

    picks: list[Choice | None] = [None] * n
    shelf: list[int | None] = [None] * n
    for (i, j, k), var in x.items():
        if (var.value() or 0.0) > 0.5:
            picks[i], shelf[i] = models[i].choices[j], k
    return Assignment(tuple(picks), tuple(shelf), proven)
