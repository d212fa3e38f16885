"""Lane plans: cut the device into lanes, share each lane in time, pick caps and widths.

Formulation (docs/optimizer.md, "Lane plans")
---------------------------------------------
Data. Models m with weight w_m (priority), SLO S_m (ms), planned rate r_m (rps), candidate
batch caps B_m, and a planning latency L_m(b, p) (ms): the profile's latency with a margin,
for batch b on a slice of p percent. Lane widths W (percent): on a CPU the core counts
(100 k / U), on a GPU the profiled MPS percentages; the device holds at most 100%.

A *lane* l = (M_l, p_l, b) is a set of models sharing a slice of width p_l in time, each
with a batch cap b_m. The runtime runs one batch at a time per lane, earliest deadline
first, work-conserving. When every model of the lane is saturated a round lasts

    R_l = sum_{m in M_l} L_m(b_m, p_l)

A request may arrive just after its model's batch started, wait for a round and run, so
its model meets its SLO when R_l + L_m(b_m, p_l) <= S_m; where that fails we credit the
fraction f_m = clamp((S_m - L_m) / R_l, 0, 1) of requests (a wait spread over the round).
Its throughput is at most 1000 b_m / R_l, so the predicted goodput of the lane is

    G_l = sum_m w_m f_m min(r_m, 1000 b_m / R_l)

A *lane plan* partitions the served models into lanes with sum_l p_l <= 100 and maximises
G = sum_l G_l, then (lexicographically) the robustness H = sum_l sum_m w_m min(f_m 1000
b_m / R_l, 2 r_m) (capacity beyond the planned rate, up to twice it, for bursts).

Search. For one (M, p) the caps come from a scan over the round target R*: every model
takes the largest cap with L_m(b, p) <= S_m - R*, then the model with the most surplus
(b_m against r_m R*) steps down until R_l <= R*. Over lanes: a set-partitioning MILP over
candidate lanes (`optimizer.lane_milp`; every subset at every width up to `EXACT_MAX`
models, the greedy's lanes and their neighbours above). The exact subset dynamic
programme (`Lanes.exact`: every set partition, widths as a multiple-choice knapsack in
units of the widths' common step) checks it in the tests; the greedy merges (`Lanes.greedy`)
give its candidates above `EXACT_MAX` models.
The spatial assignment (one lane per model, the `spatial` baseline's widths) and the
temporal assignment (one 100% lane, the `temporal` baseline's batches) are always scored
too, so the plan's predicted goodput is never below either.

A model whose batch-1 latency on the whole device exceeds its SLO cannot be served by
any plan: it is left out (the policy refuses its requests) and named with its numbers.
Under overload the search may also leave models out, as the ideal bound drops the
most expensive work, when that raises G by more than `DROP_GAIN`; and an overloaded
shared lane runs the models it serves below their demand (`capped`, in increasing cost
per request over weight) only when the lane has nothing else.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import reduce

from dstack.common.types import Profile

EXACT_MAX = 6  # models: up to this many, every subset is a candidate lane (2^6 - 1)
#: Wall-clock limit of one lane search (each CBC solve of it together).
SEARCH_TIME_LIMIT_S = 5.0
#: Models share a lane only for more than this predicted gain over the spatial assignment
#: (one lane each): a model alone in its lane never waits behind another model's batch,
#: which the scores (means at planned rates) do not price. On the real CPU mix a shared
#: 100% lane tied with spatial on paper and lost to it under a closed loop.
ISOLATION_GAIN = 0.01
EPS = 1e-9
#: The plan leaves models out only when that raises G by more than this share: a small
#: predicted gain is within the score's error (suite: a 0.8% predicted gain lost 2%).
DROP_GAIN = 0.01

Latency = Callable[[int, float], float]  # (batch, percent) -> ms


@dataclass(frozen=True, slots=True)
class LaneModel:
    name: str
    slo_ms: float
    rate_rps: float  # planned rate r_m
    weight: float
    batches: tuple[int, ...]  # candidate caps, ascending
    latency: Latency  # planning latency L(b, p) in ms
    low: bool = False  # low priority: runs only when the lane has nothing else
    grown_rps: float = 0.0  # r_m with the configured headroom (0: the same as r_m)
    #: workers of its model (replicas, `dstack.policies.replicas`): alone in a lane, a
    #: request waits for the first of them to be free, about R_l / workers
    workers: int = 1

    @property
    def grown(self) -> float:
        return max(self.grown_rps, self.rate_rps)


@dataclass(frozen=True, slots=True)
class LaneInstance:
    models: tuple[LaneModel, ...]
    widths: tuple[float, ...]  # allowed lane widths (percent), ascending
    capacity: float = 100.0


@dataclass(frozen=True, slots=True)
class LaneEval:
    """One lane, scored."""

    members: tuple[int, ...]  # model indices
    width: float
    caps: tuple[int, ...]
    lat_ms: tuple[float, ...]
    round_ms: float
    fraction: tuple[float, ...]  # f_m
    served_rps: tuple[float, ...]
    thr_rps: tuple[float, ...]
    value: float  # G_l
    robust: float  # H_l
    grown: float = 0.0  # G_l at the grown rates

    @property
    def key(self) -> tuple[float, float, float]:
        return (self.value, self.grown, self.robust)


@dataclass(frozen=True, slots=True)
class SearchStatus:
    """How the lane search went (`dstack plan` prints `describe()`)."""

    proven: bool  # CBC proved the plan optimal over its candidate lanes
    complete: bool  # every lane (subset x width) was a candidate: optimal over all plans
    gap: float  # CBC's relative gap to its bound when it stopped at the time limit
    candidates: int  # candidate lanes in the MILP

    @property
    def optimal(self) -> bool:
        return self.proven and self.complete

    def describe(self) -> str:
        if not self.proven and math.isinf(self.gap):
            return "the greedy plan: CBC found none within the time limit"
        if not self.proven:
            return (f"best found at the time limit, {100 * self.gap:.2f}% below CBC's "
                    f"bound over {self.candidates} candidate lanes")
        if self.complete:
            return f"optimal, MILP over all {self.candidates} lanes"
        return f"optimal over {self.candidates} candidate lanes, not over every lane"


@dataclass(frozen=True, slots=True)
class LaneChoice:
    """A scored lane plan over an instance."""

    lanes: tuple[LaneEval, ...]
    value: float
    robust: float
    source: str = ""  # "milp" | "greedy" | "spatial" | "temporal" ("exact": the DP)
    status: SearchStatus | None = None  # how the search that chose it went

    def dropped(self, n: int) -> tuple[int, ...]:
        """The models (of n) in no lane: left out to serve cheaper work."""
        placed = {i for e in self.lanes for i in e.members}
        return tuple(i for i in range(n) if i not in placed)

    @property
    def grown(self) -> float:
        return sum(e.grown for e in self.lanes)

    @property
    def key(self) -> tuple[float, float, float]:
        return (self.value, self.grown, self.robust)


# --------------------------------------------------------------------------- latency


def planning_latency(profile: Profile, *, margin: float = 0.10) -> Latency:
    """L(b, p) in ms for planning: the profile's p50 grown by `margin`, interpolated as the
    simulator does (`Profile.interpolated_ms`)."""
    cache: dict[tuple[int, float], float] = {}

    def lat(batch: int, percent: float) -> float:
        hit = cache.get((batch, percent))
        if hit is None:
            hit = cache[(batch, percent)] = (profile.interpolated_ms(batch, percent)
                                             * (1.0 + margin))
        return hit

    return lat


def candidate_batches(profile: Profile, max_batch: int) -> tuple[int, ...]:
    """Profiled batch sizes and powers of two up to `max_batch`, and `max_batch`."""
    out = {b for b in profile.batch_sizes if b <= max_batch}
    b = 1
    while b <= max_batch:
        out.add(b)
        b *= 2
    out.add(max_batch)
    return tuple(sorted(out))


# --------------------------------------------------------------------------- one lane


#: H's last term per percent of lane width: a plan that leaves part of the device idle
#: loses the tie to one that gives it to some lane.
WIDTH_TIE = 1e-3

#: A lane whose load at its planned rates is below this is scored by its load (below).
LOAD_AWARE_MAX = 0.9


def _load_aware(ms: Sequence[LaneModel], caps: Sequence[int], width: float,
                rates: Sequence[float]) -> list[tuple[float, float]]:
    """(fraction within SLO, throughput) per model of a lane, from its load.

    Each model runs batches n_m: from the smallest, the batch of the model whose growth
    cuts the lane's load U = sum_m r_m L_m(n_m) / n_m most grows (up to its cap) while
    U > LOAD_AWARE_MAX. Model k then holds the lane a share u_k = r_k L_k(n_k) / n_k of
    the time; a request of m that arrives during a batch of k (its own included) it
    cannot wait out, L_k(n_k) + L_m(n_m) > S_m, is late: f_m = 1 - sum of those u_k.
    Its throughput is what the others leave: 1000 n_m (1 - sum_{k != m} u_k) / L_m(n_m).
    A lane still over LOAD_AWARE_MAX at the caps: `_overloaded`."""
    idx = [0] * len(ms)
    lat = [m.latency(m.batches[0], width) for m in ms]
    bs = [m.batches[0] for m in ms]
    use = [r * lt / b / 1000.0 for r, lt, b in zip(rates, lat, bs, strict=True)]
    while sum(use) > LOAD_AWARE_MAX:
        best_k, best_cut = -1, 0.0
        for k, m in enumerate(ms):
            j = idx[k] + 1
            if j >= len(m.batches) or m.batches[j] > caps[k]:
                continue
            nb = m.batches[j]
            cut = use[k] - rates[k] * m.latency(nb, width) / nb / 1000.0
            if cut > best_cut:
                best_k, best_cut = k, cut
        if best_k < 0:
            return _overloaded(ms, lat, bs, use)
        k = best_k
        idx[k] += 1
        bs[k] = ms[k].batches[idx[k]]
        lat[k] = ms[k].latency(bs[k], width)
        use[k] = rates[k] * lat[k] / bs[k] / 1000.0
    return _shares(ms, lat, bs, use)


def _overloaded(ms: Sequence[LaneModel], lat: list[float], bs: list[int],
                use: list[float]) -> list[tuple[float, float]]:
    """A lane whose demand exceeds it even at the caps: earliest deadline first serves the
    light models' whole demand and the heavy ones share the rest (max-min fair shares of
    the lane's time, water-filled)."""
    share = [0.0] * len(ms)
    left, todo = 1.0, sorted(range(len(ms)), key=lambda k: use[k])
    while todo:
        even = left / len(todo)
        k = todo.pop(0)
        share[k] = min(use[k], even)
        left -= share[k]
    return _shares(ms, lat, bs, share)


