"""`solve`: profiles + SLOs -> Plan. Prepares the data, calls the MILP, and turns the
chosen assignment into a Plan with exact numbers and plain-words shortfalls."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

from dstack.common.types import (
    ModelPlan,
    ModelSLO,
    Plan,
    Profile,
    ProfileError,
    Shortfall,
    SolverStatus,
)
from optimizer import heuristic
from optimizer.formulation import (
    Choice,
    ModelInput,
    SolveOptions,
    evaluate,
    model_input,
    prune,
    unplaceable_reason,
)
from optimizer.milp import SolverTimeout, solve_shelves

log = logging.getLogger(__name__)

#: Instances whose shelf MILP has more binaries than this are solved by the heuristic
#: alone (CBC would not prove them within seconds).
MILP_MAX_BINARIES = 400


def _rps(x: float) -> str:
    return f"{x:.0f}" if x >= 10 else f"{x:.2g}"


def rate_pair(served: float, expected: float) -> tuple[str, str]:
    """Two rates for people: whole numbers, unless rounding would make a shortfall look
    like none (23.7 of 24 shown as "24 of 24"); then one decimal."""
    a, b = _rps(served), _rps(expected)
    if a == b and served != expected:
        a, b = f"{served:.1f}", f"{expected:.1f}"
    return a, b


def solve(
    profiles: Mapping[str, Profile],
    slos: Sequence[ModelSLO],
    options: SolveOptions | None = None,
) -> Plan:
    """Choose batch, slice % and shelf per model, and the cycle (see the package docstring).

    Every model in `slos` needs a profile in `profiles` (ProfileError otherwise). Returns a
    Plan: OPTIMAL when every model gets its expected rate, PARTIAL when some fall short
    (each named in `shortfalls` with its numbers), INFEASIBLE when some model cannot be
    placed at all (named, with the reason); the plan for the other models is returned."""
    started = time.perf_counter()
    options = options or SolveOptions()
    names = [s.model for s in slos]
    if len(set(names)) != len(names):
        raise ValueError(f"a model appears twice in the SLOs: {names}")
    missing = [n for n in names if n not in profiles]
    if missing:
        raise ProfileError(f"no profile for {', '.join(missing)} (have {sorted(profiles)})")

    inputs = [model_input(profiles[s.model], s, options) for s in slos]
    shortfalls: list[Shortfall] = []
    alive: list[ModelInput] = []
    for m in inputs:
        reason = unplaceable_reason(m)
        if reason is None:
            alive.append(m)
        else:
            shortfalls.append(Shortfall(m.name, reason))

    picks: tuple[Choice | None, ...] = ()
    shelves: tuple[int | None, ...] = ()
    proven = True
    timed_out = False
    limit_s = options.time_limit_s
    if alive:
        # Loose pruning (any cycle at which at least one model fits) keeps every choice
        # that any plan, placing all models or not, can use.
        loose_lo = min(min(c.latency_ms for c in m.choices) for m in alive)
        loose = [prune(m, loose_lo) for m in alive]
        small = milp_size(loose, options.max_shelves) <= MILP_MAX_BINARIES
        if limit_s is None:
            limit_s = default_time_limit(len(alive), small)
        deadline = started + limit_s
        # The constructive plan first: the answer when the MILP is too large, and the
        # fallback when CBC stops at the time limit without a better plan.
        found = heuristic.search(loose, deadline)
        proven = False
        if small:
            try:
                exact = _milp(alive, options, deadline, limit_s)
            except SolverTimeout:
                exact, timed_out = None, True
            if exact is not None:
                milp_found, milp_proven = exact
                if milp_proven or heuristic.found_better(milp_found, found):
                    found, proven = milp_found, milp_proven
            elif not timed_out:
                # CBC proved that no model can be placed (heuristic agrees: it found none).
                proven = found is None
        if found is not None:
            picks, shelves = found.picks, found.shelves
            timed_out = False
        else:
            picks, shelves = (None,) * len(alive), (None,) * len(alive)
        alive = loose
        if not proven:
            log.info(
                "the plan is the best found within %.2f s, not proven optimal (%s)",
                limit_s,
                "CBC time limit" if small else "too large for the MILP: heuristic plan",
            )

    ev = evaluate(alive, picks, shelves) if any(p is not None for p in picks) else None
    model_plans: list[ModelPlan] = []
    if ev is not None:
        model_plans = _model_plans(alive, picks, shelves, ev.cycle_ms)
    for m, c in zip(alive, picks, strict=True):
        if c is None and timed_out:
            shortfalls.append(
                Shortfall(
                    m.name,
                    f"{m.name}: no plan found within the {limit_s:g} s time "
                    "limit (not proof that none exists); raise time_limit_s or lower "
                    "max_shelves",
                )
            )
        elif c is None:
            shortfalls.append(
                Shortfall(
                    m.name,
                    f"{m.name} cannot run in the same cycle as the models placed: no cycle "
                    f"is both short enough for every SLO and long enough to run every batch",
                )
            )
    infeasible = bool(shortfalls)
    for mp, m in zip(model_plans, [m for m, c in zip(alive, picks, strict=True) if c], strict=True):
        if mp.served_rps < mp.expected_rps * (1 - 1e-6):
            note = "" if m.rate_known else " (rate unknown: assumed its batch-1 capacity)"
            served, expected = rate_pair(mp.served_rps, mp.expected_rps)
            shortfalls.append(
                Shortfall(mp.model, f"{mp.model}: serves {served} rps of {expected} expected{note}")
            )
    if infeasible:
        status = SolverStatus.INFEASIBLE
    elif len(shortfalls) > 0:
        status = SolverStatus.PARTIAL
    else:
        status = SolverStatus.OPTIMAL
    return Plan(
        models=tuple(model_plans),
        cycle_ms=ev.cycle_ms if ev is not None else 0.0,
        objective=ev.goodput if ev is not None else 0.0,
        status=status,
        solve_time_s=time.perf_counter() - started,
        shortfalls=tuple(shortfalls),
        proven_optimal=proven,
    )


def default_time_limit(n_models: int, small: bool) -> float:
    """Seconds for a solve when `SolveOptions.time_limit_s` is None: CBC gets 10 s on
    instances small enough for the MILP (they take well under 1 s when the MILP is used
    at all); the heuristic's local search stops earlier by itself on larger ones."""
    return 10.0 if small else 1.0 + 0.1 * n_models


