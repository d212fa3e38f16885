"""The discrete-event loop: the dispatch core and one policy on a virtual clock.

Queues, admission, refusals, latency estimates and counters are the server's own
(`dstack.runtime.dispatch.DispatchCore`, driven here as the asyncio runtime drives it);
what this module adds is time and the device:

- **Events.** Arrivals (`core.admit`), batch ends (`core.complete`) and the core's
  wake-ups. The core is stepped after every batch end, at every wake-up, and on every
  arrival to a model that is not running a batch (an arrival to a running model is only
  queued: no policy's decision reads a busy model's queue, and the real dispatcher,
  woken by it, would launch nothing for it). A wake-up that is not in the future is
  taken 1 ns later (the real loop's clock always moves on).
- **Workers.** A launched batch of n items on a slice of p% needs L(n, p) seconds of
  *solo* work (the profile's latency model, `dstack.simulate.latency`). While the running
  batches' percentages sum to S <= 100 each progresses at full speed; when S > 100 (the
  `shared` policy gives every model 100%) each progresses at rate 100 / S: processor
  sharing, finish times recomputed on every start and end. Device utilisation is the
  time average of min(S, 100) over [0, duration).
- **Completion.** Every request of the batch is answered at its end; its latency is
  end - arrival, within SLO when end <= deadline (the core counts it). The batch's elapsed
  time feeds the model's latency estimate and the policy, as in the server.
- **Re-planning.** With a `replanner` (the `dstack` policy with `adapt` on), every
  `adapt.sample_s` while requests arrive it sees the arrivals so far; a new plan takes
  effect at once: the core gets the new policy, each worker its new slice (batches
  already running finish on the old one). The server first starts shadow workers for
  the changed slices, so there the switch comes seconds later.
- **End.** Arrivals stop at `duration_s`; the loop then drains: queued requests are served
  or refused, so every request is accounted for exactly once.

Written in Cython's pure-Python mode: setup.py compiles it (with the dispatch core and the
policies); uncompiled it runs as it reads, with the same results
(tests/unit/test_compiled.py). The loop and the device are typed classes over per-model
arrays; the core is driven through its public methods, as the runtime drives it.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import cython

from dstack.policies.contract import Policy
from dstack.policies.latency import LinearLatency
from dstack.runtime.dispatch import CoreModel, Counters, DispatchCore, Ticket

INF = cython.declare(cython.double, math.inf)
_NUDGE_S = cython.declare(cython.double, 1e-9)
#: Whether this module runs compiled (setup.py compiles it, with the dispatch core and the
#: policies; without a C compiler it runs as Python, with the same results).
COMPILED: bool = cython.compiled


@dataclass(frozen=True, slots=True)
class SimModel:
    """What the loop needs of one served model."""

    name: str
    slo_s: float
    max_batch: int
    max_queue: int
    percent: float  # its worker's slice
    latency_s: list[float]  # L(b) in seconds at that slice, b = 0..max_batch


@dataclass(frozen=True, slots=True)
class BatchSpan:
    """One executed batch, for the timeline plot."""

    model: str
    start_s: float
    end_s: float
    percent: float
    n: int
    reuse: bool


@dataclass(slots=True)
class RunResult:
    """Raw outcome of one run; `dstack.simulate.report` turns it into numbers."""

    duration_s: float
    end_s: float  # when the last request was answered
    counts: dict[str, Counters]  # the dispatch core's counters per model
    latencies_s: array  # every served request's latency, in completion order
    busy_integral: float  # integral of min(S, 100)/100 over [0, duration)
    decisions: int
    timeline: list[BatchSpan] = field(default_factory=list)
    replans: int = 0


class Replanner(Protocol):
    """Re-planning on the virtual clock (`dstack.simulate.simulation` makes the server's).
    `sample` is called every `period_s` while requests arrive, with how many arrived so far
    per served model; it returns the new policy, each worker's new slice percent and
    latency table (seconds, b = 0..max_batch), and estimates for the core, or None."""

    period_s: float

    def sample(self, now: float, arrived: list[int]) -> tuple[
            Policy, dict[str, tuple[float, list[float]]], dict[str, LinearLatency]] | None: ...


def run(policy: Policy, models: Sequence[SimModel], times: Sequence[float],
        model_idx: Sequence[int], duration_s: float, *,
        estimates: dict[str, LinearLatency] | None = None,
        timeline_s: float = 0.0, served: Sequence[str] | None = None,
        groups: Mapping[str, Sequence[str]] | None = None,
        replanner: Replanner | None = None) -> RunResult:
    """Drive `policy` through the arrivals (sorted `times`, with `model_idx` into
    `served`, default the models' names) on a virtual clock; see the module docstring for
    the semantics. `estimates`: the latency estimates the core starts from (as the
    server's planning seeds them). `groups`: served model -> its replicas among `models`
    (the core routes each arrival to one); counts are per served model. `replanner`:
    re-plans while requests arrive (a new plan takes effect at once; running batches
    finish on their old slices)."""
    return _Loop(policy, models, duration_s, timeline_s, estimates, served, groups,
                 replanner).run(array("d", times), array("i", model_idx))


@cython.cclass
class _Device:
    """Processor sharing over the running batches (see the module docstring)."""

    duration_s: cython.double
    rem: cython.double[:]  # per model: solo work left in its running batch
    pct: cython.double[:]  # per model: its running batch's slice
    # The running models in the order their batches started: the next to finish is the
    # first of the earliest, so equal finish times resolve in start order.
    order: cython.int[:]
    n_run: cython.int
    load: cython.double  # S
    rate: cython.double
    last: cython.double
    busy: cython.double
    t_fin: cython.double
    fin_j: cython.int

    def __init__(self, n_models: int, duration_s: float) -> None:
        self.duration_s = duration_s
        self.rem = array("d", [0.0] * n_models)
        self.pct = array("d", [0.0] * n_models)
        self.order = array("i", [0] * n_models)
        self.n_run = 0
        self.load = 0.0
        self.rate = 1.0
        self.last = 0.0
        self.busy = 0.0
        self.t_fin = INF
        self.fin_j = -1

    @cython.cfunc
    def advance(self, now: cython.double) -> cython.void:
        dt: cython.double = now - self.last
        k: cython.int
        if dt > 0 and self.n_run:
            used: cython.double = dt * self.rate
            for k in range(self.n_run):
                self.rem[self.order[k]] -= used
            hi: cython.double = self.duration_s if self.duration_s < now else now
            if hi > self.last:
                load: cython.double = 100.0 if 100.0 < self.load else self.load
                self.busy += load / 100.0 * (hi - self.last)
        self.last = now

    @cython.cfunc
    def start(self, j: cython.int, work_s: cython.double, percent: cython.double,
              now: cython.double) -> cython.void:
        self.advance(now)
        self.rem[j] = work_s
        self.pct[j] = percent
        self.order[self.n_run] = j
        self.n_run += 1
        self.load += percent
        self._reschedule()

    @cython.cfunc
    def finish(self, now: cython.double) -> cython.int:
        j: cython.int = self.fin_j
        k: cython.int
        self.advance(now)
        w: cython.int = 0
        for k in range(self.n_run):  # drop j, keeping the others' order
            if self.order[k] != j:
                self.order[w] = self.order[k]
                w += 1
        self.n_run = w
        self.load -= self.pct[j]
        if not self.n_run:
            self.load = 0.0  # no drift from float sums
        self._reschedule()
        return j

    @cython.cfunc
    def _reschedule(self) -> cython.void:
        k: cython.int
        j: cython.int
        t: cython.double
        self.rate = 1.0 if self.load <= 100.0 else 100.0 / self.load
        self.t_fin, self.fin_j = INF, -1
        for k in range(self.n_run):
            j = self.order[k]
            t = self.last + self.rem[j] / self.rate
            if t < self.t_fin:
                self.t_fin, self.fin_j = t, j


@cython.cclass
class _Loop:
    core: object  # DispatchCore
    device: _Device
    names: list
    served: list  # what arrivals name: served models (each one or more of `names`)
    tables: list  # per model: L(b) in seconds at its slice
    pct: cython.double[:]  # per model: its slice
    duration_s: cython.double
    timeline_s: cython.double
    timeline: list
    batches: list  # per model: its running Batch, or None
    n_running: cython.int
    lat_out: object  # array("d"): every served request's latency, in completion order
    lat_buf: cython.double[:]  # lat_out's buffer, sized for every arrival
    n_lat: cython.Py_ssize_t
    wake: cython.double
    decisions: cython.longlong
    replanner: object  # Replanner or None
    next_sample: cython.double
    arrived: cython.longlong[:]  # per served model, so far
    replans: cython.int

    def __init__(self, policy: Policy, models: Sequence[SimModel], duration_s: float,
                 timeline_s: float, estimates: dict[str, LinearLatency] | None,
                 served: Sequence[str] | None,
                 groups: Mapping[str, Sequence[str]] | None,
                 replanner: Replanner | None) -> None:
        self.names = [m.name for m in models]
        self.served = list(served) if served is not None else self.names
        self.tables = [m.latency_s for m in models]
        self.pct = array("d", [m.percent for m in models])
        self.core = DispatchCore(
            [CoreModel(m.name, m.slo_s, m.max_batch, m.max_queue) for m in models],
            policy, estimates, now=0.0, groups=groups)
        self.device = _Device(len(models), duration_s)
        self.duration_s = duration_s
        self.timeline_s = timeline_s
        self.timeline = []
        self.batches = [None] * len(models)
        self.n_running = 0
        self.n_lat = 0
        self.wake = INF
        self.decisions = 0
        self.replanner = replanner
        self.next_sample = INF if replanner is None else replanner.period_s
        self.arrived = array("q", [0] * len(self.served))
        self.replans = 0

    @cython.cfunc
    def step(self, now: cython.double) -> cython.void:
        j: cython.int
        self.decisions += 1
        s = self.core.step(now)
        if s.failures:  # a policy that raised: a bug, never hidden in a simulation
            raise RuntimeError(s.failures[0].message) from s.failures[0].error
        for b in s.launches:
            j = b.index
            self.batches[j] = b
            self.n_running += 1
            self.device.start(j, self.tables[j][b.n], self.pct[j], now)
        wake_at = s.wake_at
        w: cython.double = INF if wake_at is None else wake_at
        self.wake = w if w > now else now + _NUDGE_S

    @cython.cfunc
    def complete(self, now: cython.double) -> cython.void:
        if self.device.fin_j < 0:  # requests queued but nothing will ever move them
            raise AssertionError("simulator stalled with requests queued")
        j: cython.int = self.device.finish(now)
        b = self.batches[j]
        self.batches[j] = None
        self.n_running -= 1
        started: cython.double = b.started
        compute_s: cython.double = now - started
        tickets = self.core.complete(b, compute_s, now)
        self.core.notify_policy(b, compute_s, now)
        arrival: cython.double
        for t in tickets:
            arrival = t.arrival
            self.lat_buf[self.n_lat] = now - arrival
            self.n_lat += 1
        if started < self.timeline_s:
            self.timeline.append(BatchSpan(b.model, started, now, self.pct[j], b.n, b.reuse))
        self.step(now)

    @cython.cfunc
    def replan(self, now: cython.double) -> cython.void:
        j: cython.Py_ssize_t
        self.next_sample = now + self.replanner.period_s
        got = self.replanner.sample(now, list(self.arrived))
        if got is None:
            return
        policy, workers, estimates = got
        for j in range(len(self.names)):
            w = workers.get(self.names[j])
            if w is not None:
                self.pct[j] = w[0]
                self.tables[j] = w[1]
        self.core.set_policy(policy, now, estimates)
        self.replans += 1
        self.step(now)

    def run(self, times: cython.double[:], model_idx: cython.int[:]) -> RunResult:
        core = self.core
        device: _Device = self.device
        served: list = self.served
        admit = core.admit
        n_arr: cython.Py_ssize_t = len(times)
        i: cython.Py_ssize_t = 0
        j: cython.int
        ta: cython.double
        ts: cython.double
        now: cython.double
        self.lat_out = array("d", bytes(8 * n_arr))  # cut to those served below
        self.lat_buf = self.lat_out
        while True:
            ta = times[i] if i < n_arr else INF
            if ta == INF and self.n_running == 0 and core.queued == 0:
                break
            ts = self.next_sample if ta < INF else INF  # re-plans while requests arrive
            if device.t_fin <= ta and device.t_fin <= self.wake and device.t_fin <= ts:
                self.complete(device.t_fin)
            elif ta <= self.wake and ta <= ts:
                j = model_idx[i]
                i += 1
                self.arrived[j] += 1
                got = admit(served[j], 1, ta)
                if isinstance(got, Ticket) and self.batches[got.model] is None:
                    self.step(ta)
            elif self.wake <= ts and self.wake < INF:
                now = self.wake
                self.wake = INF
                self.step(now)
            elif ts < INF:
                self.replan(ts)
            else:  # requests queued but nothing will ever move them: cannot happen (doom)
                raise AssertionError("simulator stalled with requests queued")
        end_s: cython.double = device.last
        device.advance(device.duration_s if device.duration_s > device.last else device.last)
        self.lat_buf = None  # release the buffer, so that the array can be cut
        del self.lat_out[self.n_lat:]
        return RunResult(
            duration_s=self.duration_s,
            end_s=end_s,
            counts={name: core.counters(name) for name in served},
            latencies_s=self.lat_out,
            busy_integral=device.busy,
            decisions=self.decisions,
            timeline=self.timeline,
            replans=self.replans,
        )