def capped(ms: Sequence[LaneModel], caps: Sequence[int], width: float) -> tuple[int, ...]:
    """Positions (in `ms`) of the models an overloaded lane serves below their demand at
    its planned rates (`_overloaded`'s order): the policy runs them only when no other model
    of the lane has work. () when the lane is not overloaded or every model is short."""
    lat = [m.latency(b, width) for m, b in zip(ms, caps, strict=True)]
    use = [m.rate_rps * lt / b / 1000.0 for m, lt, b in zip(ms, lat, caps, strict=True)]
    if len(ms) < 2 or sum(use) <= 1.0:
        return ()
    left, short = 1.0, []
    for k in sorted(range(len(ms)), key=lambda k: (lat[k] / caps[k] / max(ms[k].weight, EPS), k)):
        if use[k] > left + EPS:
            short.append(k)
        left = max(0.0, left - use[k])
    return tuple(sorted(short)) if len(short) < len(ms) else ()


def _shares(ms: Sequence[LaneModel], lat: list[float], bs: list[int],
            use: list[float]) -> list[tuple[float, float]]:
    total = sum(use)
    out = []
    for k, m in enumerate(ms):
        late = sum(use[j] for j in range(len(ms)) if lat[j] + lat[k] > m.slo_ms + EPS)
        if lat[k] > m.slo_ms:
            late = 1.0
        thr = 1000.0 * bs[k] * (1.0 - (total - use[k])) / lat[k]
        out.append((min(1.0, max(0.0, 1.0 - late)), thr))
    return out