def _milp(
    alive: Sequence[ModelInput], options: SolveOptions, deadline: float, limit_s: float
) -> tuple[heuristic.Found, bool] | None:
    """The exact MILP: first with every model placed (strict pruning: T is then at least
    every model's fastest latency), else placing as many (by weight) as possible. None
    when CBC proves that nothing can be placed; SolverTimeout when it finds nothing in time."""
    shelves_cap = options.max_shelves or len(alive)
    t_lo = max(min(c.latency_ms for c in m.choices) for m in alive)
    strict = [prune(m, t_lo) for m in alive]
    got = None
    if all(m.choices for m in strict):
        got = solve_shelves(
            strict,
            max_shelves=shelves_cap,
            deadline=deadline,
            goodput_rel_tol=options.goodput_rel_tol,
            require_all=True,
        )
    if got is None:
        t_lo = min(min(c.latency_ms for c in m.choices) for m in alive)
        got = solve_shelves(
            [prune(m, t_lo) for m in alive],
            max_shelves=shelves_cap,
            deadline=deadline,
            goodput_rel_tol=options.goodput_rel_tol,
            require_all=False,
        )
    if got is None:
        return None
    found = heuristic.make_found(alive, got.picks, got.shelves)
    if found is None:
        return None
    if not got.proven_optimal:
        log.warning("CBC stopped at the %.1f s time limit before proving its plan optimal", limit_s)
    return found, got.proven_optimal


def milp_size(models: Sequence[ModelInput], max_shelves: int | None) -> int:
    """The number of binaries x[m, c, k] of the shelf MILP (model m may use shelves 0..m)."""
    cap = max_shelves or len(models)
    return sum(len(m.choices) * min(cap, i + 1) for i, m in enumerate(models))


def _model_plans(
    models: Sequence[ModelInput],
    picks: Sequence[Choice | None],
    shelves: Sequence[int | None],
    cycle_ms: float,
) -> list[ModelPlan]:
    """ModelPlans with shelf offsets: shelves in order of decreasing duration."""
    durations: dict[int, float] = {}
    for c, k in zip(picks, shelves, strict=True):
        if c is not None and k is not None:
            durations[k] = max(durations.get(k, 0.0), c.latency_ms)
    order = sorted(durations, key=lambda k: (-durations[k], k))
    offset: dict[int, float] = {}
    t = 0.0
    for k in order:
        offset[k] = t
        t += durations[k]
    out = []
    for m, c, k in zip(models, picks, shelves, strict=True):
        if c is None or k is None:
            continue
        thr = 1000.0 * c.batch / cycle_ms
        out.append(
            ModelPlan(
                model=m.name,
                batch=c.batch,
                percent=c.percent,
                latency_ms=c.latency_ms,
                throughput_rps=thr,
                expected_rps=m.rate_rps,
                served_rps=min(thr, m.rate_rps),
                slo_ms=m.slo_ms,
                offset_ms=offset[k],
            )
        )
    return out
