"""The data of one solve, and the pure functions around the MILP (no PuLP here).

Symbols (the full formulation is in `optimizer/__init__.py`):

- m: a model; w_m its priority weight; R_m its expected rate (rps); SLO_m its SLO (ms).
- c = (b, p): a candidate choice of batch size b and slice percent p; L_m(b, p) its
  profiled latency (ms).
- k: a shelf. Shelves run one after another inside the cycle; the models of a shelf start
  together at the shelf's start. D_k is the shelf's duration.
- T: the cycle (ms). Each model runs one batch per cycle.

This module prepares the candidate choices (dropping those that can never be part of a
feasible plan, and those dominated by another choice of the same model), explains models
that cannot meet their SLO at all, and evaluates a fixed assignment exactly: for a fixed
choice and shelf per model the best cycle is one of `cycle_candidates`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from dstack.common.types import ModelSLO, Profile, ProfileError

REL_TOL = 1e-9


@dataclass(frozen=True, slots=True)
class SolveOptions:
    """Restrictions and limits for `optimizer.solve`.

    `batch_sizes` / `percentages` restrict the candidates to these values (a percentage
    between profiled ones takes the latency of the next profiled one below it).
    `max_batch` caps the batch per model (e.g. the config's `max_batch_size`).
    `max_shelves` bounds the number of shelves (default: one per model, which is never a
    restriction). `time_limit_s` bounds the whole solve (None: `solve.default_time_limit`,
    scaled to the instance); the best plan found by then is returned, with
    `Plan.proven_optimal` False when it is not proven optimal.
    `goodput_rel_tol`: the second stage (least device share) may give up at most this
    fraction of the optimal weighted goodput.
    """

    batch_sizes: tuple[int, ...] | None = None
    percentages: tuple[float, ...] | None = None
    max_batch: dict[str, int] = field(default_factory=dict)
    max_shelves: int | None = None
    time_limit_s: float | None = None
    goodput_rel_tol: float = 1e-7


@dataclass(frozen=True, slots=True)
class Choice:
    batch: int
    percent: float
    latency_ms: float


@dataclass(frozen=True, slots=True)
class ModelInput:
    """One model as the solver sees it. `rate_rps` is the expected rate actually used
    (`rate_known` False: the SLO gave 0, and the rate assumed is the model's capacity at
    its smallest batch on its largest slice, run back to back)."""

    name: str
    slo_ms: float
    rate_rps: float
    rate_known: bool
    weight: float
    choices: tuple[Choice, ...]


@dataclass(frozen=True, slots=True)
class Unplaceable:
    model: str
    reason: str


def model_input(profile: Profile, slo: ModelSLO, options: SolveOptions) -> ModelInput:
    """The candidate choices of one model, before any pruning against other models.

    Raises ProfileError if the options leave the model no (batch, percent) at all."""
    name = slo.model
    batches = [b for b in profile.batch_sizes if b <= options.max_batch.get(name, 1 << 30)]
    if options.batch_sizes is not None:
        batches = [b for b in batches if b in options.batch_sizes]
    lowest = min(profile.percentages)
    percents = [float(p) for p in (options.percentages or profile.percentages)]
    percents = sorted({p for p in percents if lowest - 1e-9 <= p <= 100.0})
    if not batches or not percents:
        raise ProfileError(
            f"{name}: no batch size / slice left to choose from (profile has batches "
            f"{list(profile.batch_sizes)} and {list(profile.percentages)}%)"
        )
    choices = tuple(
        Choice(b, p, profile.latency_ms(b, p)) for b in sorted(batches) for p in percents
    )
    b0, p0 = min(batches), max(percents)
    if slo.rate_rps > 0:
        rate, known = float(slo.rate_rps), True
    else:
        rate, known = 1000.0 * b0 / profile.latency_ms(b0, p0), False
    return ModelInput(name, float(slo.slo_ms), rate, known, slo.priority.weight, choices)


def unplaceable_reason(m: ModelInput) -> str | None:
    """Why a model cannot meet its SLO under any cycle, or None.

    A batch of latency L runs once per cycle, and a request may arrive just after it
    started, so it waits up to T and then runs: T + L <= SLO, and T >= L (the batch fits
    in the cycle). So the model needs 2 * min L <= SLO."""
    b0 = min(c.batch for c in m.choices)
    p0 = max(c.percent for c in m.choices)
    first = next(c for c in m.choices if c.batch == b0 and c.percent == p0)
    fastest = min(c.latency_ms for c in m.choices)
    if first.latency_ms >= m.slo_ms:
        return (
            f"{m.name} needs {first.latency_ms:.1f} ms at batch {b0} on {p0:g}%; "
            f"its SLO is {m.slo_ms:g} ms"
        )
    if 2 * fastest > m.slo_ms * (1 + REL_TOL):
        return (
            f"{m.name} needs {fastest:.1f} ms at best, and a request may wait a whole cycle "
            f"(at least as long) before its batch starts: {2 * fastest:.1f} ms; "
            f"its SLO is {m.slo_ms:g} ms"
        )
    return None


def prune(m: ModelInput, cycle_lower_ms: float) -> ModelInput:
    """Keep the choices that can be part of a feasible plan and are not dominated.

    Infeasible: L > SLO - max(L, cycle_lower_ms), since T >= L and T >= cycle_lower_ms.
    Dominated: another choice has batch >= b, percent <= p and latency <= L (not worse in
    goodput, device share, shelf height or shelf length), one of them strictly."""
    ok = [
        c
        for c in m.choices
        if c.latency_ms + max(c.latency_ms, cycle_lower_ms) <= m.slo_ms * (1 + REL_TOL)
    ]
    kept: list[Choice] = []
    for c in ok:
        dominated = any(
            o.batch >= c.batch
            and o.percent <= c.percent
            and o.latency_ms <= c.latency_ms
            and (o.batch, o.percent, o.latency_ms) != (c.batch, c.percent, c.latency_ms)
            for o in ok
        )
        if not dominated and c not in kept:
            kept.append(c)
    return ModelInput(m.name, m.slo_ms, m.rate_rps, m.rate_known, m.weight, tuple(kept))


def cycle_candidates(
    makespan_ms: float, caps_ms: Iterable[float], saturation_ms: Iterable[float]
) -> tuple[float, ...]:
    """The cycles at which the best cycle of one fixed assignment can lie.

    For a fixed choice (b_m, p_m) and shelf per model, T must lie in [S, U] with
    S = sum_k D_k (the makespan: T >= it) and U = min_m (SLO_m - L_m) (the latency bound).
    On [S, U] the goodput G(T) = sum_m w_m * min(R_m, 1000 * b_m / T) is non-increasing
    and constant only while every model is saturated (T <= min_m 1000 * b_m / R_m, the
    `saturation_ms`), and the device share H(T) = sum_m p_m * L_m / T strictly decreases.
    So the lexicographic optimum is T* = min(U, max(S, min_m sat_m)): one of S, one cap or
    one saturation point. Returned: those of the given values inside [S, U], sorted;
    empty when S > U (no feasible cycle)."""
    caps = list(caps_ms)
    upper = min(caps) if caps else math.inf
    if makespan_ms > upper * (1 + REL_TOL):
        return ()
    values = {makespan_ms, *caps, *saturation_ms}
    inside = {v for v in values if makespan_ms <= v <= upper and math.isfinite(v)}
    return tuple(sorted(inside))


@dataclass(frozen=True, slots=True)
class Evaluation:
    cycle_ms: float
    goodput: float  # sum_m w_m * served_m, rps
    share: float  # sum_m p_m * L_m / T / 100: fraction of device-time used, in [0, 1]


def goodput_at(
    models: Sequence[ModelInput], picks: Sequence[Choice | None], cycle_ms: float
) -> float:
    return sum(
        m.weight * min(m.rate_rps, 1000.0 * c.batch / cycle_ms)
        for m, c in zip(models, picks, strict=True)
        if c is not None
    )


def share_at(picks: Sequence[Choice | None], cycle_ms: float) -> float:
    return sum(c.percent * c.latency_ms for c in picks if c is not None) / cycle_ms / 100.0


def better(a: Evaluation, b: Evaluation | None, rel_tol: float = 1e-9) -> bool:
    """Lexicographic: more goodput, then less device share."""
    if b is None:
        return True
    scale = max(1.0, abs(a.goodput), abs(b.goodput))
    if a.goodput > b.goodput + rel_tol * scale:
        return True
    if a.goodput < b.goodput - rel_tol * scale:
        return False
    return a.share < b.share - 1e-12


def evaluate(
    models: Sequence[ModelInput],
    picks: Sequence[Choice | None],
    shelves: Sequence[int | None],
) -> Evaluation | None:
    """Best cycle for a fixed assignment (None: no feasible cycle). `picks[i]` / `shelves[i]`
    is None for a model left out."""
    durations: dict[int, float] = {}
    heights: dict[int, float] = {}
    for c, k in zip(picks, shelves, strict=True):
        if c is not None and k is not None:
            durations[k] = max(durations.get(k, 0.0), c.latency_ms)
            heights[k] = heights.get(k, 0.0) + c.percent
    if any(h > 100.0 + 1e-9 for h in heights.values()):
        return None
    placed = [(m, c) for m, c in zip(models, picks, strict=True) if c is not None]
    if not placed:
        return None
    makespan = sum(durations.values())
    caps = [m.slo_ms - c.latency_ms for m, c in placed]
    sats = [1000.0 * c.batch / m.rate_rps for m, c in placed]
    best: Evaluation | None = None
    for t in cycle_candidates(makespan, caps, sats):
        if t <= 0:
            continue
        e = Evaluation(t, goodput_at(models, picks, t), share_at(picks, t))
        if better(e, best):
            best = e
    return best
