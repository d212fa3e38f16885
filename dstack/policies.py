"""Scheduling policies: pure objects, the clock passed in.

`decide(now, queues)` looks at the queues and the workers and returns which models should
start a batch now (and how many items at most) and when to look again. The asyncio
dispatcher (`dstack.runtime`) applies decisions to real workers; the simulator applies the
very same objects on a virtual clock. Nothing here reads a clock, sleeps or does I/O.

| policy   | slices                 | when a model runs               | batch size            |
|----------|------------------------|---------------------------------|-----------------------|
| temporal | 100% to one at a time  | round robin                     | best under SLO @100%  |
| shared   | 100% each, concurrent  | whenever work is queued         | dynamic batching      |
| spatial  | knee %, scaled to fit  | whenever work is queued         | GSLICE adaptive       |
| dstack   | planned % (solver)     | its slots in the cycle + reuse  | from the solver       |
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from dstack.config import PolicyName
from dstack.latency import LinearLatency
from dstack.slices import SliceBackend, SliceSpec
from dstack.types import Plan, Schedule

# --------------------------------------------------------------------------- views & decisions


@dataclass(frozen=True, slots=True)
class QueueView:
    """One model's state as the policy sees it."""

    model: str
    items: int  # items waiting (a request may hold several)
    head_arrival: float | None  # arrival of the oldest waiting request
    head_deadline: float | None
    running: bool  # its worker is running a batch


@dataclass(frozen=True, slots=True)
class Launch:
    model: str
    max_items: int
    reuse: bool = False  # dstack: runs in idle capacity outside its own slot


@dataclass(frozen=True, slots=True)
class Decision:
    launches: tuple[Launch, ...] = ()
    wake_at: float | None = None  # look again at this time even if nothing happens


@dataclass(frozen=True, slots=True)
class ModelParams:
    """What a policy knows of a served model (times in seconds)."""

    name: str
    max_batch: int
    max_queue_delay_s: float
    slo_s: float


class Policy(Protocol):
    name: PolicyName

    def slices(self) -> dict[str, SliceSpec]:
        """The slice each model's worker is started in."""
        ...

    def decide(self, now: float, queues: Mapping[str, QueueView]) -> Decision: ...

    def on_batch_done(self, model: str, n: int, compute_s: float, now: float) -> None: ...

    def plan(self) -> Plan | None: ...

    def schedule(self) -> Schedule | None: ...


# --------------------------------------------------------------------------- batch window


@dataclass(frozen=True, slots=True)
class TakeNow:
    n: int


@dataclass(frozen=True, slots=True)
class WaitUntil:
    t: float


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
    latency: dict[str, LinearLatency] = field(default_factory=dict)
    name: PolicyName = PolicyName.SHARED

    def batch_cap(self, model: str) -> int:
        return self.models[model].max_batch

    def slices(self) -> dict[str, SliceSpec]:
        return {m: self.backend.whole() for m in self.models}

    def decide(self, now: float, queues: Mapping[str, QueueView]) -> Decision:
        launches: list[Launch] = []
        wake: float | None = None
        for m, q in queues.items():
            if q.running or q.items == 0 or q.head_arrival is None:
                continue
            p = self.models[m]
            w = batch_window(now, q.items, q.head_arrival, q.head_deadline,
                             self.batch_cap(m), p.max_queue_delay_s, self.latency.get(m))
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
    GSLICE's adaptive batch size.

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

    def batch_cap(self, model: str) -> int:
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
    _next: int = 0

    def batch_cap(self, model: str) -> int:
        return self.batch.get(model, self.models[model].max_batch)

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


# --------------------------------------------------------------------------- dstack


def _slot_index(s: _SlotT) -> int:
    return s.index


# Slack for skipping whole cycles or slots by bounds: far above the rounding of sums of a
# few seconds-scale floats, far below any slot length.
_MARGIN_S = 1e-6


@dataclass
class _Busy:
    model: str
    until: float
    percent: float
    units: frozenset[int]


@dataclass(frozen=True, slots=True)
class _SlotT:
    """A slot in seconds, with its units as a set: precomputed once per schedule, since
    `decide` runs on every event (the dispatcher's and the simulator's hot path)."""

    index: int
    model: str
    start_s: float
    dur_s: float
    percent: float
    units: frozenset[int]


