"""MIG advisor (MISO-style): the MIG layout, each model's instance and its batch size.

Formulation (docs/mig.md has it with an example)
-----------------------------------------------
Data. The served models m with SLO S_m, planned rate r_m, weight w_m, candidate batches
B_m and planning latency L_m(b, p) (the lane planner's: profile p50 + 10%, a percent
rounded down to a profiled one), peak memory M_m(b) (profile, interpolated) and a CUDA
context C per process. A GPU's instance kinds k (1g ... 7g) with K_k of the 7 compute
slices and a memory limit Mem_k; an instance of kind k is taken to run like an MPS slice
of p_k = 100 K_k / 7 percent. The valid layouts l (`mig_layouts.valid_layouts`) with
n_{l,k} instances of kind k.

Groups. A group g = (S, k) is a set S of at most `max_share` models time-sharing one
instance of kind k, one batch at a time, earliest deadline first: exactly a lane of the
lane planner (`optimizer.lanes`) of width p_k, so it is scored by the same function
(`best_lane`: caps, fraction within SLO, served rate; value v_g = sum_m w_m s_m). A model
alone on its instance is served min(r_m, 1000 b / L_m(b, p_k)) in full when
2 L_m(b, p_k) <= S_m (a request may arrive just after a batch started: it waits that
batch out, then runs), part of it for S_m / 2 < L < S_m. Memory: the batches a member may
use are cut so that sum_{m in S} (M_m(b_m) + C) <= Mem_k.

MILP (`optimizer.milp`, PuLP/CBC). z_c in {0,1} per distinct vector c of instance counts
over the layouts (layouts with the same counts score the same), y_g in {0,1} per group with v_g > 0:

    sum_c z_c = 1                                   one layout
    sum_{g of kind k} y_g <= sum_c n_{c,k} z_c       no more groups than instances of k
    sum_{g containing m} y_g <= 1                    a model runs on at most one instance
    max sum_g v_g y_g, then (lexicographically) the same at the grown rates, then the
    spare capacity H (as `optimizer.lanes`).

`brute_force` enumerates every layout and every assignment of models to its instances
(or to none) for the tests. A model whose batch-1 latency on 7g is not below its SLO, or
whose batch-1 memory and context exceed the largest instance, fits no instance: it is left
out and named with its numbers.
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from optimizer import milp
from optimizer.lanes import LaneEval, LaneInstance, LaneModel, best_lane
from optimizer.mig_layouts import Layout, MigGpu, MigProfile, valid_layouts

#: CUDA context and allocator overhead per process, beyond the profile's peak memory
#: (torch.cuda.max_memory_allocated does not count the context).
CONTEXT_MB = 512.0
#: At most this many models time-share one instance.
MAX_SHARE = 3
TOL = 1e-6


@dataclass(frozen=True, slots=True)
class MigModel:
    """A model as the advisor sees it: its lane-planner view and its memory curve."""

    lane: LaneModel
    memory_points: tuple[tuple[int, float], ...] = ()  # (batch, peak MB); () = unknown

    @property
    def name(self) -> str:
        return self.lane.name

    def memory_mb(self, batch: int) -> float:
        """Peak memory at `batch`: linear between profiled batches, extrapolated above the
        largest (never below its value), the smallest's below it; 0 when unknown."""
        pts = self.memory_points
        if not pts:
            return 0.0
        bs = [b for b, _ in pts]
        ys = [y for _, y in pts]
        if len(pts) == 1 or batch <= bs[0]:
            return ys[0] * (max(1.0, batch / bs[0]) if len(pts) == 1 else 1.0)
        i = min(bisect.bisect_left(bs, batch), len(bs) - 1)
        b0, b1, y0, y1 = bs[i - 1], bs[i], ys[i - 1], ys[i]
        y = y0 + (y1 - y0) * (batch - b0) / (b1 - b0)
        return max(y, ys[-1]) if batch > bs[-1] else y


@dataclass(frozen=True, slots=True)
class Group:
    """Models sharing one instance of `profile`, scored as a lane of its width."""

    members: tuple[int, ...]  # indices into the advisor's models
    profile: MigProfile
    eval: LaneEval  # caps, latencies, served rates, value (members in `members` order)
    memory_mb: float  # at the caps, contexts included

    @property
    def value(self) -> float:
        return self.eval.value


