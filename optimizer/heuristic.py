"""A fast constructive plan, without PuLP: the answer for instances too large for the
MILP, and the incumbent that the MILP's answer must beat on the small ones.

For a candidate cycle T and a number of shelves K, every shelf gets the same duration
D = T / K. A model m may then take any choice c with L_c <= D (it fits its shelf) and
L_c <= SLO_m - T (the latency bound); its value is w_m * min(R_m, 1000 * b_c / T), and
its width on the shelf is p_c. Models are dealt to the K shelves by their narrowest
choice (worst-fit decreasing, which leaves room on every shelf), and then each shelf is a
multiple-choice knapsack over sum p <= 100, solved exactly by a dynamic programme over the
reachable widths (most value, then the least device area p * L). The assignment is then
evaluated exactly (`formulation.evaluate`: the best cycle for it, which is often shorter
than T because shelves need only last as long as their longest member), and the best over
all (T, K) is improved by a local search that moves one model at a time to another choice
or shelf. Nothing here proves optimality.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from optimizer.formulation import REL_TOL, Choice, Evaluation, ModelInput, better, evaluate

#: At most this many candidate cycles are tried (spread evenly over the sorted set).
MAX_CYCLES = 48
#: Shelf counts tried per cycle: from the fewest that can hold the models' narrowest
#: choices to this many more.
EXTRA_SHELVES = 2


@dataclass(frozen=True, slots=True)
class Found:
    picks: tuple[Choice | None, ...]
    shelves: tuple[int | None, ...]
    evaluation: Evaluation
    placed_weight: float


def found_better(a: Found, b: Found | None) -> bool:
    """Lexicographic: more placed weight, then more goodput, then less device share."""
    if b is None:
        return True
    if not math.isclose(a.placed_weight, b.placed_weight, rel_tol=1e-12, abs_tol=1e-12):
        return a.placed_weight > b.placed_weight
    return better(a.evaluation, b.evaluation)


def make_found(
    models: Sequence[ModelInput],
    picks: Sequence[Choice | None],
    shelves: Sequence[int | None],
) -> Found | None:
    ev = evaluate(models, picks, shelves)
    if ev is None:
        return None
    weight = sum(m.weight for m, c in zip(models, picks, strict=True) if c is not None)
    return Found(tuple(picks), tuple(shelves), ev, weight)


def search(models: Sequence[ModelInput], deadline: float) -> Found | None:
    """The best assignment found by `deadline` (a time.perf_counter() value), or None
    when no model can be placed at any candidate cycle."""
    best: Found | None = None
    for t in _cycle_grid(models):
        tries = [_at_cycle(models, t, k) for k in _shelf_counts(models, t)]
        tries += [_by_latency(models, t, rule) for rule in _RULES]
        for f in tries:
            if f is not None and found_better(f, best):
                best = f
        if time.perf_counter() >= deadline:
            break
    if best is not None:
        best = polish(models, best, deadline)
    return best


def _cycle_grid(models: Sequence[ModelInput]) -> list[float]:
    """Caps SLO_m - L and saturation points 1000 b / R_m: where an optimal cycle lies
    (`cycle_candidates`), thinned to MAX_CYCLES values."""
    lo = min(min(c.latency_ms for c in m.choices) for m in models if m.choices)
    values: set[float] = set()
    for m in models:
        for c in m.choices:
            values.add(m.slo_ms - c.latency_ms)
            values.add(1000.0 * c.batch / m.rate_rps)
    grid = sorted(v for v in values if v >= lo * (1 - REL_TOL) and math.isfinite(v))
    if len(grid) > MAX_CYCLES:
        step = (len(grid) - 1) / (MAX_CYCLES - 1)
        grid = [grid[round(i * step)] for i in range(MAX_CYCLES)]
    return grid


def _shelf_counts(models: Sequence[ModelInput], cycle: float) -> list[int]:
    narrow = sum(min(c.percent for c in m.choices) for m in models if m.choices)
    first = max(1, math.ceil(narrow / 100.0 - 1e-9))
    return sorted({1, *range(first, min(len(models), first + EXTRA_SHELVES) + 1)})


#: How `_by_latency` picks each model's first choice: narrowest, fastest, least area.
_RULES = (
    lambda c: (c.percent, c.latency_ms),
    lambda c: (c.latency_ms, c.percent),
    lambda c: (c.percent * c.latency_ms, c.latency_ms),
)


def _by_latency(models: Sequence[ModelInput], cycle: float, rule) -> Found | None:
    """Shelves of unequal durations (first-fit decreasing by latency, each shelf as long
    as the model that opened it), then the per-shelf knapsack within those durations."""
    first: list[tuple[float, int, Choice]] = []
    for i, m in enumerate(models):
        ok = [c for c in m.choices if c.latency_ms <= (m.slo_ms - cycle) * (1 + REL_TOL)]
        ok = [c for c in ok if c.latency_ms <= cycle * (1 + REL_TOL)]
        if ok:
            c = min(ok, key=rule)
            first.append((c.latency_ms, i, c))
    first.sort(key=lambda t: (-t[0], -models[t[1]].weight))
    durations: list[float] = []
    load: list[float] = []
    members: list[list[int]] = []
    used = 0.0
    for lat, i, c in first:
        for k in range(len(durations)):
            if load[k] + c.percent <= 100.0 + 1e-9:
                load[k] += c.percent
                members[k].append(i)
                break
        else:
            if used + lat <= cycle * (1 + REL_TOL):
                used += lat
                durations.append(lat)
                load.append(c.percent)
                members.append([i])
    picks: list[Choice | None] = [None] * len(models)
    shelves: list[int | None] = [None] * len(models)
    for k, mine in enumerate(members):
        opts = [_options(models[i], cycle, durations[k]) for i in mine]
        if any(not o for o in opts):
            continue
        for i, c in zip(mine, _knapsack(opts), strict=True):
            picks[i], shelves[i] = c, k
    return make_found(models, picks, shelves)


def _options(
    m: ModelInput, cycle: float, duration: float
) -> list[tuple[float, float, float, Choice]]:
    """(value, percent, area, choice) for the choices that fit, without dominated ones
    (another with value >=, percent <= and area <=), sorted by percent."""
    limit = min(duration, m.slo_ms - cycle) * (1 + REL_TOL)
    raw = sorted(
        (
            (
                m.weight * min(m.rate_rps, 1000.0 * c.batch / cycle),
                c.percent,
                c.percent * c.latency_ms,
                c,
            )
            for c in m.choices
            if c.latency_ms <= limit
        ),
        key=lambda o: (o[1], -o[0], o[2]),
    )
    kept: list[tuple[float, float, float, Choice]] = []
    for o in raw:
        if not any(k[0] >= o[0] - 1e-12 and k[2] <= o[2] + 1e-12 for k in kept):
            kept.append(o)
    return kept


def _at_cycle(models: Sequence[ModelInput], cycle: float, n_shelves: int) -> Found | None:
    duration = cycle / n_shelves
    opts = [_options(m, cycle, duration) for m in models]
    order = sorted(
        (i for i in range(len(models)) if opts[i]),
        key=lambda i: (-models[i].weight, -opts[i][0][1]),
    )
    load = [0.0] * n_shelves
    members: list[list[int]] = [[] for _ in range(n_shelves)]
    for i in order:
        width = opts[i][0][1]
        k = min(range(n_shelves), key=lambda k: load[k])
        if load[k] + width > 100.0 + 1e-9:
            continue  # left out: the heavier models came first
        load[k] += width
        members[k].append(i)
    picks: list[Choice | None] = [None] * len(models)
    shelves: list[int | None] = [None] * len(models)
    for k, mine in enumerate(members):
        for i, c in zip(mine, _knapsack([opts[i] for i in mine]), strict=True):
            picks[i], shelves[i] = c, k
    return make_found(models, picks, shelves)


def _knapsack(items: Sequence[Sequence[tuple[float, float, float, Choice]]]) -> list[Choice]:
    """One option per item, sum of percents <= 100: most value, then least area. Exact
    (a DP over the reachable sums, keeping only states no other state dominates)."""
    # state: sum -> (value, area, picks); every item has an option that fits (its first).
    states: dict[float, tuple[float, float, tuple[Choice, ...]]] = {0.0: (0.0, 0.0, ())}
    for options in items:
        nxt: dict[float, tuple[float, float, tuple[Choice, ...]]] = {}
        for s, (v, a, ch) in states.items():
            for value, pct, area, c in options:
                s2 = round(s + pct, 9)
                if s2 > 100.0 + 1e-9:
                    break  # options are sorted by percent
                cand = (v + value, a + area, (*ch, c))
                old = nxt.get(s2)
                if old is None or (cand[0], -cand[1]) > (old[0], -old[1]):
                    nxt[s2] = cand
        states = {}
        top: tuple[float, float] | None = None
        for s in sorted(nxt):
            v, a, ch = nxt[s]
            if top is None or (v, -a) > top:
                states[s] = (v, a, ch)
                top = (v, -a)
    best = max(states.values(), key=lambda st: (st[0], -st[1]))
    return list(best[2])


def polish(models: Sequence[ModelInput], start: Found, deadline: float) -> Found:
    """First-improvement local search: one model to another choice and/or shelf (or a new
    shelf of its own; or placed, if it was left out), until no such move helps."""
    best = start
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        for i, m in enumerate(models):
            used = sorted({k for k in best.shelves if k is not None})
            targets = [*used, (max(used) + 1) if used else 0]
            for c in m.choices:
                for k in targets:
                    if best.picks[i] is c and best.shelves[i] == k:
                        continue
                    picks = list(best.picks)
                    shelves = list(best.shelves)
                    picks[i], shelves[i] = c, k
                    f = make_found(models, picks, shelves)
                    if f is not None and found_better(f, best):
                        best, improved = f, True
            if time.perf_counter() >= deadline:
                break
    return best
