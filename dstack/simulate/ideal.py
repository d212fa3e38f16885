"""The ideal bound: the goodput of a fluid scheduler over the same profiles and arrivals.

Formulation (an LP). For each model m let

    c_m = min { p/100 * L_m(b, p) / b : b in 1..max_batch_m, p a profiled percentage,
                                        L_m(b, p) <= SLO_m }

be its device-seconds per request at its most efficient configuration that can still meet
the SLO (L from `dstack.simulate.latency`, the same model the simulator runs; c_m = inf
when no configuration meets the SLO). With A_m the requests of model m that arrived in
[0, D) and H = D + max_m SLO_m the horizon in which any of them can be answered in time:

    maximise   sum_m x_m
    subject to 0 <= x_m <= A_m                  (no more than arrived)
               sum_m c_m * x_m <= H             (device-seconds available in the horizon)

and the bound is (sum_m x_m) / D requests per second. It is a fractional knapsack, so the
LP's optimum is the greedy one: fill models in increasing c_m. (With A_m = rate_m * D and
H = D it is the fluid bound for the nominal rates: `fluid_bound`.)

Why no policy beats it: a batch of n items on a p% slice needs L(n, p) seconds of solo
work and holds p% of the device while it progresses, so it consumes p/100 * L(n, p)
device-seconds however it is slowed by contention (the simulator's processor sharing is
work-conserving and never gives out more than 100%). If any item of it meets the SLO, then
L(n, p) <= SLO, so the batch consumes at least n * c_m. A slice between profiled
percentages runs at the speed of the one below it (so costs more per item), and one below
the smallest is work-conserving (same cost, longer latency). Every request answered within
its SLO completes by H, and the device has H device-seconds in [0, H].
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from dstack.common.types import Profile
from dstack.simulate.latency import latency_ms


def cost_per_request_s(profile: Profile, slo_ms: float, max_batch: int) -> float:
    """c_m of the module docstring (math.inf when nothing meets the SLO)."""
    best = math.inf
    for p in profile.percentages:
        for b in range(1, max_batch + 1):
            lat = latency_ms(profile, b, p)
            if lat <= slo_ms + 1e-9:
                best = min(best, p / 100 * lat / 1000 / b)
    return best


def ideal_goodput(costs: Mapping[str, float], arrived: Mapping[str, float],
                  capacity_s: float) -> dict[str, float]:
    """The LP's optimum x_m (requests served per model) by the greedy fill."""
    left = capacity_s
    out = {m: 0.0 for m in costs}
    for m in sorted(costs, key=lambda m: (costs[m], m)):
        c = costs[m]
        if not math.isfinite(c) or left <= 0:
            continue
        if c <= 0:
            out[m] = float(arrived[m])
            continue
        out[m] = min(float(arrived[m]), left / c)
        left -= out[m] * c
    return out


def ideal_bound_rps(costs: Mapping[str, float], arrived: Mapping[str, int], duration_s: float,
                    max_slo_s: float) -> float:
    """The bound in requests/s for arrivals `arrived` over [0, duration_s)."""
    x = ideal_goodput(costs, arrived, duration_s + max_slo_s)
    return sum(x.values()) / duration_s


def fluid_bound(costs: Mapping[str, float], rates: Mapping[str, float]) -> float:
    """The fluid scheduler's goodput (rps) at steady nominal rates."""
    return sum(ideal_goodput(costs, rates, 1.0).values())


# --------------------------------------------------------------------------- the trace bound
#
# The LP above charges every request its model's cheapest cost c_m, as if each batch of b
# found b requests waiting the moment it could start, and lets a burst borrow device time
# from the quiet seconds before and after it. Both are impossible within an SLO, and where
# SLOs are tight or load comes in bursts the LP is far above what any schedule can reach.
# The trace bound keeps the LP's argument and adds two facts about the arrivals
# (docs/simulator.md, "The trace bound", has the proof):
#
# 1. A request i answered within its SLO S ran in some batch of n items on p%, started at
#    s >= a_i and finished by a_i + S, so L(n, p) <= S. If k of that batch's items were
#    answered in time, all k arrived in [s - (S - L(n, p)), s]: a window of length
#    S - L(n, p) that holds a_i. With L^(k, p) = min over n >= k of L(n, p), the batch
#    costs p/100 L(n, p) >= k c_i, where
#        c_i = min { p/100 L^(k, p) / k : some window of length S - L^(k, p) holds a_i
#                                          and k arrivals of its model }.
#    So the on-time requests of a batch are charged no more than it consumed.
# 2. Requests arriving in [jT, (j+1)T) with SLOs <= s run all their batches inside
#    [jT, (j+1)T + s), and the device gives at most T + s device-seconds there.
#
# The bound is the fewest of: the LP with c_i over the whole run (horizon D + max SLO), and
# for each window length T in `WINDOWS_S`, the sum over windows of the best count subject
# to each SLO class's capacity. Each is a valid bound, so the least is.

#: Window lengths (s) tried by the time-windowed part of the trace bound.
WINDOWS_S = (0.25, 1.0, 4.0)


@dataclass(frozen=True, slots=True)
class TraceModel:
    """One model's arrivals for the trace bound: sorted times (s), SLO, profile, max batch."""

    times: np.ndarray
    slo_ms: float
    profile: Profile
    max_batch: int


