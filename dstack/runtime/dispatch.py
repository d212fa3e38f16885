"""The dispatch core: queues, admission, refusals, latency estimates and counters.

Pure: the clock is passed in; no asyncio, threads, processes or I/O. The asyncio runtime
(`dstack.runtime.serving`) and the simulator (`dstack.simulate.engine`) both drive this one
object, so the rules below are written once and what wins in simulation is what runs.

Driving it:

- `admit(model, n, now, payload)` -> a queued `Ticket`, or a `Refusal` saying which rule
  refused it. `payload` is the caller's (the runtime's request with its future; the
  simulator's nothing).
- `step(now)` -> `Step`: batches to launch now (their tickets taken off the queues),
  tickets refused because they can no longer make their deadline, failures (a policy that
  raised: its queued tickets, with the reason), and when to step again at the latest.
- `complete(batch, compute_s, now)` -> the batch's tickets, to be answered; feeds the
  model's latency estimate and the policy. `fail(batch, now)` -> the same tickets, to be
  failed (a worker that died, returned the wrong number of rows, ...).

The refusal rules (every refusal names one):

- ``queue_full``: the model's queue already holds `max_queue` items.
- ``unplanned``: the policy does not serve this model (the plan could not fit it; its
  reason is in the message).
- ``work_ahead``: at admission, a *trusted* latency estimate says that the work already
  queued for the model (in batches of the policy's batch cap, after the running batch)
  plus the request's own batch ends after its deadline.
- ``expired``: while queued, the request can no longer finish by its deadline even if its
  batch started now (one item's estimate; only the deadline itself while the estimate is
  not trusted); or, at launch, the batch it would join would end after its deadline.

An estimate is *trusted* once it has seen `TRUST_AFTER` real batches. An estimate that
is refusing requests is re-measured: when the model has refused by estimate and not
finished a batch for `probe_s`, the next request is admitted as a *probe* whatever the
estimate says, and the estimate refuses nothing until that probe's batch has run. So a
stale or contended estimate cannot shut a model out for longer than about `probe_s`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from dstack.policies.contract import Policy, QueueView
from dstack.policies.latency import LinearLatency

#: Seconds after which a model that refuses by estimate gets a probe request through.
PROBE_S = 1.0


class RefusalReason(StrEnum):
    QUEUE_FULL = "queue_full"
    UNPLANNED = "unplanned"
    WORK_AHEAD = "work_ahead"
    EXPIRED = "expired"


@dataclass(frozen=True, slots=True)
class CoreModel:
    """What the core needs of a served model (seconds)."""

    name: str
    slo_s: float
    max_batch: int
    max_queue: int


@dataclass(eq=False, slots=True)
class Ticket:
    """One admitted request: `n` items of model `model` (its index in the core)."""

    model: int
    n: int
    arrival: float
    deadline: float
    payload: object = None


@dataclass(frozen=True, slots=True)
class Refusal:
    ticket: Ticket
    reason: RefusalReason
    message: str


@dataclass(frozen=True, slots=True)
class Batch:
    """A launched batch: its tickets in queue order, `n` items in all."""

    model: str
    index: int
    tickets: tuple[Ticket, ...]
    n: int
    started: float
    reuse: bool


@dataclass(frozen=True, slots=True)
class Failure:
    """Tickets taken off the queues because the dispatch path itself failed."""

    tickets: tuple[Ticket, ...]
    message: str
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class Step:
    launches: tuple[Batch, ...] = ()
    refusals: tuple[Refusal, ...] = ()
    failures: tuple[Failure, ...] = ()
    wake_at: float | None = None


@dataclass(slots=True)
class Counters:
    """Per model, since start-up."""

    arrived: int = 0
    admitted: int = 0
    refused: dict[str, int] = field(default_factory=lambda: {r.value: 0 for r in RefusalReason})
    served: int = 0
    within_slo: int = 0
    failed: int = 0
    batches: int = 0
    items: int = 0
    queue_s: float = 0.0
    compute_s: float = 0.0

    @property
    def refused_total(self) -> int:
        return sum(self.refused.values())


class _Model:
    """One model's queue and state (internal)."""

    __slots__ = ("spec", "queue", "items", "running", "run_until", "last_done",
                 "est_refused_at", "probing", "counters", "estimate", "dirty", "one_s")

    def __init__(self, spec: CoreModel, estimate: LinearLatency | None) -> None:
        self.spec = spec
        self.queue: deque[Ticket] = deque()
        self.items = 0
        self.running = False
        self.run_until = 0.0  # when the running batch should end (by the estimate)
        self.last_done = 0.0  # when its last batch ended (or serving began)
        self.est_refused_at: float | None = None  # last refusal by estimate
        self.probing = False  # a probe is queued or running: the estimate refuses nothing
        self.counters = Counters()
        self.estimate = estimate
        self.dirty = True  # its queue view must be made again
        self.one_s = 0.0  # one item's trusted estimate (0 while not trusted)
        self.learned()

    def learned(self) -> None:
        """The estimate changed (or was set)."""
        est = self.estimate
        self.one_s = est.estimate_s(1) if est is not None and est.trusted else 0.0


