"""Rate-driven batch size (Zhang et al., IPDPSW 2019): `batching: rate`.

A batch of b items takes T(b) = k + t*b (`LinearLatency`, fitted online from the worker's
batches by the dispatch core). Requests arrive at c items/s. A batch of b fills in b/c
seconds; the device keeps up when the next batch has filled by the time the current one
ends, b/c >= k + t*b, and the smallest such batch is

    b* = k*c / (1 - t*c)        (t*c < 1; at t*c >= 1 no batch size keeps up).

Waiting for b* items and no longer is the least queueing that still keeps up: a smaller
batch falls behind, a larger one only waits longer. A request waits for its batch to fill
and then runs, so in steady state its latency is b*/c + T(b*) = 2*T(b*): the batch waited
for is capped at the largest b with T(b) <= slo / 2 (and at max_batch_size). A backlog
(more than b* queued when the worker comes free) goes out whole, up to max_batch_size, as
under the window: those requests are waiting already, and a larger batch clears them
sooner; the dispatch core still refuses a head that batch would answer late.

Pure, like the policies that call it: no clocks, no I/O. Plain Python (the compiled
`baselines` calls it once per model and decision).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dstack.policies.latency import LinearLatency

#: Time constant of the arrival-rate estimate (s): the weight of an arrival halves in
#: 0.69 tau. Short enough to follow a step in load within a second or two, long enough to
#: average a few hundred Poisson arrivals at the rates a CPU serves.
RATE_TAU_S = 1.0


@dataclass(slots=True)
class ArrivalRate:
    """Items/s arriving to one model, from the core's count of items admitted so far.

    An exponentially decayed count: every item adds 1/tau and the sum decays by
    exp(-dt/tau), which is an unbiased rate for Poisson arrivals once a few tau have
    passed (before that it is low, so batches start small). Items counted between two
    looks are taken as arriving at the second one (dt is a few ms; tau is 1 s)."""

    tau_s: float = RATE_TAU_S
    rps: float = 0.0
    _count: int = 0
    _t: float | None = None

    def update(self, now: float, arrived: int) -> float:
        """Take the core's cumulative count `arrived` at `now`; return the rate."""
        new = arrived - self._count
        if new < 0:  # a count that went back (a new core): start counting from it
            new = 0
        if self._t is not None and now > self._t:
            self.rps *= math.exp(-(now - self._t) / self.tau_s)
        self.rps += new / self.tau_s
        self._count = arrived
        if self._t is None or now > self._t:
            self._t = now
        return self.rps


@dataclass(frozen=True, slots=True)
class RateBatch:
    """What the rate rule says for one model now."""

    target: int  # b*, capped: launch once this many items are queued
    fill_s: float  # time `target` items take to arrive at the measured rate


def rate_batch(latency: LinearLatency | None, rate_rps: float, slo_s: float,
               max_batch: int) -> RateBatch | None:
    """b* for `rate_rps` under `latency`, capped by the SLO (T(b) <= slo/2) and by
    `max_batch`; None where the rule has nothing to go on (no estimate, no arrivals
    measured yet): the caller then uses the max-queue-delay window."""
    if latency is None or rate_rps <= 0:
        return None
    # Even one item over half the SLO: batches of one, the least a request can wait.
    cap = max(1, latency.max_batch_within(slo_s / 2, max_batch))
    busy = latency.t_s * rate_rps  # share of the device the per-item cost alone takes
    if busy >= 1:
        target = cap  # no batch keeps up: the largest the SLO allows
    else:
        b_star = latency.k_s * rate_rps / (1 - busy)
        target = min(cap, max(1, math.ceil(b_star - 1e-9)))
    return RateBatch(target, target / rate_rps)


__all__ = ["RATE_TAU_S", "ArrivalRate", "RateBatch", "rate_batch"]
