"""Replicas: more than one worker for a model that one worker cannot keep up with.

A model's cheapest way to serve a request is often a batch on a slice near its knee
(`docs/profiles.md`), but one worker there may serve fewer requests per second than
arrive. The ideal bound (docs/simulator.md) serves them at that cost anyway; a plan can do
the same only by running several copies of the model side by side, each on its own
slice, as Triton's `instance_group { count: N }` does.

Here a replica is an ordinary model to everything below the HTTP layer: `m`, `m#1`,
`m#2`, ... each with its own worker, queue, lane and latency estimate, and `1/R` of the
model's rate. The names cannot clash with served names (`#` is not allowed in one). The
dispatch core routes each request of `m` to the replica with the fewest items waiting, an
idle one first (`dstack.runtime.dispatch`), and counters are summed back per model.

How many: for each model with a known rate, each configuration (a batch b on a slice p)
needs R = ceil(r / (1000 b / L(b, p))) workers to carry the planned rate r, at most
`max_replicas` and what fits on the device (100 / p), and is SLO-safe when
L (1 + 1/R) <= SLO: a request waits for the first of the R workers to be free (about
L / R), then runs. Of the safe configurations, the one that serves the most of r, then
the cheapest per request, gives the model's R. The planner then scores the plan
with 1 to R workers for each such model (every combination, or fewer values when there
would be more than `MAX_COMBOS`) and keeps the best; more workers must predict more than
`REPLICA_GAIN` more goodput.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping

from dstack.common.config import DeployConfig
from dstack.common.types import Profile

SEP = "#"
#: Plans scored at start-up when choosing replica counts (2^k for k hot models, capped).
MAX_COMBOS = 16
#: More workers are chosen only for more than this predicted gain: each costs a process
#: and its memory, and the scores are means at planned rates (see optimizer.lanes).
REPLICA_GAIN = 0.02


def replica_names(model: str, count: int) -> tuple[str, ...]:
    """`m`, `m#1`, ..., `m#{count-1}`: the first replica keeps the model's own name."""
    return (model, *(f"{model}{SEP}{i}" for i in range(1, count)))


def replica_groups(counts: Mapping[str, int]) -> dict[str, tuple[str, ...]]:
    """Served model -> its workers' names, for models with more than one."""
    return {m: replica_names(m, r) for m, r in counts.items() if r > 1}


def public_name(name: str) -> str:
    """The served model a replica belongs to."""
    return name.split(SEP, 1)[0]


def expand(cfg: DeployConfig, counts: Mapping[str, int]) -> DeployConfig:
    """The config the workers and the dispatch core run: model m in `counts[m]` copies,
    each with its share of the configured rate."""
    if all(counts.get(m.name, 1) <= 1 for m in cfg.models):
        return cfg
    models = []
    for m in cfg.models:
        r = counts.get(m.name, 1)
        for name in replica_names(m.name, r):
            models.append(m.model_copy(update={"name": name, "zoo_name": m.zoo,
                                               "rate_rps": m.rate_rps / r}))
    return cfg.model_copy(update={"models": models})


def split_rates(rates: Mapping[str, float] | None,
                counts: Mapping[str, int]) -> dict[str, float] | None:
    """Rates per served model -> rates per replica (an even share each)."""
    if rates is None:
        return None
    out: dict[str, float] = {}
    for m, r in rates.items():
        n = counts.get(m, 1)
        for name in replica_names(m, n):
            out[name] = r / n
    return out


def wanted(cfg: DeployConfig, profiles: Mapping[str, Profile],
           min_percent: float = 0.0) -> dict[str, int]:
    """R per model (see the module docstring); 1 where the rate is unknown or one worker
    is enough. `min_percent`: the smallest slice a worker can have (one core's share on
    a CPU)."""
    grow = 1.0 + cfg.rate_headroom
    out: dict[str, int] = {}
    for m in cfg.models:
        prof = profiles[m.name]
        demand = grow * m.rate_rps
        best: tuple[float, float, int] | None = None  # (served rps, -device-ms a request, R)
        for p in prof.percentages:
            if p < min_percent - 1e-9:
                continue
            for b in prof.batch_sizes:
                lat = prof.latency_ms(b, p)
                if b > m.max_batch_size or lat >= m.slo_ms or demand <= 0:
                    continue
                thr = 1000.0 * b / lat
                r = min(math.ceil(demand / thr), int(100.0 / p + 1e-9), m.max_replicas)
                if lat * (1 + 1 / r) > m.slo_ms:
                    continue
                cand = (min(demand, r * thr), -p * lat / b, r)
                if best is None or cand > best:
                    best = cand
        out[m.name] = best[2] if best is not None else 1
    return out


def choose(cfg: DeployConfig, candidates: Mapping[str, int],
           score: Callable[[dict[str, int]], float]) -> dict[str, int]:
    """The replica counts (each model: 1 up to its candidate) whose plan scores highest;
    more workers win only by more than `REPLICA_GAIN`. `score(counts)` plans the
    expanded config."""
    hot = [m for m, r in candidates.items() if r > 1]
    ones = {m.name: 1 for m in cfg.models}
    if not hot:
        return ones
    choices = [range(1, candidates[m] + 1) for m in hot]
    if math.prod(len(c) for c in choices) > MAX_COMBOS:
        choices = [sorted({1, (candidates[m] + 1) // 2, candidates[m]}) for m in hot]
    if math.prod(len(c) for c in choices) > MAX_COMBOS:
        choices = [(1, candidates[m]) for m in hot]
    combos = sorted((dict(zip(hot, bits, strict=True)) for bits in itertools.product(*choices)),
                    key=lambda c: sum(c.values()))
    best, best_score = ones, -math.inf
    for combo in combos:
        counts = {**ones, **combo}
        got = score(counts)
        more = sum(counts.values()) > sum(best.values())
        if got > best_score * (1 + REPLICA_GAIN if more and best_score > 0 else 1):
            best, best_score = counts, got
    return best
