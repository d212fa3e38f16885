"""The solver against a brute-force enumerator on random small instances.

The enumerator knows nothing of the MILP: it tries every choice (or "left out") per model
and every partition of the placed models into shelves (restricted-growth strings), and for
each assignment every cycle in `optimizer.cycle_candidates` (the one shared definition;
`test_cycle_candidates_contain_the_best_cycle` checks that set against a dense grid).
"""

from __future__ import annotations

import itertools
import math
import random

import pytest

from dstack.common.types import Cell, DeviceInfo, ModelSLO, Priority, Profile, SolverStatus
from optimizer import cycle_candidates, pack, solve, validate_schedule

INSTANCES = 200
ALL_BATCHES = (1, 2, 4, 8, 16)
ALL_PERCENTS = (10.0, 25.0, 50.0, 75.0, 100.0)


def _profile(name: str, rng: random.Random, batches, percents) -> Profile:
    k0, t = rng.uniform(0.5, 3.0), rng.uniform(0.1, 1.0)
    knee, g = rng.uniform(20, 90), rng.uniform(0.5, 1.0)
    cells = tuple(
        Cell(b, p, lat, lat)
        for b in batches
        for p in percents
        for lat in [round((k0 + t * b) * max(1.0, knee / p) ** g, 2)]
    )
    return Profile(name, DeviceInfo("reference", "t", 80, "SMs"), "table", batches, percents, cells)


def random_instance(seed: int):
    rng = random.Random(seed)
    n = rng.choice((1, 2, 2, 3, 3, 3, 4))
    nb = rng.randint(1, 4 if n <= 2 else 2)
    np_ = rng.randint(1, 4 if n <= 2 else 3)
    profiles, slos = {}, []
    for i in range(n):
        batches = tuple(sorted(rng.sample(ALL_BATCHES, nb)))
        percents = tuple(sorted(rng.sample(ALL_PERCENTS, np_)))
        pr = _profile(f"m{i}", rng, batches, percents)
        profiles[pr.model] = pr
        fastest = min(c.p50_ms for c in pr.cells)
        slos.append(
            ModelSLO(
                pr.model,
                slo_ms=round(fastest * rng.uniform(1.5, 3 + 2 * n), 2),
                rate_rps=rng.choice((0.0, round(rng.uniform(20, 2000), 1))),
                priority=rng.choice(list(Priority)),
            )
        )
    return profiles, slos


def _rate(pr: Profile, slo: ModelSLO) -> float:
    if slo.rate_rps > 0:
        return slo.rate_rps
    b0 = min(pr.batch_sizes)
    return 1000.0 * b0 / pr.latency_ms(b0, max(pr.percentages))


def _partitions(n: int):
    """Restricted-growth strings: each partition of n items into blocks exactly once."""

    def rec(prefix: list[int], top: int):
        if len(prefix) == n:
            yield tuple(prefix)
            return
        for k in range(top + 2):
            yield from rec([*prefix, k], max(top, k))

    yield from rec([], -1)


def brute_force(profiles, slos):
    """Lexicographic best (placed weight, goodput, -share) over every assignment."""
    opts = []
    for s in slos:
        pr = profiles[s.model]
        opts.append([(b, p, pr.latency_ms(b, p)) for b in pr.batch_sizes for p in pr.percentages])
    rates = [_rate(profiles[s.model], s) for s in slos]
    weights = [s.priority.weight for s in slos]
    best = None
    n = len(slos)
    for placed in itertools.product((True, False), repeat=n):
        idx = [i for i in range(n) if placed[i]]
        if not idx:
            continue
        pw = sum(weights[i] for i in idx)
        if best is not None and pw < best[0] - 1e-12:
            continue
        for part in _partitions(len(idx)):
            for picks in itertools.product(*(opts[i] for i in idx)):
                heights: dict[int, float] = {}
                durs: dict[int, float] = {}
                for (_, p, lat), k in zip(picks, part, strict=True):
                    heights[k] = heights.get(k, 0) + p
                    durs[k] = max(durs.get(k, 0), lat)
                if max(heights.values()) > 100 + 1e-9:
                    continue
                caps = [slos[i].slo_ms - lat for i, (_, _, lat) in zip(idx, picks, strict=True)]
                sats = [1000.0 * b / rates[i] for i, (b, _, _) in zip(idx, picks, strict=True)]
                for t in cycle_candidates(sum(durs.values()), caps, sats):
                    g = sum(
                        weights[i] * min(rates[i], 1000.0 * b / t)
                        for i, (b, _, _) in zip(idx, picks, strict=True)
                    )
                    h = sum(p * lat for (_, p, lat) in picks) / t / 100
                    key = (pw, g, -h)
                    if best is None or _lex_better(key, best):
                        best = key
    return best


