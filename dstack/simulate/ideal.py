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
from collections.abc import Mapping

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