def score_lane(inst: LaneInstance, members: Sequence[int], width: float,
               caps: Sequence[int]) -> LaneEval:
    """G_l and H_l of the lane `members` on `width`% with batch caps `caps`: the
    saturated round bound, or where the lane is not saturated and it says more, its
    load-aware estimate (`_load_aware`)."""
    ms = [inst.models[i] for i in members]
    lat = [m.latency(b, width) for m, b in zip(ms, caps, strict=True)]
    rnd = sum(lat)
    frac, served, thr = [], [], []
    value = robust = grown = 0.0
    wait = rnd / ms[0].workers if len(ms) == 1 else rnd
    for m, b, lm in zip(ms, caps, lat, strict=True):
        f = min(1.0, max(0.0, (m.slo_ms - lm) / wait)) if rnd > 0 else 0.0
        t = 1000.0 * b / rnd if rnd > 0 else 0.0
        frac.append(f)
        thr.append(t)
        served.append(f * min(m.rate_rps, t))
    if len(ms) > 1 or frac[0] < 1.0:
        loads = _load_aware(ms, caps, width, [m.rate_rps for m in ms])
        if loads:
            alt = [f * min(m.rate_rps, t) for m, (f, t) in zip(ms, loads, strict=True)]
            if sum(m.weight * x for m, x in zip(ms, alt, strict=True)) > sum(
                    m.weight * x for m, x in zip(ms, served, strict=True)):
                served = alt
                frac = [f for f, _ in loads]
                thr = [t for _, t in loads]
    for m, f, t, s in zip(ms, frac, thr, served, strict=True):
        value += m.weight * s
        grown += m.weight * f * min(m.grown, t)
        robust += m.weight * min(f * t, 2.0 * m.grown)
    robust += WIDTH_TIE * width  # all else equal, leave no part of the device unused
    return LaneEval(tuple(members), width, tuple(caps), tuple(lat), rnd, tuple(frac),
                    tuple(served), tuple(thr), value, robust, grown)


