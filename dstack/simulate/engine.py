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
- **End.** Arrivals stop at `duration_s`; the loop then drains: queued requests are served
  or refused, so every request is accounted for exactly once.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import cython

from dstack.policies.contract import Policy
from dstack.policies.latency import LinearLatency
from dstack.runtime.dispatch import Batch, CoreModel, Counters, DispatchCore, Ticket

INF = math.inf
_NUDGE_S = 1e-9
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


def run(policy: Policy, models: Sequence[SimModel], times: Sequence[float],
        model_idx: Sequence[int], duration_s: float, *,
        estimates: dict[str, LinearLatency] | None = None,
        timeline_s: float = 0.0) -> RunResult:
    """Drive `policy` through the arrivals (sorted `times`, with `model_idx` into
    `models`) on a virtual clock; see the module docstring for the semantics.
    `estimates`: the latency estimates the core starts from (as the server's planning
    seeds them)."""
    return _Loop(policy, models, duration_s, timeline_s, estimates).run(times, model_idx)


class _Device:
    """Processor sharing over the running batches (see the module docstring)."""

    def __init__(self, duration_s: float) -> None:
        self.duration_s = duration_s
        self.rem: dict[int, float] = {}  # model index -> solo work left in its batch
        self.pct: dict[int, float] = {}
        self.load = 0.0  # S
        self.rate = 1.0
        self.last = 0.0
        self.busy = 0.0
        self.t_fin = INF
        self.fin_j = -1

    def advance(self, now: float) -> None:
        dt = now - self.last
        if dt > 0 and self.rem:
            used = dt * self.rate
            for j in self.rem:
                self.rem[j] -= used
            hi = min(now, self.duration_s)
            if hi > self.last:
                self.busy += min(self.load, 100.0) / 100.0 * (hi - self.last)
        self.last = now

    def start(self, j: int, work_s: float, percent: float, now: float) -> None:
        self.advance(now)
        self.rem[j] = work_s
        self.pct[j] = percent
        self.load += percent
        self._reschedule()

    def finish(self, now: float) -> int:
        j = self.fin_j
        self.advance(now)
        del self.rem[j]
        self.load -= self.pct.pop(j)
        if not self.rem:
            self.load = 0.0  # no drift from float sums
        self._reschedule()
        return j

    def _reschedule(self) -> None:
        self.rate = 1.0 if self.load <= 100.0 else 100.0 / self.load
        self.t_fin, self.fin_j = INF, -1
        for j, rem in self.rem.items():
            t = self.last + rem / self.rate
            if t < self.t_fin:
                self.t_fin, self.fin_j = t, j


class _Loop:
    def __init__(self, policy: Policy, models: Sequence[SimModel], duration_s: float,
                 timeline_s: float, estimates: dict[str, LinearLatency] | None) -> None:
        self.models = list(models)
        self.names = [m.name for m in models]
        self.tables = [m.latency_s for m in models]
        self.core = DispatchCore(
            [CoreModel(m.name, m.slo_s, m.max_batch, m.max_queue) for m in models],
            policy, estimates, now=0.0)
        self.device = _Device(duration_s)
        self.duration_s = duration_s
        self.timeline_s = timeline_s
        self.timeline: list[BatchSpan] = []
        self.batches: dict[int, Batch] = {}  # model index -> its running batch
        self.latencies = array("d")
        self.wake = INF
        self.decisions = 0

    def step(self, now: float) -> None:
        self.decisions += 1
        s = self.core.step(now)
        if s.failures:  # a policy that raised: a bug, never hidden in a simulation
            raise RuntimeError(s.failures[0].message) from s.failures[0].error
        for b in s.launches:
            self.batches[b.index] = b
            m = self.models[b.index]
            self.device.start(b.index, self.tables[b.index][b.n], m.percent, now)
        w = INF if s.wake_at is None else s.wake_at
        self.wake = w if w > now else now + _NUDGE_S

    def complete(self, now: float) -> None:
        j = self.device.finish(now)
        b = self.batches.pop(j)
        compute_s = now - b.started
        tickets = self.core.complete(b, compute_s, now)
        self.core.notify_policy(b, compute_s, now)
        for t in tickets:
            self.latencies.append(now - t.arrival)
        if b.started < self.timeline_s:
            self.timeline.append(BatchSpan(b.model, b.started, now,
                                           self.models[j].percent, b.n, b.reuse))
        self.step(now)

    def run(self, times: Sequence[float], model_idx: Sequence[int]) -> RunResult:
        core, device = self.core, self.device
        names = self.names
        n_arr = len(times)
        i = 0
        while True:
            ta = times[i] if i < n_arr else INF
            if ta == INF and not self.batches and core.queued == 0:
                break
            if device.t_fin <= ta and device.t_fin <= self.wake:
                self.complete(device.t_fin)
            elif ta <= self.wake:
                j = model_idx[i]
                i += 1
                got = core.admit(names[j], 1, ta)
                if isinstance(got, Ticket) and j not in self.batches:
                    self.step(ta)
            elif self.wake < INF:
                now, self.wake = self.wake, INF
                self.step(now)
            else:  # requests queued but nothing will ever move them: cannot happen (doom)
                raise AssertionError("simulator stalled with requests queued")
        end_s = device.last
        device.advance(max(device.last, self.duration_s))
        return RunResult(
            duration_s=self.duration_s,
            end_s=end_s,
            counts={name: core.counters(name) for name in names},
            latencies_s=self.latencies,
            busy_integral=device.busy,
            decisions=self.decisions,
            timeline=self.timeline,
        )