def _lex_better(a, b) -> bool:
    if not math.isclose(a[0], b[0], abs_tol=1e-12):
        return a[0] > b[0]
    if not math.isclose(a[1], b[1], rel_tol=1e-9, abs_tol=1e-9):
        return a[1] > b[1]
    return a[2] > b[2] + 1e-12


@pytest.mark.parametrize("block", range(10))
def test_solver_matches_brute_force(block: int) -> None:
    for seed in range(block * INSTANCES // 10, (block + 1) * INSTANCES // 10):
        profiles, slos = random_instance(seed)
        plan = solve(profiles, slos)
        expect = brute_force(profiles, slos)
        where = f"seed {seed}: {slos}"
        if expect is None:
            assert plan.status is SolverStatus.INFEASIBLE and not plan.models, where
            continue
        weights = {s.model: s.priority.weight for s in slos}
        placed_weight = sum(weights[m.model] for m in plan.models)
        assert placed_weight == pytest.approx(expect[0]), where
        assert plan.objective == pytest.approx(expect[1], rel=1e-6, abs=1e-6), where
        share = sum(m.percent * m.latency_ms for m in plan.models) / plan.cycle_ms / 100
        assert share <= -expect[2] + 1e-6, where
        # Realisable, and every model within its SLO under the cycle.
        assert validate_schedule(pack(plan), [m.model for m in plan.models]) == [], where
        for m in plan.models:
            assert plan.cycle_ms + m.latency_ms <= m.slo_ms * (1 + 1e-9), where
            assert m.latency_ms == profiles[m.model].latency_ms(m.batch, m.percent)


def test_cycle_candidates_contain_the_best_cycle() -> None:
    """For fixed assignments, no cycle on a dense grid of [S, U] beats the candidates."""
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 4)
        lat = [rng.uniform(1, 10) for _ in range(n)]
        batch = [rng.choice((1, 2, 4, 8)) for _ in range(n)]
        rate = [rng.uniform(50, 3000) for _ in range(n)]
        w = [rng.choice((0.25, 1.0, 4.0)) for _ in range(n)]
        pct = [rng.choice((10, 50, 100)) for _ in range(n)]
        makespan = sum(lat) * rng.uniform(0.4, 1.0)
        caps = [lat[i] * rng.uniform(1.5, 6) for i in range(n)]
        sats = [1000 * batch[i] / rate[i] for i in range(n)]
        cands = cycle_candidates(makespan, caps, sats)
        if makespan > min(caps):
            assert cands == ()
            continue

        def key(t: float, w=w, rate=rate, batch=batch, pct=pct, lat=lat) -> tuple[float, float]:
            g = sum(w[i] * min(rate[i], 1000 * batch[i] / t) for i in range(len(w)))
            return (round(g, 6), -sum(pct[i] * lat[i] for i in range(len(w))) / t)

        best = max(cands, key=key)
        lo, hi = makespan, min(caps)
        for j in range(401):
            t = lo + (hi - lo) * j / 400
            assert (
                key(t) <= key(best)
                or key(t)[0] == key(best)[0]
                and key(t)[1] <= key(best)[1] + 1e-9
            )