def request_costs_s(times: np.ndarray, profile: Profile, slo_ms: float,
                    max_batch: int) -> np.ndarray:
    """c_i for each arrival in sorted `times` (fact 1 above); inf where none fits the SLO."""
    n = int(times.size)
    slo = slo_ms / 1000
    best = np.full(n, math.inf)
    floors = {}  # p -> L^(k, p) for k = 1..max_batch (s)
    for p in profile.percentages:
        row = [latency_ms(profile, b, p) / 1000 for b in range(1, max_batch + 1)]
        floors[p] = np.minimum.accumulate(row[::-1])[::-1]  # min over n >= k
    for k in range(1, min(max_batch, n) + 1):
        # (window S - L^, cost) of each slice that fits the SLO, widest window first
        opts = sorted(((slo - float(f[k - 1]), p / 100 * float(f[k - 1]) / k)
                       for p, f in floors.items() if f[k - 1] <= slo + 1e-12), reverse=True)
        if not opts:
            break  # L^ grows with k: no larger batch fits either
        if k == 1:
            best = np.minimum(best, min(c for _, c in opts))
            continue
        # the tightest span of k consecutive arrivals that includes arrival i
        span = times[k - 1:] - times[:n - k + 1]
        pad = np.concatenate([np.full(k - 1, np.inf), span, np.full(k - 1, np.inf)])
        tight = _sliding_min(pad, k)[:n]
        if not (tight <= opts[0][0] + 1e-9).any():
            break  # spans grow with k and windows shrink: no larger batch forms either
        # cheapest cost among the slices whose window is at least `tight`
        neg_w = np.array([-w - 1e-9 for w, _ in opts])  # ascending
        cheapest = np.minimum.accumulate(np.array([c for _, c in opts]))
        fits = np.searchsorted(neg_w, -tight, side="right")
        cost = np.where(fits > 0, cheapest[np.maximum(fits - 1, 0)], math.inf)
        best = np.minimum(best, cost)
    return best


def _sliding_min(a: np.ndarray, k: int) -> np.ndarray:
    """min(a[j:j+k]) for j = 0..len(a)-k, by doubling widths (O(len(a) log k))."""
    m, w = a, 1
    while 2 * w <= k:
        m = np.minimum(m[:-w], m[w:])  # width 2w
        w *= 2
    return np.minimum(m[:a.size - k + 1], m[k - w:])


def _most_within(costs: np.ndarray, capacity_s: float) -> float:
    """The fractional knapsack: how many of `costs` fit in `capacity_s`, cheapest first."""
    c = np.sort(costs[np.isfinite(costs)])
    cum = np.cumsum(c)
    whole = int(np.searchsorted(cum, capacity_s, side="right"))
    if whole >= c.size:
        return float(whole)
    left = capacity_s - (float(cum[whole - 1]) if whole else 0.0)
    return whole + left / float(c[whole])


def _most_within_each(win: np.ndarray, costs: np.ndarray, capacity_s: float,
                      n_windows: int) -> np.ndarray:
    """`_most_within` for every window at once: `win` (window of each item) and `costs`
    sorted by window, then cost; finite costs only. -> per window."""
    if win.size == 0:
        return np.zeros(n_windows)
    cum = np.cumsum(costs)
    first = np.flatnonzero(np.r_[True, win[1:] != win[:-1]])
    size = np.diff(np.r_[first, win.size])
    within = cum - np.repeat(cum[first] - costs[first], size)  # running sum in its window
    before = within - costs
    whole = np.bincount(win, weights=within <= capacity_s, minlength=n_windows)
    part = (within > capacity_s) & (before < capacity_s)  # at most one item a window
    frac = np.bincount(win[part], weights=(capacity_s - before[part]) / costs[part],
                       minlength=n_windows)
    return whole + frac


def trace_bound_rps(models: Sequence[TraceModel], duration_s: float,
                    windows_s: Sequence[float] = WINDOWS_S) -> float:
    """The trace bound in requests/s (the comment above): never above `ideal_bound_rps`."""
    if not models or duration_s <= 0:
        return 0.0
    costs = np.concatenate([request_costs_s(m.times, m.profile, m.slo_ms, m.max_batch)
                            for m in models])
    times = np.concatenate([m.times for m in models])
    slo = np.concatenate([np.full(m.times.size, m.slo_ms / 1000) for m in models])
    best = _most_within(costs, duration_s + float(slo.max(initial=0.0)))
    classes = sorted(set(slo.tolist()))
    for T in windows_s:
        win = np.floor(times / T).astype(np.int64)
        n_win = int(win.max(initial=-1)) + 1
        order = np.lexsort((costs, win))
        w, c, s = win[order], costs[order], slo[order]
        finite = np.isfinite(c)
        per_window = np.full(n_win, np.inf)
        for cl in classes:
            mine = s <= cl
            fit = _most_within_each(w[mine & finite], c[mine & finite], T + cl, n_win)
            rest = np.bincount(w[~mine], minlength=n_win)
            per_window = np.minimum(per_window, fit + rest)
        best = min(best, float(per_window.sum()))
    return best / duration_s