@dataclass(frozen=True, slots=True)
class MigChoice:
    layout: Layout
    groups: tuple[Group | None, ...]  # per instance of `layout`; None: idle
    value: float  # weighted goodput, rps
    grown: float
    robust: float
    unfit: tuple[tuple[int, str], ...]  # models that fit no instance, and why
    layouts: int  # valid layouts considered
    proven_optimal: bool = True
    solve_time_s: float = 0.0

    def placed(self) -> dict[int, tuple[int, Group]]:
        """model index -> (instance index in the layout, its group)."""
        return {m: (i, g) for i, g in enumerate(self.groups) if g for m in g.members}


class _Scorer:
    """Memoised group scores over one set of models on one GPU."""

    def __init__(self, models: Sequence[MigModel], gpu: MigGpu, context_mb: float) -> None:
        self.models = models
        self.gpu = gpu
        self.context_mb = context_mb
        self._memo: dict[tuple[tuple[int, ...], str], Group | None] = {}

    def group(self, members: tuple[int, ...], profile: MigProfile) -> Group | None:
        key = (members, profile.name)
        if key not in self._memo:
            self._memo[key] = self._score(members, profile)
        return self._memo[key]

    def _score(self, members: tuple[int, ...], profile: MigProfile) -> Group | None:
        ms = [self.models[i] for i in members]
        ctx = self.context_mb
        floor = [m.memory_mb(m.lane.batches[0]) + ctx for m in ms]
        if sum(floor) > profile.memory_mb:
            return None
        lanes = []
        for k, m in enumerate(ms):
            budget = profile.memory_mb - (sum(floor) - floor[k]) - ctx
            lanes.append(replace(m.lane, batches=tuple(
                b for b in m.lane.batches if m.memory_mb(b) <= budget + TOL)))
        width = self.gpu.percent(profile)
        while True:
            inst = LaneInstance(tuple(lanes), (width,))
            ev = best_lane(inst, list(range(len(lanes))), width)
            mem = [m.memory_mb(b) + ctx for m, b in zip(ms, ev.caps, strict=True)]
            if sum(mem) <= profile.memory_mb + TOL:
                return Group(members, profile, ev, sum(mem))
            # Together over the limit: the member using most memory gives up its largest cap.
            k = max((k for k in range(len(lanes)) if len(lanes[k].batches) > 1),
                    key=lambda k: mem[k], default=None)
            if k is None:
                return None
            lanes[k] = replace(lanes[k], batches=lanes[k].batches[:-1])


def unfit_reason(model: MigModel, gpu: MigGpu, *, extra: bool = False,
                 context_mb: float = CONTEXT_MB) -> str | None:
    """Why the model fits no instance of `gpu`, with the numbers; None if some may serve it."""
    full = max(gpu.profiles, key=lambda p: (p.compute, p.memory_gb))
    b0 = model.lane.batches[0]
    lat = model.lane.latency(b0, gpu.percent(full))
    if lat >= model.lane.slo_ms:
        return (f"{model.name}: batch {b0} takes {lat:.2f} ms on {full.name} (p50 + margin, "
                f"at 100% of the SMs); its SLO is {model.lane.slo_ms:g} ms: fits no MIG "
                f"instance")
    biggest = max((p for p in gpu.profiles if extra or not p.extra), key=lambda p: p.memory_gb)
    need = model.memory_mb(b0) + context_mb
    if need > biggest.memory_mb:
        return (f"{model.name}: needs {need:.0f} MB at batch {b0} ({model.memory_mb(b0):.0f} "
                f"MB peak + {context_mb:g} MB context); the largest instance, "
                f"{biggest.name}, holds {biggest.memory_mb:.0f} MB: fits no MIG instance")
    return None


def _counts(layout: Layout) -> tuple[tuple[str, int], ...]:
    out: dict[str, int] = {}
    for inst in layout:
        out[inst.profile.name] = out.get(inst.profile.name, 0) + 1
    return tuple(sorted(out.items()))


def candidate_groups(scorer: _Scorer, fit: Sequence[int], profiles: Sequence[MigProfile],
                     max_share: int) -> list[Group]:
    out = []
    for size in range(1, max_share + 1):
        for members in itertools.combinations(fit, size):
            for p in profiles:
                g = scorer.group(members, p)
                if g is not None and g.value > TOL:
                    out.append(g)
    return out


