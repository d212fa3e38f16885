"""Scheduling policies: pure objects, the clock passed in.

`decide(now, queues)` looks at the queues and the workers and returns which models should
start a batch now (and how many items at most) and when to look again. The asyncio
dispatcher (`dstack.runtime.serving`) applies decisions to real workers; the simulator applies the
very same objects on a virtual clock. Nothing here reads a clock, sleeps or does I/O.

| policy   | slices                 | when a model runs               | batch size            |
|----------|------------------------|---------------------------------|-----------------------|
| temporal | 100% to one at a time  | round robin                     | best under SLO @100%  |
| shared   | 100% each, concurrent  | whenever work is queued         | dynamic batching      |
| spatial  | knee %, scaled to fit  | whenever work is queued         | GSLICE adaptive       |
| dstack   | planned % (solver)     | its slots in the cycle + reuse  | from the solver       |

`shared` and `spatial` take a model's `batching`: `window` (above) or `rate`, b* from the
measured arrival rate (`dstack.policies.rate_batching`; the window until a rate is known).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import cython

from dstack.common.config import Batching, PolicyName
from dstack.common.slices import SliceBackend, SliceSpec
from dstack.common.types import Plan, Schedule
from dstack.policies.contract import Decision, Launch, ModelParams, Precedence, QueueView
from dstack.policies.latency import LinearLatency
from dstack.policies.rate_batching import ArrivalRate, RateBatch, rate_batch

# --------------------------------------------------------------------------- batch window


@cython.dataclasses.dataclass(frozen=True)
@cython.cclass
class TakeNow:
    n: cython.int


@cython.dataclasses.dataclass(frozen=True)
@cython.cclass
class WaitUntil:
    t: cython.double


def batch_window(
    now: float,
    items: int,
    head_arrival: float,
    head_deadline: float | None,
    cap: int,
    max_delay_s: float,
    latency: LinearLatency | None = None,
) -> TakeNow | WaitUntil:
    """Take a batch now or wait for more items (Ray Serve's rule, deadline-aware).

    The wait is timed from the first queued request; the batch is capped at `cap`; and
    the wait is cut short when waiting longer would make the oldest request miss its
    deadline given the predicted run time of the batch.
    """
    if items >= cap:
        return TakeNow(cap)
    until = head_arrival + max_delay_s
    if latency is not None and head_deadline is not None:
        until = min(until, head_deadline - latency.estimate_s(cap))
    if now >= until - 1e-9:
        return TakeNow(items)
    return WaitUntil(until)


def rate_window(now: float, items: int, head_arrival: float, head_deadline: float | None,
                cap: int, rb: RateBatch, latency: LinearLatency) -> TakeNow | WaitUntil:
    """Take a batch now or wait for more items (`batching: rate`).

    Once b* (`rb.target`) items are queued they go, with any backlog up to `cap`. Until
    then the oldest request waits for as long as b* items take to arrive at the measured
    rate (after a drop in load the measured rate lags, and this bounds the wait to what it
    promises), and never past the moment its deadline needs a batch of b* to start.
    """
    if items >= rb.target:
        return TakeNow(min(items, cap))
    until = head_arrival + rb.fill_s
    if head_deadline is not None:
        until = min(until, head_deadline - latency.estimate_s(rb.target))
    if now >= until - 1e-9:
        return TakeNow(items)
    return WaitUntil(until)


def _min_wake(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


# --------------------------------------------------------------------------- shared / spatial


@dataclass
class SharedPolicy:
    """Every model on the whole device at once; Triton-style dynamic batching."""

    models: dict[str, ModelParams]
    backend: SliceBackend
    latency: Mapping[str, LinearLatency] = field(default_factory=dict)
    name: PolicyName = PolicyName.SHARED
    # `batching: rate`: each such model's arrival rate, and what the rule said last.
    rates: dict[str, ArrivalRate] = field(default_factory=dict)
    rate_batches: dict[str, RateBatch] = field(default_factory=dict)
    concurrent = True  # (a class attribute, not a field)

    def window_cap(self, model: str) -> int:
        """The batch cap of the max-queue-delay window."""
        return self.models[model].max_batch

    def batch_cap(self, model: str) -> int:
        if model in self.rate_batches:  # b* is what it waits for; a backlog goes whole
            return self.models[model].max_batch
        return self.window_cap(model)

    def _rate_batch(self, now: float, q: QueueView) -> RateBatch | None:
        """`batching: rate`: measure the rate from the view, then b* (None: the window)."""
        p = self.models[q.model]
        rate = self.rates.get(q.model)
        if rate is None:
            rate = self.rates[q.model] = ArrivalRate()
        rb = rate_batch(self.latency.get(q.model), rate.update(now, q.arrived), p.slo_s,
                        p.max_batch)
        if rb is None:
            self.rate_batches.pop(q.model, None)
        else:
            self.rate_batches[q.model] = rb
        return rb

    def slices(self) -> dict[str, SliceSpec]:
        return {m: self.backend.whole() for m in self.models}

    def use_estimates(self, estimates: Mapping[str, LinearLatency]) -> None:
        self.latency = estimates

    def reanchor(self, now: float) -> None:
        return None

    def lane_mates(self, model: str) -> tuple[tuple[str, Precedence], ...]:
        return ()  # concurrent: admission counts each model's own queue only

    def unserved(self) -> Mapping[str, str]:
        return {}

    def decide(self, now: float, queues: Mapping[str, QueueView]) -> Decision:
        launches: list[Launch] = []
        wake: float | None = None
        for m, q in queues.items():
            p = self.models[m]
            rb = self._rate_batch(now, q) if p.batching is Batching.RATE else None
            if q.running or q.items == 0 or q.head_arrival is None:
                continue
            lat = self.latency.get(m)
            if rb is not None and lat is not None:
                w = rate_window(now, q.items, q.head_arrival, q.head_deadline, p.max_batch,
                                rb, lat)
            else:
                w = batch_window(now, q.items, q.head_arrival, q.head_deadline,
                                 self.window_cap(m), p.max_queue_delay_s, lat)
            if isinstance(w, TakeNow):
                launches.append(Launch(m, w.n))
            else:
                wake = _min_wake(wake, w.t)
        return Decision(tuple(launches), wake)

    def on_batch_done(self, model: str, n: int, compute_s: float, now: float) -> None:
        return None

    def plan(self) -> Plan | None:
        return None

    def schedule(self) -> Schedule | None:
        return None


@dataclass
class SpatialPolicy(SharedPolicy):
    """GSLICE-like: each model on its knee slice (scaled to fit), concurrently, with
    GSLICE's adaptive batch size (`batching: window`) or b* (`batching: rate`).

    Adaptive rule, applied after every batch: a request may wait for the batch before its
    own and then run, so a batch should take at most half the SLO. Over that, shrink by
    overflow / time-per-item; more than 10% under it, grow by headroom / time-per-item.
    """

    knees: dict[str, float] = field(default_factory=dict)
    batch: dict[str, int] = field(default_factory=dict)
    name: PolicyName = PolicyName.SPATIAL

    def __post_init__(self) -> None:
        for m in self.models:
            self.batch.setdefault(m, 1)

    def slices(self) -> dict[str, SliceSpec]:
        return self.backend.allocate({m: self.knees.get(m, 100.0) for m in self.models})

    def window_cap(self, model: str) -> int:
        return self.batch[model]

    def on_batch_done(self, model: str, n: int, compute_s: float, now: float) -> None:
        self.batch[model] = gslice_adapt(
            self.batch[model], n, compute_s, self.models[model].slo_s / 2,
            self.models[model].max_batch,
        )


def gslice_adapt(batch: int, n: int, compute_s: float, target_s: float, cap: int) -> int:
    """GSLICE's adaptive batching step (pure)."""
    per_item = compute_s / max(n, 1)
    if per_item <= 0:
        return batch
    if compute_s > target_s:
        return max(1, batch - math.ceil((compute_s - target_s) / per_item))
    if compute_s < 0.9 * target_s and n >= batch:  # only grow when the batch was full
        return min(cap, batch + math.floor((target_s - compute_s) / per_item))
    return batch


# --------------------------------------------------------------------------- temporal


@dataclass
class TemporalPolicy(SharedPolicy):
    """One model at a time on the whole device, round robin among those with work."""

    batch: dict[str, int] = field(default_factory=dict)
    name: PolicyName = PolicyName.TEMPORAL
    concurrent = False  # one model at a time
    _next: int = 0

    def batch_cap(self, model: str) -> int:
        return self.batch.get(model, self.models[model].max_batch)

    def lane_mates(self, model: str) -> tuple[tuple[str, Precedence], ...]:
        """Every other model's running batch: the device runs one batch at a time, so a
        request waits for the batch running, at least (round robin may put one more
        first; expiry in the queue is left to judge that). Without it, a request of
        mobilenet_v3_small (SLO 60 ms) that came while a batch of resnet18 ran longer
        than that was admitted, waited, and was refused `expired`: 70-86 of them in each
        3 s closed-loop smoke run, against 8-18 with it (docs/benchmarks.md)."""
        return tuple((m, Precedence.RUNNING) for m in self.models if m != model)

    def decide(self, now: float, queues: Mapping[str, QueueView]) -> Decision:
        if any(q.running for q in queues.values()):
            return Decision()  # the device is taken; a finished batch wakes us
        order = list(queues)
        wake: float | None = None
        for i in range(len(order)):
            m = order[(self._next + i) % len(order)]
            q = queues[m]
            if q.items == 0 or q.head_arrival is None:
                continue
            p = self.models[m]
            w = batch_window(now, q.items, q.head_arrival, q.head_deadline,
                             self.batch_cap(m), p.max_queue_delay_s, self.latency.get(m))
            if isinstance(w, TakeNow):
                self._next = (order.index(m) + 1) % len(order)
                return Decision((Launch(m, w.n),))
            wake = _min_wake(wake, w.t)
        return Decision((), wake)
