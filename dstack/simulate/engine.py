"""The discrete-event loop: one policy object, one workload, a virtual clock.

It mirrors `dstack.runtime.Runtime` (the asyncio dispatcher) step for step, with workers
replaced by the latency model (`dstack.simulate.latency`):

- **Admission** (as `Runtime.infer`): a request is refused if its model's queue already
  holds `max_queue` items, or if the latency estimate for one item already exceeds its SLO.
  Otherwise it is queued FIFO with deadline = arrival + SLO.
- **Dispatch** (as `Runtime._dispatch_loop`): first refuse every queued request that can no
  longer meet its deadline (deadline - estimate(1) < now), then `policy.decide(now, views)`,
  then apply its launches: a launch for a model whose worker is busy is ignored; otherwise
  it takes whole requests, FIFO, up to min(max_items, max_batch_size), and refuses those at
  the head that the batch would answer after their deadline (by the estimate). The next wake-up is
  the decision's `wake_at` or the next doom time, whichever is first; a wake-up that is not
  in the future is taken 1 ns later (the real loop's clock always moves on).
- **When the policy is asked.** After every batch completion, at every wake-up, and on
  every arrival to a model whose worker is idle. An arrival to a model that is running a
  batch is queued without asking: no policy's decision reads a busy model's queue length,
  and the asyncio loop would answer such a call with "nothing to do" for that model.
  (The one effect lost: a policy whose decision for *another* model depends on the time
  alone, e.g. `dstack` reuse that becomes possible when a slot ends, is asked at the next
  event instead of at this arrival. The real runtime asks at arbitrary arrival instants,
  so neither is more faithful.)
- **Completion** (as `Runtime._run_batch`): every request of the batch is answered at the
  batch's end; its latency is end - arrival, within SLO when end <= deadline. The batch's
  elapsed time is fed to `latency[model].observe` and `policy.on_batch_done`.
- **Contention.** A batch of n items on a slice of p% needs L(n, p) seconds of *solo* work.
  While the running batches' percentages sum to S <= 100 each progresses at full speed;
  when S > 100 (the `shared` policy gives every model 100%) each progresses at rate
  100 / S: processor sharing, with finish times recomputed on every start and finish.
  Device utilisation is the time average of min(S, 100) over [0, duration).
- **End.** Arrivals stop at `duration_s`; the loop then drains: queued requests are served
  or refused, so every request is accounted for exactly once.

Written in Cython's pure-Python mode: setup.py compiles it (with the policies and
`dstack.latency`, the objects it drives), and uncompiled it runs as it reads, with the same
results (tests/unit/test_compiled.py).
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import cython

from dstack.decisions import Policy, QueueView

INF = cython.declare(cython.double, math.inf)
_NUDGE_S = cython.declare(cython.double, 1e-9)
#: Whether this module runs compiled (setup.py; without a C compiler it runs as Python).
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
class ModelCounts:
    arrived: int = 0
    refused_full: int = 0  # queue bound
    refused_deadline: int = 0  # at admission, or later when it could no longer make it
    served: int = 0
    within_slo: int = 0
    batches: int = 0
    items: int = 0


@dataclass(slots=True)
class RunResult:
    """Raw outcome of one run; `dstack.simulate.report` turns it into numbers."""

    duration_s: float
    end_s: float  # when the last request was answered
    counts: dict[str, ModelCounts]
    latencies_s: array  # every served request's latency, in completion order
    busy_integral: float  # integral of min(S, 100)/100 over [0, duration)
    decisions: int
    timeline: list[BatchSpan] = field(default_factory=list)


def run(policy: Policy, models: Sequence[SimModel], times: Sequence[float],
        model_idx: Sequence[int], duration_s: float, *, timeline_s: float = 0.0) -> RunResult:
    """Drive `policy` through the arrivals (sorted `times`, with `model_idx` into
    `models`) on a virtual clock; see the module docstring for the semantics."""
    return _Loop(policy, models, duration_s, timeline_s).run(
        array("d", times), array("i", model_idx))


@cython.cclass
class _Loop:
    """The loop's state: per model, typed arrays indexed by the model's position (C
    arrays when compiled); the queues are deques of arrival times."""

    n_models: cython.int
    duration_s: cython.double
    timeline_s: cython.double
    names: list
    index: dict
    slo: cython.double[:]
    cap: cython.int[:]
    max_queue: cython.longlong[:]
    pct: cython.double[:]
    table: list  # per model: L(b) in seconds, b = 0..max_batch
    est: list  # per model: the policy's LinearLatency, or None
    # estimate(1) and SLO - estimate(1) per model, the admission and doom tests: kept
    # here and refreshed when the model's latency estimate learns (after each of its
    # batches), which is the only time they change. As in the runtime, an estimate
    # refuses nothing until it is trusted (a few observed batches); the runtime's
    # stale-estimate probe is not modelled (the simulated batches always run at the
    # profile's latency, so an estimate cannot stay too slow).
    one: cython.double[:]
    limits: cython.double[:]
    queues: list  # per model: deque of arrival times
    qlen: cython.int[:]  # per model: its queue's length and oldest arrival (if any)
    qhead: cython.double[:]
    running: cython.uchar[:]
    rem: cython.double[:]  # solo work left in the running batch
    bstart: cython.double[:]
    breuse: cython.uchar[:]
    breqs: list  # per model: the arrival times of its running batch
    active: list  # running models, in launch order
    views: dict
    dirty: cython.uchar[:]
    arrived: cython.longlong[:]
    refused_full: cython.longlong[:]
    refused_deadline: cython.longlong[:]
    served: cython.longlong[:]
    within_slo: cython.longlong[:]
    batches: cython.longlong[:]
    items: cython.longlong[:]
    lat_out: object  # array("d"): every served request's latency, in completion order
    lat_buf: cython.double[:]  # lat_out's buffer, sized for every arrival
    n_lat: cython.Py_ssize_t
    timeline: list
    policy: object
    load: cython.double  # S, the sum of the running batches' percentages
    rate: cython.double
    last: cython.double
    busy: cython.double
    t_fin: cython.double
    fin_j: cython.int
    wake: cython.double
    queued: cython.longlong
    decisions: cython.longlong

    def __init__(self, policy: Policy, models: Sequence[SimModel], duration_s: float,
                 timeline_s: float) -> None:
        n: cython.int = len(models)
        self.n_models = n
        self.duration_s = duration_s
        self.timeline_s = timeline_s
        self.policy = policy
        self.names = [m.name for m in models]
        self.index = {m: j for j, m in enumerate(self.names)}
        self.slo = array("d", [m.slo_s for m in models])
        self.cap = array("i", [m.max_batch for m in models])
        self.max_queue = array("q", [m.max_queue for m in models])
        self.pct = array("d", [m.percent for m in models])
        self.table = [array("d", m.latency_s) for m in models]
        lat_est = getattr(policy, "latency", {})
        self.est = [lat_est.get(m) for m in self.names]
        self.one = array("d", [e.estimate_s(1) if e is not None and e.trusted else 0.0
                               for e in self.est])
        self.limits = array("d", [m.slo_s - o for m, o in zip(models, self.one, strict=True)])
        self.queues = [deque() for _ in models]
        self.qlen = array("i", [0] * n)
        self.qhead = array("d", [0.0] * n)
        self.running = array("B", [0] * n)
        self.rem = array("d", [0.0] * n)
        self.bstart = array("d", [0.0] * n)
        self.breuse = array("B", [0] * n)
        self.breqs = [[] for _ in models]
        self.active = []
        self.views = {m: QueueView(m, 0, None, None, False) for m in self.names}
        self.dirty = array("B", [0] * n)
        self.arrived = array("q", [0] * n)
        self.refused_full = array("q", [0] * n)
        self.refused_deadline = array("q", [0] * n)
        self.served = array("q", [0] * n)
        self.within_slo = array("q", [0] * n)
        self.batches = array("q", [0] * n)
        self.items = array("q", [0] * n)
        self.n_lat = 0
        self.timeline = []
        self.load = 0.0
        self.rate = 1.0
        self.last = 0.0
        self.busy = 0.0
        self.t_fin = INF
        self.fin_j = -1
        self.wake = INF
        self.queued = 0
        self.decisions = 0

    @cython.cfunc
    def advance(self, now: cython.double) -> cython.void:
        dt: cython.double = now - self.last
        j: cython.int
        if dt > 0 and self.active:
            used: cython.double = dt * self.rate
            for j in self.active:
                self.rem[j] -= used
            hi: cython.double = now if now < self.duration_s else self.duration_s
            if hi > self.last:
                self.busy += (self.load if self.load < 100.0 else 100.0) / 100.0 * (hi - self.last)
        self.last = now

    @cython.cfunc
    def reschedule(self) -> cython.void:
        j: cython.int
        t: cython.double
        self.rate = 1.0 if self.load <= 100.0 else 100.0 / self.load
        self.t_fin, self.fin_j = INF, -1
        for j in self.active:
            t = self.last + self.rem[j] / self.rate
            if t < self.t_fin:
                self.t_fin, self.fin_j = t, j

    @cython.cfunc
    def pop(self, j: cython.int) -> cython.double:
        """Take the oldest queued request of model j; its arrival time."""
        q = self.queues[j]
        a: cython.double = q.popleft()
        self.qlen[j] -= 1
        if self.qlen[j]:
            self.qhead[j] = q[0]
        self.queued -= 1
        return a

    @cython.cfunc
    def refuse_head(self, j: cython.int) -> cython.void:
        """Refuse the oldest queued request of model j: it can no longer make it."""
        self.pop(j)
        self.refused_deadline[j] += 1

    @cython.cfunc
    def dispatch(self, now: cython.double) -> cython.void:
        j: cython.int
        k: cython.int
        n: cython.int = self.n_models
        head: cython.double
        doom: cython.double = INF
        # Refuse the doomed (Runtime._refuse_doomed).
        for j in range(n):
            if not self.qlen[j]:
                continue
            limit: cython.double = self.limits[j]
            while self.qlen[j] and self.qhead[j] + limit < now:
                self.refuse_head(j)
                self.dirty[j] = 1
            if self.qlen[j]:
                head = self.qhead[j]
                if head + limit < doom:
                    doom = head + limit
        for j in range(n):
            if self.dirty[j]:
                name = self.names[j]
                if self.qlen[j]:
                    head = self.qhead[j]
                    self.views[name] = QueueView(name, self.qlen[j], head, head + self.slo[j],
                                                 self.running[j])
                else:
                    self.views[name] = QueueView(name, 0, None, None, self.running[j])
                self.dirty[j] = 0
        self.decisions += 1
        d = self.policy.decide(now, self.views)
        for launch in d.launches:
            j = self.index[launch.model]
            if self.running[j] or not self.qlen[j]:
                continue
            k = max(1, min(launch.max_items, self.cap[j], self.qlen[j]))
            # Refuse, rather than serve late, the heads the batch would finish after
            # their deadline (Runtime._launch).
            e = self.est[j]
            if e is not None and e.trusted:
                while k and self.qhead[j] + self.slo[j] < now + e.estimate_s(k):
                    self.refuse_head(j)
                    k -= 1
                if not k:
                    self.dirty[j] = 1
                    continue
            self.breqs[j] = [self.pop(j) for _ in range(k)]
            self.advance(now)
            self.running[j] = 1
            self.rem[j] = self.table[j][k]
            self.bstart[j] = now
            self.breuse[j] = launch.reuse
            self.active.append(j)
            self.load += self.pct[j]
            self.reschedule()
            self.dirty[j] = 1
        w: cython.double = INF if d.wake_at is None else d.wake_at
        if doom < w:
            w = doom
        if w <= now:
            w = now + _NUDGE_S
        self.wake = w

    @cython.cfunc
    def complete(self, now: cython.double) -> cython.void:
        j: cython.int = self.fin_j
        k: cython.int
        a: cython.double
        self.advance(now)
        self.active.remove(j)
        self.load -= self.pct[j]
        if not self.active:
            self.load = 0.0  # no drift from float sums
        self.running[j] = 0
        reqs: list = self.breqs[j]
        k = len(reqs)
        self.batches[j] += 1
        self.items[j] += k
        self.served[j] += k
        deadline_slack: cython.double = now - self.slo[j]
        within: cython.longlong = 0
        for a in reqs:
            self.lat_buf[self.n_lat] = now - a
            self.n_lat += 1
            if a >= deadline_slack:
                within += 1
        self.within_slo[j] += within
        compute_s: cython.double = now - self.bstart[j]
        if self.bstart[j] < self.timeline_s:
            self.timeline.append(BatchSpan(self.names[j], self.bstart[j], now, self.pct[j], k,
                                           bool(self.breuse[j])))
        e = self.est[j]
        if e is not None:
            e.observe(k, compute_s)
            self.one[j] = e.estimate_s(1) if e.trusted else 0.0
            self.limits[j] = self.slo[j] - self.one[j]
        self.policy.on_batch_done(self.names[j], k, compute_s, now)
        self.reschedule()
        self.dirty[j] = 1
        self.dispatch(now)

    def run(self, times: cython.double[:], model_idx: cython.int[:]) -> RunResult:
        i: cython.Py_ssize_t = 0
        n_arr: cython.Py_ssize_t = len(times)
        j: cython.int
        self.lat_out = array("d", bytes(8 * n_arr))  # zeros; cut to those served below
        self.lat_buf = self.lat_out
        ta: cython.double
        now: cython.double
        while True:
            ta = times[i] if i < n_arr else INF
            if ta == INF and not self.active and self.queued == 0:
                break
            if self.t_fin <= ta and self.t_fin <= self.wake:
                self.complete(self.t_fin)
            elif ta <= self.wake:
                now = ta
                j = model_idx[i]
                i += 1
                self.arrived[j] += 1
                if self.qlen[j] + 1 > self.max_queue[j]:
                    self.refused_full[j] += 1
                    continue
                if self.one[j] > self.slo[j]:
                    self.refused_deadline[j] += 1
                    continue
                self.queues[j].append(now)
                self.qlen[j] += 1
                if self.qlen[j] == 1:
                    self.qhead[j] = now
                self.queued += 1
                self.dirty[j] = 1
                if not self.running[j]:
                    self.dispatch(now)
            elif self.wake < INF:
                now = self.wake
                self.wake = INF
                self.dispatch(now)
            else:  # requests queued but nothing will ever move them: cannot happen (doom)
                raise AssertionError("simulator stalled with requests queued")
        end_s: cython.double = self.last
        self.advance(max(self.last, self.duration_s))
        self.lat_buf = None  # release the buffer, so the array can be cut
        del self.lat_out[self.n_lat:]
        counts = {
            name: ModelCounts(self.arrived[j], self.refused_full[j], self.refused_deadline[j],
                              self.served[j], self.within_slo[j], self.batches[j],
                              self.items[j])
            for j, name in enumerate(self.names)
        }
        return RunResult(
            duration_s=self.duration_s,
            end_s=end_s,
            counts=counts,
            latencies_s=self.lat_out,
            busy_integral=self.busy,
            decisions=self.decisions,
            timeline=self.timeline,
        )
