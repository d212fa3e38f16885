"""The `dstack` policy: follow the planned spatio-temporal schedule, reuse idle capacity.

`DStackPolicy` is the policy object (`dstack.policies.registry.make_policy` builds it); its state
and its decision are `SlotClock`, written for Cython (setup.py compiles this module):
`decide` runs on every event of the dispatcher and of the simulator.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Mapping

import cython

from dstack.common.config import PolicyName
from dstack.common.slices import SliceBackend, SliceSpec
from dstack.common.types import Plan, Schedule
from dstack.policies.contract import Decision, Launch, ModelParams, QueueView
from dstack.policies.latency import LinearLatency

# The dstack policy's schedule laid on the clock: which slot occurrences have been used or
# forfeited, which models have a batch running, and the decision that follows. Compiled,
# these are typed scans over a few dozen slots with no Python objects in the inner loops.
# Every test is the plain definition, a scan of every slot of every cycle that can matter.
#
# Slots are numbered in schedule order, models in the policy's order. Slot occurrence
# (slot i, cycle k) starts at origin + k * cycle + start(i). Its state is FREE (not looked
# at yet), USED (its model launched in it, or a batch of its model ran into it) or
# FORFEITED (its model had nothing queued when it was first looked at).

FREE = cython.declare(cython.int, 0)
USED = cython.declare(cython.int, 1)
FORFEITED = cython.declare(cython.int, 2)
_EPS = cython.declare(cython.double, 1e-9)  # times closer than this are the same instant
_INF = cython.declare(cython.double, math.inf)
_NO_CYCLE = cython.declare(cython.long, -(2**62))  # an empty row of the occupancy ring


@cython.cclass
class SlotClock:
    origin = cython.declare(cython.double, visibility="public")
    cycle_s = cython.declare(cython.double, visibility="readonly")
    n_slots = cython.declare(cython.int, visibility="readonly")
    n_models = cython.declare(cython.int, visibility="readonly")
    # Occupancy, a ring of cycles: row r holds cycle occ_cycle[r] (r = k mod rows), one
    # state per slot. Rows of cycles before k_live (the cycle before the latest decision's)
    # are never read again and are reused; a mark that would overwrite a live row doubles
    # the ring (a batch predicted to run over more cycles than it has).
    rows = cython.declare(cython.long, visibility="readonly")
    k_live: cython.long
    occ_cycle: cython.long[:]
    occ_state: cython.uchar[:]
    s_model: cython.int[:]
    s_start: cython.double[:]
    s_dur: cython.double[:]
    s_pct: cython.double[:]
    clash: cython.uchar[:]  # [i * n_slots + j]: slots i and j share a unit
    own: cython.int[:]  # model -> its first slot (its worker's slice), -1 if none
    batch: cython.int[:]  # model -> planned batch
    plan_s: cython.double[:]  # model -> planned latency, when no estimate is known
    busy: cython.uchar[:]  # model -> a batch this policy launched may still run
    busy_until: cython.double[:]
    busy_slot: cython.int[:]  # the slot whose percent and units the batch holds
    names: list
    index: dict  # model name -> model index
    items: cython.int[:]  # per model, from the queue views of the decision in progress
    running: cython.uchar[:]

    def __init__(self, names: list, slots: list, cycle_s: float, origin: float,
                 batch: list, plan_s: list) -> None:
        """`names`: the models; `slots`: (model, start s, duration s, percent, units) per
        slot; `batch` and `plan_s`: the planned batch and its latency per model."""
        n: cython.int = len(slots)
        n_models: cython.int = len(names)
        self.n_models = n_models
        self.names = list(names)
        self.index = {m: j for j, m in enumerate(names)}
        self.items = array("i", [0] * n_models)
        self.running = array("B", [0] * n_models)
        self.n_slots = n
        self.cycle_s = cycle_s
        self.origin = origin
        self.k_live = _NO_CYCLE + 1  # empty rows are never live
        self.rows = 0
        self._reset_ring(4)
        self.s_model = array("i", [self.index[s[0]] for s in slots])
        self.s_start = array("d", [s[1] for s in slots])
        self.s_dur = array("d", [s[2] for s in slots])
        self.s_pct = array("d", [s[3] for s in slots])
        units = [frozenset(s[4]) for s in slots]
        self.clash = array("B", [1 if units[i] & units[j] else 0
                                 for i in range(n) for j in range(n)])
        own = [-1] * n_models
        for i in range(n - 1, -1, -1):
            own[self.s_model[i]] = i
        self.own = array("i", own)
        self.batch = array("i", batch)
        self.plan_s = array("d", plan_s)
        self.busy = array("B", [0] * n_models)
        self.busy_until = array("d", [0.0] * n_models)
        self.busy_slot = array("i", [0] * n_models)

    # ------------------------------------------------------------------ state

    @cython.cfunc
    @cython.inline
    def cycle_of(self, t: cython.double) -> cython.long:
        x: cython.double = (t - self.origin) / self.cycle_s
        k: cython.long = cython.cast(cython.long, x)  # math.floor, without a Python int
        return k - 1 if k > x else k

    @cython.cfunc
    @cython.inline
    def _state(self, i: cython.int, k: cython.long) -> cython.int:
        r: cython.long = k % self.rows
        if self.occ_cycle[r] != k:
            return FREE
        return self.occ_state[r * self.n_slots + i]

    @cython.cfunc
    def _mark(self, i: cython.int, k: cython.long, st: cython.int) -> cython.void:
        ns: cython.int = self.n_slots
        r: cython.long = k % self.rows
        j: cython.int
        while self.occ_cycle[r] != k and self.occ_cycle[r] >= self.k_live:
            self._reset_ring(2 * self.rows)
            r = k % self.rows
        if self.occ_cycle[r] != k:
            self.occ_cycle[r] = k
            for j in range(ns):
                self.occ_state[r * ns + j] = FREE
        self.occ_state[r * ns + i] = st

    def _reset_ring(self, rows: int) -> None:
        """A ring of `rows` cycles holding every live row of the current one."""
        ns = self.n_slots
        live = {}
        for r in range(self.rows):
            k = self.occ_cycle[r]
            if k >= self.k_live:
                live[k] = [self.occ_state[r * ns + i] for i in range(ns)]
        cycles = array("l", [_NO_CYCLE] * rows)
        states = array("B", [FREE] * (rows * ns))
        for k, row in live.items():
            cycles[k % rows] = k
            states[(k % rows) * ns:(k % rows + 1) * ns] = array("B", row)
        self.rows = rows
        self.occ_cycle = cycles
        self.occ_state = states

    def done(self, model: str) -> None:
        """The model's batch ended."""
        self.busy[self.index[model]] = 0

    @cython.cfunc
    def _hold(self, m: cython.int, until: cython.double, slot: cython.int) -> cython.void:
        self.busy[m] = 1
        self.busy_until[m] = until
        self.busy_slot[m] = slot

    # ------------------------------------------------------------------ scans

    @cython.ccall
    def next_start(self, now: cython.double) -> cython.double:
        """The earliest slot start after `now` in its cycle or the next (inf if none)."""
        t: cython.double = now + _EPS
        best: cython.double = _INF
        k: cython.long
        i: cython.int
        start: cython.double
        k0: cython.long = self.cycle_of(now)
        for k in range(k0, k0 + 2):
            base: cython.double = self.origin + k * self.cycle_s
            for i in range(self.n_slots):
                start = base + self.s_start[i]
                if t < start < best:
                    best = start
        return best

    @cython.ccall
    def fits(self, m: cython.int, t0: cython.double, t1: cython.double) -> cython.bint:
        """May model m run on its own slice during [t0, t1] beside the schedule?

        Its own slots are its capacity anyway. Every other slot occurrence overlapping the
        run counts against it unless it is idle (forfeited before t0, or used and its
        batch over), and so does every batch running now: together <= 100% and disjoint
        units."""
        mine: cython.int = self.own[m]
        if mine < 0:
            return False
        ns: cython.int = self.n_slots
        load: cython.double = self.s_pct[mine]
        lo: cython.double = t0 + _EPS
        hi: cython.double = t1 - _EPS
        k: cython.long
        i: cython.int
        j: cython.int
        st: cython.int
        start: cython.double
        for k in range(self.cycle_of(t0) - 1, self.cycle_of(t1) + 2):
            base: cython.double = self.origin + k * self.cycle_s
            for i in range(ns):
                start = base + self.s_start[i]
                if start + self.s_dur[i] <= lo or start >= hi or self.s_model[i] == m:
                    continue
                st = self._state(i, k)
                if st == FORFEITED and start <= lo:
                    continue
                if st == USED and not self.busy[self.s_model[i]]:
                    continue  # its batch already ended: the rest of the slot is idle
                load += self.s_pct[i]
                if self.clash[mine * ns + i]:
                    return False
        for j in range(self.n_models):
            if j != m and self.busy[j] and self.busy_until[j] > t0:
                load += self.s_pct[self.busy_slot[j]]
                if self.clash[mine * ns + self.busy_slot[j]]:
                    return False
        return load <= 100.0 + _EPS

    @cython.cfunc
    def _claim_own(self, m: cython.int, t0: cython.double, t1: cython.double) -> cython.void:
        """A batch outside the slot start runs into its own slot occurrences: they are used
        (so they do not launch a second time as if fresh)."""
        lo: cython.double = t0 + _EPS
        hi: cython.double = t1 - _EPS
        k: cython.long
        i: cython.int
        start: cython.double
        for k in range(self.cycle_of(t0) - 1, self.cycle_of(t1) + 2):
            base: cython.double = self.origin + k * self.cycle_s
            for i in range(self.n_slots):
                start = base + self.s_start[i]
                if (self.s_model[i] == m and start + self.s_dur[i] > lo and start < hi
                        and self._state(i, k) == FREE):
                    self._mark(i, k, USED)

    @cython.cfunc
    def _room_beside_busy(self, i: cython.int, now: cython.double) -> cython.bint:
        load: cython.double = self.s_pct[i]
        j: cython.int
        m: cython.int = self.s_model[i]
        for j in range(self.n_models):
            if j != m and self.busy[j] and self.busy_until[j] > now:
                load += self.s_pct[self.busy_slot[j]]
                if self.clash[i * self.n_slots + self.busy_slot[j]]:
                    return False
        return load <= 100.0 + _EPS

    @cython.cfunc
    def _estimate(self, lat: dict, m: cython.int, n: cython.int) -> cython.double:
        e = lat.get(self.names[m])
        if e is None:
            return self.plan_s[m]
        return e.estimate_s(n)

    # ------------------------------------------------------------------ the decision

    @cython.ccall
    def decide(self, now: cython.double, queues: object, lat: dict,
               reuse_idle: cython.bint) -> Decision:
        """`queues`: model name -> QueueView; `lat`: model name -> latency estimate, where
        one is known."""
        launches: list = []
        q: QueueView
        items: cython.int[:] = self.items
        running: cython.uchar[:] = self.running
        ns: cython.int = self.n_slots
        t: cython.double = now + _EPS
        k_now: cython.long = self.cycle_of(now)
        if k_now - 1 > self.k_live:
            self.k_live = k_now - 1  # rows of earlier cycles are never read again
        k: cython.long
        i: cython.int
        m: cython.int
        n: cython.int
        st: cython.int
        start: cython.double
        end: cython.double
        for m in range(self.n_models):
            items[m] = 0
            running[m] = 0
        m = 0
        for name, q in queues.items():
            # The views come in the policy's order (the dispatcher's and the simulator's
            # do); any other order is looked up.
            if m >= self.n_models or name != self.names[m]:
                m = self.index[name]
            items[m] = q.items
            running[m] = q.running
            m += 1
        for m in range(self.n_models):
            if self.busy[m] and not running[m]:
                self.busy[m] = 0
        # 1. Slot occurrences that have begun (this cycle and the last, for slots that
        #    straddle a cycle boundary), in slot order.
        for k in range(k_now - 1, k_now + 1):
            base: cython.double = self.origin + k * self.cycle_s
            for i in range(ns):
                start = base + self.s_start[i]
                if start > t or t >= start + self.s_dur[i]:
                    continue
                m = self.s_model[i]
                st = self._state(i, k)
                if items[m] == 0:
                    if st == FREE:
                        self._mark(i, k, FORFEITED)
                    continue
                if running[m] or self.busy[m]:
                    continue  # its batch is running; look again when it ends
                n = min(items[m], self.batch[m])
                end = now + self._estimate(lat, m, n)
                # At the slot's start its planned batch goes. Later in the slot (work
                # arrived after the start, an earlier batch ended, or its own reuse batch
                # ran into the start): a batch if it ends within the slot and fits beside
                # what is running (a reuse batch may hold a forfeited slot's capacity).
                # (A first look may come late, the dispatcher being busy: it still takes
                # the planned batch. An occurrence its own reuse batch ran into is already
                # marked used by `_claim_own`.)
                if st != FREE and (end > start + self.s_dur[i] + _EPS
                                   or not self._room_beside_busy(i, now)):
                    continue
                self._mark(i, k, USED)
                launches.append(Launch(self.names[m], n, False))
                self._hold(m, end, i)
        # 2. Reuse of idle capacity.
        if reuse_idle:
            for m in range(self.n_models):
                if items[m] == 0 or running[m] or self.busy[m]:
                    continue
                n = min(items[m], self.batch[m])
                end = now + self._estimate(lat, m, n)
                if self.fits(m, now, end):
                    self._claim_own(m, now, end)
                    launches.append(Launch(self.names[m], n, True))
                    self._hold(m, end, self.own[m])
        # 3. Look again at the next slot start.
        wake: cython.double = self.next_start(now)
        return Decision(tuple(launches), wake if wake < _INF else None)


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

    The state and the decision live in `SlotClock` (above; compiled, since `decide` runs
    on every event of the dispatcher and of the simulator).
    """

    name = PolicyName.DSTACK

    def __init__(self, models: dict[str, ModelParams], backend: SliceBackend, the_plan: Plan,
                 the_schedule: Schedule, origin: float,
                 latency: dict[str, LinearLatency] | None = None,
                 reuse_idle: bool = True) -> None:
        self.models = models
        self.backend = backend
        self.the_plan = the_plan
        self.the_schedule = the_schedule
        self.latency: dict[str, LinearLatency] = {} if latency is None else latency
        self.reuse_idle = reuse_idle
        planned = {m.model: m for m in the_plan.models}
        self._batch = {m: p.batch for m, p in planned.items()}
        self._clock = SlotClock(
            list(models),
            [(s.model, s.start_ms / 1000, s.duration_ms / 1000, s.percent, s.units)
             for s in the_schedule.slots],
            the_schedule.cycle_ms / 1000, origin,
            [planned[m].batch if m in planned else 1 for m in models],
            [planned[m].latency_ms / 1000 if m in planned else 0.0 for m in models],
        )

    @property
    def origin(self) -> float:
        return self._clock.origin

    @origin.setter
    def origin(self, t: float) -> None:
        self._clock.origin = t

    @property
    def cycle_s(self) -> float:
        return self._clock.cycle_s

    @property
    def clock(self) -> SlotClock:
        return self._clock

    def slices(self) -> dict[str, SliceSpec]:
        out: dict[str, SliceSpec] = {}
        for s in self.the_schedule.slots:
            out.setdefault(s.model, self.backend.slice_for(s.percent, s.units))
        return out

    def plan(self) -> Plan | None:
        return self.the_plan

    def schedule(self) -> Schedule | None:
        return self.the_schedule

    def decide(self, now: float, queues: Mapping[str, QueueView]) -> Decision:
        return self._clock.decide(now, queues, self.latency, self.reuse_idle)

    def use_estimates(self, estimates: Mapping[str, LinearLatency]) -> None:
        self.latency = dict(estimates) if not isinstance(estimates, dict) else estimates

    def reanchor(self, now: float) -> None:
        self._clock.origin = now

    def batch_cap(self, model: str) -> int:
        return self._batch.get(model, 1)

    def unserved(self) -> Mapping[str, str]:
        planned = {m.model for m in self.the_plan.models}
        why = {s.model: s.reason for s in self.the_plan.shortfalls}
        return {m: why.get(m, "not in the plan") for m in self.models if m not in planned}

    def on_batch_done(self, model: str, n: int, compute_s: float, now: float) -> None:
        self._clock.done(model)