class DispatchCore:
    """See the module docstring. `estimates` (model name -> LinearLatency) are owned here
    and handed to the policy (`Policy.use_estimates`); a model without one is never
    refused by estimate."""

    def __init__(self, models: Sequence[CoreModel], policy: Policy,
                 estimates: dict[str, LinearLatency] | None = None, *, now: float = 0.0,
                 probe_s: float = PROBE_S) -> None:
        self.names = [m.name for m in models]
        self.index = {m.name: i for i, m in enumerate(models)}
        self.estimates: dict[str, LinearLatency] = dict(estimates or {})
        self._m = [_Model(m, self.estimates.get(m.name)) for m in models]
        self._views: dict[str, QueueView] = {}
        self.probe_s = probe_s
        self.queued = 0  # items queued over all models
        self.policy = policy
        self._unserved: dict[str, str] = {}
        self.set_policy(policy, now)
        for st in self._m:
            st.last_done = now

    # ------------------------------------------------------------------ policy

    def set_policy(self, policy: Policy, now: float,
                   estimates: dict[str, LinearLatency] | None = None) -> None:
        """Hand over to `policy` (a re-plan): its cycle starts at `now`; estimates learnt
        so far are kept, new ones (models that had none) added."""
        for name, est in (estimates or {}).items():
            if name not in self.estimates:
                self.set_estimate(name, est)
        self.policy = policy
        policy.use_estimates(self.estimates)
        policy.reanchor(now)
        self._unserved = dict(policy.unserved())

    def set_estimate(self, model: str, est: LinearLatency) -> None:
        """Replace a model's latency estimate (a new measurement, say)."""
        self.estimates[model] = est
        st = self._m[self.index[model]]
        st.estimate = est
        st.learned()

    # ------------------------------------------------------------------ admission

    def admit(self, model: str, n: int, now: float,
              payload: object = None) -> Ticket | Refusal:
        i = self.index[model]
        st = self._m[i]
        spec = st.spec
        st.counters.arrived += 1
        t = Ticket(i, n, now, now + spec.slo_s, payload)
        if st.items + n > spec.max_queue:
            return self._refusal(st, t, RefusalReason.QUEUE_FULL,
                                 f"model {model}: queue is full ({st.items} items waiting, "
                                 f"max_queue {spec.max_queue}); retry later")
        why = self._unserved.get(model)
        if why is not None:
            return self._refusal(st, t, RefusalReason.UNPLANNED,
                                 f"model {model} is not served by the current plan: {why}")
        est = self._refusing_estimate(st, now)
        if est is not None:
            cap = max(1, min(self.policy.batch_cap(model), spec.max_batch))
            ahead = st.items
            full_batches, rest = divmod(ahead, cap)
            own = min(cap, rest + n)
            start = max(now, st.run_until) if st.running else now
            finish = start + full_batches * est.estimate_s(cap) + est.estimate_s(own)
            if finish > t.deadline:
                st.est_refused_at = now
                return self._refusal(
                    st, t, RefusalReason.WORK_AHEAD,
                    f"model {model}: {ahead} items are queued ahead; at about "
                    f"{est.estimate_s(cap) * 1000:.1f} ms per batch of {cap} this request would "
                    f"finish {1000 * (finish - now):.1f} ms after arrival, over its SLO of "
                    f"{spec.slo_s * 1000:g} ms")
        elif self._probe_due(st, now):
            st.probing = True
        st.queue.append(t)
        st.items += n
        st.dirty = True
        self.queued += n
        st.counters.admitted += 1
        return t

    def _refusing_estimate(self, st: _Model, now: float) -> LinearLatency | None:
        """The estimate that may refuse requests of this model now, or None: not trusted
        yet, a probe under way, or a probe due (see the module docstring)."""
        est = st.estimate
        if est is None or not est.trusted or st.probing or self._probe_due(st, now):
            return None
        return est

    def _probe_due(self, st: _Model, now: float) -> bool:
        return (st.est_refused_at is not None and not st.running and not st.probing
                and now - st.last_done >= self.probe_s)

    @staticmethod
    def _refusal(st: _Model, t: Ticket, reason: RefusalReason, message: str) -> Refusal:
        st.counters.refused[reason.value] += 1
        return Refusal(t, reason, message)

    # ------------------------------------------------------------------ dispatch

    def views(self) -> dict[str, QueueView]:
        """Every model's view, in the core's order (remade only for models that changed;
        the dict is the core's: read it, do not keep it)."""
        out = self._views
        for name, st in zip(self.names, self._m, strict=True):
            if not st.dirty:
                continue
            st.dirty = False
            if st.queue:
                head = st.queue[0]
                out[name] = QueueView(name, st.items, head.arrival, head.deadline, st.running)
            else:
                out[name] = QueueView(name, 0, None, None, st.running)
        return out

    def step(self, now: float, *, blocked: frozenset[str] = frozenset()) -> Step:
        """Refuse what expired, ask the policy, take the launched batches off the queues.
        `blocked`: models whose worker cannot take a batch now (restarting, switching to a
        shadow): the policy sees them as busy."""
        refusals: list[Refusal] = []
        doom = self._refuse_expired(now, refusals)
        views = self.views()
        if blocked:
            views = dict(views)
            for name in blocked:
                v = views[name]
                views[name] = QueueView(name, v.items, v.head_arrival, v.head_deadline, True)
        try:
            decision = self.policy.decide(now, views)
        except Exception as e:  # noqa: BLE001 - a policy bug must not hang a client
            return Step((), tuple(refusals), (self._fail_all(f"scheduler error: {e!r}", e),),
                        None)
        launches = []
        for launch in decision.launches:
            if launch.model in blocked:
                continue
            b = self._take(launch.model, launch.max_items, launch.reuse, now, refusals)
            if b is not None:
                launches.append(b)
        wake = decision.wake_at
        if doom is not None:
            wake = doom if wake is None else min(wake, doom)
        return Step(tuple(launches), tuple(refusals), (), wake)

    def _refuse_expired(self, now: float, out: list[Refusal]) -> float | None:
        """Refuse queued tickets that cannot finish by their deadline even if run alone
        now; return when the next head will expire."""
        nxt: float | None = None
        for st in self._m:
            q = st.queue
            if not q:
                continue
            run_s = st.one_s
            if st.probing or (st.est_refused_at is not None and self._probe_due(st, now)):
                run_s = 0.0
            while q and q[0].deadline - run_s < now:
                t = q.popleft()
                self._dequeued(st, t)
                if run_s > 0:
                    st.est_refused_at = now
                out.append(self._refusal(
                    st, t, RefusalReason.EXPIRED,
                    f"model {st.spec.name}: request waited {1000 * (now - t.arrival):.1f} ms "
                    f"and can no longer be answered within its SLO of "
                    f"{st.spec.slo_s * 1000:g} ms"))
            if q:
                t_doom = q[0].deadline - run_s
                nxt = t_doom if nxt is None else min(nxt, t_doom)
        return nxt

    def _take(self, model: str, max_items: int, reuse: bool, now: float,
              refusals: list[Refusal]) -> Batch | None:
        i = self.index[model]
        st = self._m[i]
        if st.running or not st.queue:
            return None
        limit = max(1, min(max_items, st.spec.max_batch))
        q = st.queue
        tickets: list[Ticket] = []
        taken = 0
        # The first request always goes (admission checked it fits max_batch), then whole
        # requests while they fit.
        while q and (not tickets or taken + q[0].n <= limit):
            t = q.popleft()
            self._dequeued(st, t)
            tickets.append(t)
            taken += t.n
        # Refuse, rather than serve late, the heads this batch would answer after their
        # deadline: FIFO order is deadline order (one SLO per model), so only heads.
        est = self._refusing_estimate(st, now)
        if est is not None:
            k = 0
            while k < len(tickets) and tickets[k].deadline < now + est.estimate_s(taken):
                t = tickets[k]
                taken -= t.n
                st.est_refused_at = now
                refusals.append(self._refusal(
                    st, t, RefusalReason.EXPIRED,
                    f"model {model}: request waited {1000 * (now - t.arrival):.1f} ms; the next "
                    f"batch would answer it after its SLO of {st.spec.slo_s * 1000:g} ms"))
                k += 1
            tickets = tickets[k:]
        if not tickets:
            return None
        st.running = True
        st.dirty = True
        st.run_until = now + (est or st.estimate or _ZERO).estimate_s(taken)
        return Batch(model, i, tuple(tickets), taken, now, reuse)

    def _dequeued(self, st: _Model, t: Ticket) -> None:
        st.items -= t.n
        st.dirty = True
        self.queued -= t.n

    # ------------------------------------------------------------------ results

    def complete(self, batch: Batch, compute_s: float, now: float) -> tuple[Ticket, ...]:
        """The batch ran in `compute_s`: count it, learn from it, tell the policy. Returns
        its tickets for the caller to answer (every one of them: a policy that raises in
        `on_batch_done` is the caller's to log, after answering)."""
        st = self._m[batch.index]
        self._finished(st, now)
        c = st.counters
        c.batches += 1
        c.items += batch.n
        c.compute_s += compute_s
        for t in batch.tickets:
            c.served += 1
            c.queue_s += batch.started - t.arrival
            if now <= t.deadline:
                c.within_slo += 1
        if st.estimate is not None:
            if st.probing:  # the estimate was refusing requests: believe the probe
                st.estimate.remeasure(batch.n, compute_s)
            else:
                st.estimate.observe(batch.n, compute_s)
            st.learned()
        st.probing = False
        st.est_refused_at = None
        return batch.tickets

    def notify_policy(self, batch: Batch, compute_s: float, now: float) -> None:
        """`policy.on_batch_done` for a completed batch (may raise: the policy's bug)."""
        self.policy.on_batch_done(batch.model, batch.n, compute_s, now)

    def fail(self, batch: Batch, now: float) -> tuple[Ticket, ...]:
        """The batch failed (worker error or death): its tickets, to be failed."""
        st = self._m[batch.index]
        self._finished(st, now)
        st.counters.failed += len(batch.tickets)
        st.probing = False
        return batch.tickets

    def _finished(self, st: _Model, now: float) -> None:
        st.running = False
        st.dirty = True
        st.run_until = now
        st.last_done = now

    def drain(self, model: str | None = None) -> tuple[Ticket, ...]:
        """Take every queued ticket (of one model, or all) off the queues, to be failed:
        shutdown, a worker that cannot be restarted."""
        out: list[Ticket] = []
        for name, st in zip(self.names, self._m, strict=True):
            if model is not None and name != model:
                continue
            while st.queue:
                t = st.queue.popleft()
                self._dequeued(st, t)
                st.counters.failed += 1
                out.append(t)
        return tuple(out)

    def _fail_all(self, message: str, error: BaseException) -> Failure:
        return Failure(self.drain(), message, error)

    # ------------------------------------------------------------------ reading

    def counters(self, model: str) -> Counters:
        return self._m[self.index[model]].counters

    def pending(self, model: str) -> int:
        """Requests queued or in a running batch (the running batch counts as one)."""
        st = self._m[self.index[model]]
        return len(st.queue) + (1 if st.running else 0)

    def running(self, model: str) -> bool:
        return self._m[self.index[model]].running

    def queue_items(self, model: str) -> int:
        return self._m[self.index[model]].items


class _Zero:
    """An estimate of nothing (a model with no estimate at all)."""

    @staticmethod
    def estimate_s(n: int) -> float:
        return 0.0


_ZERO = _Zero()