def best_lane(inst: LaneInstance, members: Sequence[int], width: float) -> LaneEval:
    """The best caps for one lane by the scan over round targets R* (module docstring)."""
    ms = [inst.models[i] for i in members]
    tabs = [[m.latency(b, width) for b in m.batches] for m in ms]
    n = len(ms)
    lo = sum(t[0] for t in tabs)
    targets = {lo}
    for m, t in zip(ms, tabs, strict=True):
        targets.update(m.slo_ms - x for x in t if m.slo_ms - x > lo)
    best = score_lane(inst, members, width, [m.batches[0] for m in ms])
    seen = {best.caps}  # many targets give the same caps: each is scored once
    for rs in sorted(targets):
        idx = []
        for m, t in zip(ms, tabs, strict=True):
            j = bisect.bisect_right(t, m.slo_ms - rs + EPS) - 1
            idx.append(max(j, 0))
        total = sum(t[j] for t, j in zip(tabs, idx, strict=True))
        while total > rs + EPS:
            down = [k for k in range(n) if idx[k] > 0]
            if not down:
                break
            k = max(down, key=lambda k: ms[k].batches[idx[k]]
                    / max(ms[k].rate_rps * rs / 1000.0, 1e-9))
            total -= tabs[k][idx[k]] - tabs[k][idx[k] - 1]
            idx[k] -= 1
        caps = tuple(m.batches[j] for m, j in zip(ms, idx, strict=True))
        if caps in seen:
            continue
        seen.add(caps)
        ev = score_lane(inst, members, width, caps)
        if ev.key > best.key:
            best = ev
    return best


# --------------------------------------------------------------------------- lane plans


_State = tuple[tuple[float, float, float], list[LaneEval]]