@dataclass
class DStackPolicy:
    """Follow the spatio-temporal schedule; reuse idle capacity.

    Time is cut into cycles of `schedule.cycle_ms` starting at `origin`. Each slot
    occurrence belongs to its model: when it starts, the model launches up to its planned
    batch, and later in the slot another batch if it still ends within the slot. A slot
    whose model had nothing queued when it began is *forfeited* for that cycle: its
    capacity is idle. A model with queued work may also run outside its own slot (reuse)
    if, for the whole predicted run, its slice fits beside every other model's slot that
    is not idle and every batch already running (<= 100% and disjoint units): no other
    model loses any of its slot, so none is pushed past its bound. (A model whose slice
    no other slot shares thus runs whenever it has work, as under `spatial`, with its
    planned batch.)
    """

    models: dict[str, ModelParams]
    backend: SliceBackend
    the_plan: Plan
    the_schedule: Schedule
    origin: float
    latency: dict[str, LinearLatency] = field(default_factory=dict)
    reuse_idle: bool = True
    name: PolicyName = PolicyName.DSTACK
    # (slot index, cycle index) -> "used" | "forfeited"
    _occ: dict[tuple[int, int], str] = field(default_factory=dict)
    _busy: dict[str, _Busy] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._slots = tuple(
            _SlotT(i, s.model, s.start_ms / 1000, s.duration_ms / 1000, s.percent,
                   frozenset(s.units))
            for i, s in enumerate(self.the_schedule.slots)
        )
        self._own = {}
        for st in self._slots:
            self._own.setdefault(st.model, st)
        self._batch = {m.model: m.batch for m in self.the_plan.models}
        self._cycle_s = self.the_schedule.cycle_ms / 1000
        # Bounds of one cycle's slots (offsets from the cycle's start), so that `decide`,
        # `_next_start` and `_fits` skip whole cycles, and slots sorted by start, so that
        # they stop at the first slot starting too late. Both are only used to skip work
        # with a margin far above float rounding; every slot they keep gets the exact test.
        self._by_start = sorted(self._slots, key=lambda s: (s.start_s, s.index))
        self._starts = [s.start_s for s in self._by_start]
        if self._slots:
            self._lo_s = min(s.start_s for s in self._slots)
            self._hi_s = max(s.start_s + s.dur_s for s in self._slots)
            self._max_dur_s = max(s.dur_s for s in self._slots)
        else:
            self._lo_s = self._hi_s = self._max_dur_s = 0.0
        self._own_slots = {m: tuple(s for s in self._slots if s.model == m) for m in self._own}

    @property
    def cycle_s(self) -> float:
        return self._cycle_s

    def slices(self) -> dict[str, SliceSpec]:
        out: dict[str, SliceSpec] = {}
        for s in self.the_schedule.slots:
            out.setdefault(s.model, self.backend.slice_for(s.percent, s.units))
        return out

    def plan(self) -> Plan | None:
        return self.the_plan

    def schedule(self) -> Schedule | None:
        return self.the_schedule

    def _estimate(self, model: str, n: int) -> float:
        lat = self.latency.get(model)
        if lat is not None:
            return lat.estimate_s(n)
        return self.the_plan.for_model(model).latency_ms / 1000

    def decide(self, now: float, queues: Mapping[str, QueueView]) -> Decision:
        k_now = math.floor((now - self.origin) / self._cycle_s)
        for m in list(self._busy):
            if not queues[m].running:
                del self._busy[m]
        launches: list[Launch] = []
        t = now + 1e-9
        occ = self._occ
        # 1. Slot occurrences that have begun (this cycle and the last, for slots that
        #    straddle a cycle boundary).
        for k in (k_now - 1, k_now):
            base = self.origin + k * self._cycle_s
            if base + self._hi_s + _MARGIN_S <= now or base + self._lo_s - _MARGIN_S > now:
                continue  # no slot of cycle k contains `now`
            # The slots of cycle k containing `now`, in slot order.
            hits = []
            for s in self._by_start:
                start = base + s.start_s
                if start > t:
                    break  # sorted by start: every later one starts later still
                if t < start + s.dur_s:
                    hits.append(s)
            if len(hits) > 1:
                hits.sort(key=_slot_index)
            for s in hits:
                key = (s.index, k)
                state = occ.get(key)
                q = queues[s.model]
                if q.items == 0:
                    if state is None:
                        occ[key] = "forfeited"
                    continue
                if q.running or s.model in self._busy:
                    continue  # its batch is running; look again when it ends
                n = min(q.items, self._batch[s.model])
                end = now + self._estimate(s.model, n)
                # At the slot's start its planned batch goes. Later in the slot (work
                # arrived after the start, an earlier batch ended, or its own reuse batch
                # ran into the start): a batch if it ends within the slot and fits beside
                # what is running (a reuse batch may hold a forfeited slot's capacity).
                # (A first look may come late, the dispatcher being busy: it still takes
                # the planned batch. An occurrence its own reuse batch ran into is already
                # marked used by `_claim_own`.)
                if state is not None and (end > base + s.start_s + s.dur_s + 1e-9
                                          or not self._room_beside_busy(s, now)):
                    continue
                occ[key] = "used"
                launches.append(Launch(s.model, n))
                self._busy[s.model] = _Busy(s.model, end, s.percent, s.units)
        # 2. Reuse of idle capacity.
        if self.reuse_idle:
            busy = self._busy
            for m, q in queues.items():
                if q.items == 0 or q.running or m in busy:
                    continue
                n = min(q.items, self._batch[m])
                end = now + self._estimate(m, n)
                if self._fits(m, now, end, k_now):
                    mine = self._own[m]
                    self._claim_own(m, now, end, k_now)
                    launches.append(Launch(m, n, reuse=True))
                    self._busy[m] = _Busy(m, end, mine.percent, mine.units)
        # 3. Wake at the next slot start; forget occurrences older than the last cycle.
        if len(self._occ) > 4 * len(self._slots):
            self._occ = {key: v for key, v in self._occ.items() if key[1] >= k_now - 1}
        return Decision(tuple(launches), self._next_start(now, k_now))

    def _room_beside_busy(self, s: _SlotT, now: float) -> bool:
        load = s.percent
        for b in self._busy.values():
            if b.model != s.model and b.until > now:
                load += b.percent
                if s.units & b.units:
                    return False
        return load <= 100.0 + 1e-9

    def _next_start(self, now: float, k_now: int) -> float | None:
        # The earliest slot start after `now` in cycles k_now and k_now + 1 (as
        # the plain scan in the tests): base + offset is monotonic in the offset, so in each
        # cycle the sorted offsets give sorted starts and a bisection finds the first.
        t = now + 1e-9
        best: float | None = None
        for k in (k_now, k_now + 1):
            start = self._first_start_after(t, self.origin + k * self._cycle_s)
            if start is not None and (best is None or start < best):
                best = start
        return best

    def _first_start_after(self, t: float, base: float) -> float | None:
        starts = self._starts
        i = bisect.bisect_right(starts, t - base)
        while i > 0 and base + starts[i - 1] > t:  # the bisection's own rounding, both ways
            i -= 1
        while i < len(starts) and base + starts[i] <= t:
            i += 1
        return base + starts[i] if i < len(starts) else None

    def _overlapping(self, lo: float, hi: float, k_now: int):  # noqa: ANN202 - generator
        """(cycle k, slot, its start) for every slot occurrence overlapping (lo, hi)."""
        origin, cycle_s, starts = self.origin, self._cycle_s, self._starts
        k_lo = max(k_now - 1, math.floor((lo - origin - self._hi_s) / cycle_s) - 1)
        k_hi = math.floor((hi - origin - self._lo_s) / cycle_s) + 1
        for k in range(k_lo, k_hi + 1):
            base = origin + k * cycle_s
            if base + self._hi_s + _MARGIN_S <= lo or base + self._lo_s - _MARGIN_S >= hi:
                continue
            # Slots starting before lo - the longest duration end before lo: skip them.
            i = bisect.bisect_left(starts, lo - base - self._max_dur_s - _MARGIN_S)
            for s in self._by_start[i:]:
                start = base + s.start_s
                if start >= hi:
                    break  # sorted by start: every later slot starts later still
                if start + s.dur_s > lo:
                    yield k, s, start

    def _fits(self, model: str, t0: float, t1: float, k_now: int) -> bool:
        """May `model` run on its own slice during [t0, t1] beside the schedule?

        Its own slots are its capacity anyway. Every other slot occurrence overlapping the
        run counts against it unless it is idle (forfeited before t0, or used and its batch
        over), and so does every batch running now: together <= 100% and disjoint units.
        """
        mine = self._own[model]
        load = mine.percent
        units = mine.units
        occ, busy = self._occ, self._busy
        lo0 = t0 + 1e-9
        for k, s, start in self._overlapping(lo0, t1 - 1e-9, k_now):
            if s.model == model:
                continue
            state = occ.get((s.index, k))
            if state == "forfeited" and start <= lo0:
                continue
            if state == "used" and s.model not in busy:
                continue  # its batch already ended: the rest of the slot is idle
            load += s.percent
            if units & s.units:
                return False
        for b in busy.values():
            if b.model != model and b.until > t0:
                load += b.percent
                if units & b.units:
                    return False
        return load <= 100.0 + 1e-9

    def _claim_own(self, model: str, t0: float, t1: float, k_now: int) -> None:
        """A batch outside the slot start runs into its own slot occurrences: they are used
        (so they do not launch a second time as if fresh)."""
        for k, s, _ in self._overlapping(t0 + 1e-9, t1 - 1e-9, k_now):
            if s.model == model:
                self._occ.setdefault((s.index, k), "used")

    def on_batch_done(self, model: str, n: int, compute_s: float, now: float) -> None:
        self._busy.pop(model, None)


# --------------------------------------------------------------------------- factory


def make_policy(
    name: PolicyName,
    models: dict[str, ModelParams],
    backend: SliceBackend,
    *,
    plan: Plan | None = None,
    schedule: Schedule | None = None,
    knees: dict[str, float] | None = None,
    temporal_batch: dict[str, int] | None = None,
    origin: float = 0.0,
    reuse_idle: bool = True,
) -> Policy:
    if name is PolicyName.SHARED:
        return SharedPolicy(models, backend)
    if name is PolicyName.TEMPORAL:
        return TemporalPolicy(models, backend, batch=dict(temporal_batch or {}))
    if name is PolicyName.SPATIAL:
        return SpatialPolicy(models, backend, knees=dict(knees or {}))
    if name is PolicyName.DSTACK:
        if plan is None or schedule is None:
            raise ValueError("policy dstack needs a plan and a schedule")
        return DStackPolicy(models, backend, plan, schedule, origin, reuse_idle=reuse_idle)
    raise ValueError(f"unknown policy {name!r}")