def advise(models: Sequence[MigModel], gpu: MigGpu, *, extra: bool = False,
           max_share: int = MAX_SHARE, context_mb: float = CONTEXT_MB,
           time_limit_s: float = 60.0) -> MigChoice:
    """The best layout of `gpu` and assignment of `models` to its instances (MILP)."""
    t0 = time.perf_counter()
    layouts = valid_layouts(gpu, extra=extra)
    profiles = [p for p in gpu.profiles if extra or not p.extra]
    scorer = _Scorer(models, gpu, context_mb)
    unfit = [(i, why) for i, m in enumerate(models)
             if (why := unfit_reason(m, gpu, extra=extra, context_mb=context_mb))]
    bad = {i for i, _ in unfit}
    fit = [i for i in range(len(models)) if i not in bad]
    groups = candidate_groups(scorer, fit, profiles, max_share)
    vectors = list(dict.fromkeys(_counts(lay) for lay in layouts))  # in layout order

    # Variables: z_c (c < nz), then y_g at nz + g.
    nz = len(vectors)
    rows = [milp.Row(tuple((c, 1.0) for c in range(nz)), 1.0, equal=True)]
    for p in profiles:
        rows.append(milp.Row(
            tuple((nz + j, 1.0) for j, g in enumerate(groups) if g.profile.name == p.name)
            + tuple((c, -float(dict(vec).get(p.name, 0))) for c, vec in enumerate(vectors)),
            0.0))
    for i in fit:
        mine = tuple((nz + j, 1.0) for j, g in enumerate(groups) if i in g.members)
        if mine:
            rows.append(milp.Row(mine, 1.0))
    zeros = [0.0] * nz
    stages = [zeros + [g.eval.value for g in groups], zeros + [g.eval.grown for g in groups],
              zeros + [g.eval.robust for g in groups]]
    try:
        sol = milp.maximise(nz + len(groups), rows, stages, time_limit_s=time_limit_s,
                            name="dstack_mig")
    except milp.NoSolution as e:
        raise RuntimeError(f"CBC found no MIG assignment ({e})") from e
    proven = sol.proven
    vec = vectors[next(c for c in sol.chosen if c < nz)]
    chosen = [groups[j - nz] for j in sol.chosen if j >= nz]
    layout = next(lay for lay in layouts if _counts(lay) == vec)
    return _realise(layout, chosen, tuple(unfit), len(layouts), proven,
                    time.perf_counter() - t0)


def _realise(layout: Layout, chosen: Sequence[Group], unfit: tuple[tuple[int, str], ...],
             n_layouts: int, proven: bool, solve_s: float) -> MigChoice:
    """Put each chosen group on an instance of its kind, best group on the first."""
    slots: list[Group | None] = [None] * len(layout)
    for g in sorted(chosen, key=lambda g: -g.value):
        i = next(i for i, inst in enumerate(layout)
                 if inst.profile.name == g.profile.name and slots[i] is None)
        slots[i] = g
    used = [g for g in slots if g]
    return MigChoice(layout, tuple(slots), sum(g.eval.value for g in used),
                     sum(g.eval.grown for g in used), sum(g.eval.robust for g in used),
                     unfit, n_layouts, proven, solve_s)


def brute_force(models: Sequence[MigModel], gpu: MigGpu, *, extra: bool = False,
                max_share: int = MAX_SHARE, context_mb: float = CONTEXT_MB) -> float:
    """The best weighted goodput over every layout and every assignment of the models
    that fit to its instances or to none (tests, a few models)."""
    scorer = _Scorer(models, gpu, context_mb)
    fit = [i for i, m in enumerate(models)
           if unfit_reason(m, gpu, extra=extra, context_mb=context_mb) is None]
    best = 0.0
    for layout in valid_layouts(gpu, extra=extra):
        for where in itertools.product(range(len(layout) + 1), repeat=len(fit)):
            on: dict[int, list[int]] = {}
            for m, i in zip(fit, where, strict=True):
                if i < len(layout):
                    on.setdefault(i, []).append(m)
            if any(len(ms) > max_share for ms in on.values()):
                continue
            total = 0.0
            for i, ms in on.items():
                g = scorer.group(tuple(ms), layout[i].profile)
                if g is None:
                    total = -math.inf
                    break
                total += g.value
            best = max(best, total)
    return best


def alone(models: Sequence[MigModel], gpu: MigGpu, *, extra: bool = False,
          context_mb: float = CONTEXT_MB) -> list[list[Group | None]]:
    """Each model alone on one instance of each kind: [model][profile] -> its group (caps,
    latency, served rate), None where it does not fit in the instance's memory."""
    scorer = _Scorer(models, gpu, context_mb)
    profiles = [p for p in gpu.profiles if extra or not p.extra]
    return [[scorer.group((i,), p) for p in profiles] for i in range(len(models))]