class Lanes:
    """Memoised best lanes and the width knapsack over an instance."""

    def __init__(self, inst: LaneInstance, drop: bool = False) -> None:
        self.inst = inst
        self.drop = drop  # exact search may leave models out (overload)
        ints = [round(w * 1000) for w in inst.widths]
        self.step = reduce(math.gcd, ints + [round(inst.capacity * 1000)])
        self.units = {w: round(w * 1000) // self.step for w in inst.widths}
        self.cap_units = round(inst.capacity * 1000) // self.step
        self._memo: dict[tuple[int, float], LaneEval] = {}
        self._greedy: LaneChoice | None = None
        self._width_units = [(w, self.units[w]) for w in inst.widths]
        self._prefixes: dict[tuple[int, ...], dict[int, _State]] = {}  # `widths_for`

    def lane(self, mask: int, width: float) -> LaneEval:
        key = (mask, width)
        ev = self._memo.get(key)
        if ev is None:
            members = [i for i in range(len(self.inst.models)) if mask >> i & 1]
            ev = self._memo[key] = best_lane(self.inst, members, width)
        return ev

    def scored(self) -> tuple[LaneEval, ...]:
        """Every lane scored so far (the MILP's candidates above `EXACT_MAX` models)."""
        return tuple(self._memo.values())

    def widths_for(self, masks: Sequence[int]) -> _State:
        """Multiple-choice knapsack: one width per lane, total <= capacity, best key."""
        # states: units used -> (key, chosen lanes), after each prefix of `masks`: the
        # greedy's lists of lanes share most of their prefixes, so each is computed once.
        states: dict[int, _State] = {0: ((0.0, 0.0, 0.0), [])}
        prefix: tuple[int, ...] = ()
        for mask in masks:
            prefix += (mask,)
            nxt = self._prefixes.get(prefix)
            if nxt is None:
                nxt = self._prefixes[prefix] = self._add_lane(states, mask)
            states = nxt
        if not states:
            return (-math.inf, -math.inf, -math.inf), []
        return max(states.values(), key=lambda s: s[0])

    def _add_lane(self, states: dict[int, _State], mask: int) -> dict[int, _State]:
        """The knapsack's states with lane `mask` added at each width that fits."""
        nxt: dict[int, _State] = {}
        cap = self.cap_units
        row: dict[float, LaneEval] = {}  # a width's lane is scored when first taken
        for used, (key, chosen) in states.items():
            for w, units in self._width_units:
                u = used + units
                if u > cap:
                    continue
                ev = row.get(w)
                if ev is None:
                    ev = row[w] = self.lane(mask, w)
                k2 = (key[0] + ev.value, key[1] + ev.grown, key[2] + ev.robust)
                old = nxt.get(u)
                if old is None or k2 > old[0]:
                    nxt[u] = (k2, [*chosen, ev])
        return nxt

    def exact(self) -> LaneChoice:
        """Every set partition, widths by the knapsack: a subset DP over (mask, units)."""
        n = len(self.inst.models)
        full = (1 << n) - 1
        memo: dict[tuple[int, int], tuple[tuple[float, float, float], tuple[LaneEval, ...]]] = {}

        def go(mask: int, cap: int) -> tuple[tuple[float, float, float], tuple[LaneEval, ...]]:
            if mask == 0:
                return (0.0, 0.0, 0.0), ()
            hit = memo.get((mask, cap))
            if hit is not None:
                return hit
            low = mask & -mask
            rest = mask ^ low
            best: tuple[tuple[float, float, float], tuple[LaneEval, ...]] = (
                (-math.inf, -math.inf, -math.inf), ())
            sub = rest
            while True:
                lane_mask = sub | low
                for w in self.inst.widths:
                    u = self.units[w]
                    if u > cap:
                        continue
                    key, lanes = go(mask ^ lane_mask, cap - u)
                    if key[0] == -math.inf:
                        continue
                    ev = self.lane(lane_mask, w)
                    k2 = (key[0] + ev.value, key[1] + ev.grown, key[2] + ev.robust)
                    if k2 > best[0]:
                        best = (k2, (ev, *lanes))
                if sub == 0:
                    break
                sub = (sub - 1) & rest
            if self.drop:
                # Leave the lowest-numbered model out (served nothing, its width free).
                key, lanes = go(rest, cap)
                if key[0] > best[0][0] + EPS:
                    best = (key, lanes)
            memo[(mask, cap)] = best
            return best

        key, lanes = go(full, self.cap_units)
        return LaneChoice(lanes, key[0], key[2], "exact")

    def greedy_plan(self) -> LaneChoice:
        """`greedy()`, computed once."""
        if self._greedy is None:
            self._greedy = self.greedy()
        return self._greedy

    def greedy(self) -> LaneChoice:
        """One lane per model, then merge the pair of lanes that improves most, repeat."""
        n = len(self.inst.models)
        masks = [1 << i for i in range(n)]
        key, lanes = self.widths_for(masks)
        w0 = self.inst.widths[0]
        while key[0] == -math.inf and len(masks) > 1:
            # More lanes than the device holds at the narrowest width: merge the pair that
            # loses least at that width until the lanes fit.
            def loss(pair: tuple[int, int], ms: list[int] = masks) -> float:
                a, b = ms[pair[0]], ms[pair[1]]
                return (self.lane(a, w0).value + self.lane(b, w0).value
                        - self.lane(a | b, w0).value)
            a, b = min(((a, b) for a in range(len(masks)) for b in range(a + 1, len(masks))),
                       key=loss)
            masks = [m for k, m in enumerate(masks) if k not in (a, b)] + [masks[a] | masks[b]]
            key, lanes = self.widths_for(masks)
        while len(masks) > 1:
            best = None
            for a in range(len(masks)):
                for b in range(a + 1, len(masks)):
                    merged = [m for k, m in enumerate(masks) if k not in (a, b)]
                    merged.append(masks[a] | masks[b])
                    k2, l2 = self.widths_for(merged)
                    if k2 > key and (best is None or k2 > best[0]):
                        best = (k2, l2, merged)
            if best is None:
                break
            key, lanes, masks = best
        return LaneChoice(tuple(lanes), key[0], key[2], "greedy")


def choice_of(inst: LaneInstance,
              lanes: Sequence[tuple[Sequence[int], float, Sequence[int] | None]],
              source: str) -> LaneChoice:
    """Score a given assignment: (members, width, caps or None for the best caps)."""
    evs = []
    for members, width, caps in lanes:
        evs.append(best_lane(inst, members, width) if caps is None
                   else score_lane(inst, members, width, caps))
    return LaneChoice(tuple(evs), sum(e.value for e in evs), sum(e.robust for e in evs), source)


@dataclass(frozen=True, slots=True)
class Reference:
    """The baselines' assignments, scored as lane plans (None where not a lane plan)."""

    spatial: LaneChoice | None = None
    temporal: LaneChoice | None = None
    candidates: tuple[LaneChoice, ...] = field(default_factory=tuple)


def solve_lanes(inst: LaneInstance, *,
                spatial_widths: Sequence[float] | None = None,
                temporal_caps: Sequence[int] | None = None,
                exact_max: int = EXACT_MAX,
                drop: bool = True,
                time_limit_s: float = SEARCH_TIME_LIMIT_S) -> tuple[LaneChoice, Reference]:
    """The best lane plan found, and the scored baseline assignments it was compared with.

    `spatial_widths`: each model's own lane width under `spatial` (None: not expressible
    as lanes, e.g. more models than cores); `temporal_caps`: each model's batch under
    `temporal` on one 100% lane."""
    n = len(inst.models)
    if n == 0:
        return LaneChoice((), 0.0, 0.0, "empty"), Reference()
    # Imported here: lane_milp builds on this module's lanes and scores.
    from optimizer.lane_milp import search as milp_search

    lanes = Lanes(inst)
    t0 = time.perf_counter()
    search = milp_search(lanes, drop=drop, exact_max=exact_max, time_limit_s=time_limit_s)
    if drop and len(search.dropped(n)) > 0:
        # Leave models out only for more than DROP_GAIN over placing every one (the same
        # candidates, and what is left of the time limit).
        kept = milp_search(lanes, drop=False, exact_max=exact_max, neighbours=False,
                           time_limit_s=time_limit_s - (time.perf_counter() - t0))
        if search.value <= kept.value * (1.0 + DROP_GAIN) + EPS:
            search = kept
    spatial = temporal = None
    if spatial_widths is not None and sum(spatial_widths) <= inst.capacity + 1e-6:
        spatial = choice_of(inst, [((i,), w, None) for i, w in enumerate(spatial_widths)],
                            "spatial")
    if temporal_caps is not None:
        temporal = choice_of(inst, [(tuple(range(n)), inst.capacity, temporal_caps)],
                             "temporal")
    cands = [c for c in (search, spatial, temporal) if c is not None]
    best = max(cands, key=lambda c: c.key)
    if (spatial is not None and best is not spatial
            and best.value <= spatial.value * (1.0 + ISOLATION_GAIN) + EPS
            and best.grown <= spatial.grown * (1.0 + ISOLATION_GAIN) + EPS
            and (temporal is None or spatial.value >= temporal.value - EPS)):
        best = spatial
    if best.status is None:  # a baseline's assignment: the search's status still says
        best = replace(best, status=search.status)  # how far the search went
    return best, Reference(spatial, temporal, tuple(cands))


def set_partitions(items: Sequence[int]) -> list[list[list[int]]]:
    """Every partition of `items` into non-empty blocks (for brute force)."""
    if not items:
        return [[]]
    first, rest = items[0], items[1:]
    out = []
    for part in set_partitions(rest):
        out.append([[first], *part])
        for k in range(len(part)):
            out.append([*part[:k], [first, *part[k]], *part[k + 1:]])
    return out


def brute_force(inst: LaneInstance, drop: bool = True) -> float:
    """The best G over every set partition and every width per lane (tests, small n);
    with `drop`, a partition's blocks may also be left out, served nothing."""
    import itertools

    best = -math.inf
    n = len(inst.models)
    parts = [[b for b in part if b] for part in set_partitions(list(range(n)))]
    if drop:
        parts = [kept for kept_mask in range(1, 1 << n)
                 for kept in set_partitions([i for i in range(n) if kept_mask >> i & 1])]
    for part in parts:
        for ws in itertools.product(inst.widths, repeat=len(part)):
            if sum(ws) > inst.capacity + 1e-6:
                continue
            best = max(best, sum(best_lane(inst, block, w).value
                                 for block, w in zip(part, ws, strict=True)))
    return best
