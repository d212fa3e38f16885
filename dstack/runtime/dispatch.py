"""The dispatch core: queues, admission, refusals, latency estimates and counters.

Pure: the clock is passed in; no asyncio, threads, processes or I/O. The asyncio runtime
(`dstack.runtime.serving`) and the simulator (`dstack.simulate.engine`) both drive this one
object, so the rules below are written once and what wins in simulation is what runs.

Driving it:

- `admit(model, n, now, payload)` -> a queued `Ticket`, or a `Refusal` saying which rule
  refused it. `payload` is the caller's (the runtime's request with its future; the
  simulator's nothing). A served model with replicas (`groups`: its name -> its workers'
  names, `dstack.policies.replicas`) is admitted to the replica with the fewest items
  waiting, an idle one first, one the plan leaves out last; the ticket's `model` is that
  replica's position. Its `counters` and `pending` are the replicas' summed. A *guest*
  worker (`Policy.guests`: the `dstack` policy's worker of a model on another lane) has
  no queue: a `Launch` with `on` set takes from its host's queue onto it, and admission
  lets in a request its own worker would finish late when idle guests can take the
  queue in time (`_guest_finish`).
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
  queued for the model (in batches of the policy's batch cap, after the running batch),
  and its lane mates' work that goes first (below), plus the request's own batch ends
  after its deadline; with no estimate that may refuse (not trusted yet, a probe under
  way), when the request could not even be queued before its deadline (`ready_s`,
  below), or its lane mates' work alone would take it past its deadline.
- ``expired``: while queued, the request can no longer finish by its deadline even if its
  batch started now (one item's estimate; only the deadline itself while the estimate is
  not trusted); or, at launch, the batch it would join would end after its deadline.

A model the policy passes over is refused at admission, not left to expire. Each request
admitted to it would have its body read and wait its whole SLO, only to be refused
`expired` (the low tier of a lane that its other models keep busy under overload: on one
CPU core, most of resnet18's requests; measured in docs/decisions.md). So once one of
its requests has expired in the queue while none of its batches ran, and it has started
no batch for `probe_s` (or its SLO, if longer), ``work_ahead`` refuses its requests, all
but one each `probe_s`; the first batch it starts lifts that. (After one SLO without a
batch instead, models that take turns on the device in rounds longer than their SLO were
refused requests that their next turn would have served: the `temporal` baseline lost a
fifth of its goodput in `make bench-policies`.)

Admission counts a lane's other models too (`Policy.lane_mates`: models that run one
batch at a time with this one, as the `dstack` policy's lanes do, and `temporal`'s one
lane, the whole device; the concurrent baselines declare none). A request waits for their
running batch; for all the queued work of a higher tier, and the share of the device that
tier's admitted items keep taking while it waits (`load`: the request starts after a busy
period, work / (1 - load), in a fluid model; at LOAD_MAX or more it is refused outright);
and, for an earliest-deadline peer, its queued requests due before this one and those that
arrive while they would still be due before it. Counting only the model's own queue, a
request of resnet18 sharing one core's lane with mobilenet_v3_small (SLOs 250 and 60 ms)
under overload was admitted to an empty queue and then waited while every mobilenet
request due before it ran: about 500 of them a 30-second window were refused `expired`
after 216 ms, and those set the p99 of all refusals (measured in docs/decisions.md).

Expiry in the queue reads the estimate's fast end (`LinearLatency.refusal_s`: what recent
batches took at their quickest, rising only slowly), and so does admission of a request
to an idle model with nothing queued: it is refused only when even that says it cannot
make it, so contention cannot feed on itself through refusals and retries, and a model
that goes idle always gets its next request through. A request that would wait behind
work (queued, or a running batch) is admitted on the estimate's *slow end*
(`LinearLatency.high_s`: the mean times a running 90th percentile of how much longer than
the mean batches run) for all of it: the running batch's end, the batches ahead, its own
batch; and that finish is scaled by the model's `margin`. Under overload the queue stays
full up to the last request admission lets in, so every request admitted is one at the
margin: on the mean about half of them were refused later, as `expired`, after waiting
most of their SLO, or answered late (measured in docs/decisions.md); on the slow end of
one batch, still one in 20 to 50 (it misses if any batch before it runs long). The
`margin` is a running quantile fed by the outcome of every request admitted behind work:
it grows on each one answered late or refused after waiting, and shrinks slowly on each
answered in time, so that MISS_Q of them miss. The trim at launch reads
the mean: that batch runs now, and its likeliest length decides which heads it would
answer late. Every batch end the core predicts adds the model's `overhead_s`: the mean of
what recent batches took from launch to `complete` beyond the compute their worker timed
(the hand-over there and back; 1.5-4.5 ms a batch on a busy 2-core machine, against 10-30
ms batches; 0 in the simulator). The end of a request's own batch also adds `delivery_s`,
what its answer then takes to reach the server's sender (`observe_delivery`), and its
batch is counted as it will be when it launches: the requests that arrive before then
join it, up to the cap (a rate of admitted items per model; under overload every batch is
full, and a request admitted on its batch as it was at arrival was refused at launch, or
answered late, whenever its batch filled up). A request's deadline counts from when the
server received it (`admit`'s `since_s`), not from when its body had been read.

`refuse_early(model, n, now, since_s, ready_s)` asks the admission rules without queuing
(the server asks it before reading a request's body, with n = 1: a refusal then costs no
body; again with the batch size once the header is parsed; and once more after the first
piece of a big JSON body). `ready_s` is how long from now the request cannot be queued:
the request joins its batch no earlier than then, and where work is ahead of it, a batch
that starts before then goes without it (the requests queued past the full batches, at
the likeliest length of their batch), so it joins a later one. The server passes the time
a big JSON body's parse will take yet, or a few times its event loop's lag, whichever is
longer (`dstack.runtime.serving.LAG_TURNS`). With `hold=True` (the server's check of a
header) a request it lets through counts as queued, one item, until `release(model)`
(when it comes back with its body read) or until its SLO has gone by: without that, requests
whose headers passed while others' bodies were still being read were refused only once
their own bodies had been read too (120 a second at 4x load on one core, against 2 with
holds; measured in docs/decisions.md).

An estimate is *trusted* once it has seen `TRUST_AFTER` real batches. An estimate that
is refusing requests is re-measured: when the model has refused by estimate (its own
batches' time: a refusal for its lane mates' work alone does not count, their batches
measure it; nor does a request that expired queued while the model ran no batch of its
own, waiting on its lane mates) and not finished a batch for `probe_s`, the next request
is admitted as a *probe* whatever the estimate says, and while that probe's batch runs
the estimate refuses nothing that would go in the batch after it: one batch's worth (the
policy's batch cap) may queue behind the probe, no more. So a stale or contended
estimate cannot shut a model out for longer than about `probe_s`. (Without that bound,
every request that came while a probe's batch ran was admitted: up to 43 items at once
behind a resnet18 probe in a lane under load, nearly all of which expired, 237 of the
255 `expired` refusals of one run; docs/decisions.md. And with probes on its lane
mates' account, resnet18 sharing one core with mobilenet_v3_small had a request about
every two seconds admitted to its empty queue and answered late: 48 in a run of 1x, 2x
and 4x windows, against 24 without them.)
While the probe waits in the queue (behind its lane mates' work), other requests are
judged as always: before, every request was admitted while it waited, and under overload
all of them expired with it. A probe that expires in the queue is over; one request a
`probe_s` at most goes through as a probe, or as the one let through while passed over.
Nor can it hold a model to batches of one: a model that refuses a request for waiting
behind work, and has launched no batch of more than one item for `probe_s`, admits it
whatever the estimate says, and then the requests that would join its batch, up to the
policy's batch cap (when that is more than one), until that batch launches. That batch
runs untrimmed and re-measures the estimate as a probe's does. (Batches of one measure a
batch of one only: a line gone steep, say 8 ms for one item and 86 ms for two, refused
everything behind work under overload and kept the model at batches of one, half its
goodput, for minutes; measured in docs/decisions.md.)

Written in Cython's pure-Python mode (setup.py compiles it; uncompiled it runs as it reads,
with the same results, tests/unit/test_compiled.py): the simulator drives it millions of
times an hour, so per-model state is a typed class, the objects made per request and per
step are extension types, and a queue's head is kept in typed fields.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

import cython

from dstack.policies.contract import Policy, Precedence, QueueView
from dstack.policies.latency import LinearLatency

#: Seconds after which a model that refuses by estimate gets a probe request through.
PROBE_S = 1.0
#: Weight of a new batch in the mean of `overhead_s` (launch to completion minus compute).
OVERHEAD_ALPHA = cython.declare(cython.double, 0.1)
#: `delivery_s` is this quantile of the delay from a batch's end to its answers' sender,
#: tracked by steps of DELIVERY_STEP_S (up DELIVERY_Q of it, down the rest).
DELIVERY_Q = cython.declare(cython.double, 0.9)
DELIVERY_STEP_S = cython.declare(cython.double, 0.0002)
#: Time constant (s) of a model's admitted-items rate, which admission reads to size the
#: batch a request will join (later arrivals fill it up to the cap before it launches).
RATE_TAU_S = cython.declare(cython.double, 1.0)
#: Admission behind work scales its predicted finish by a model's `margin`, kept so that
#: this share of the requests admitted that way miss (answered late or refused after
#: waiting): up MARGIN_STEP (relative) on a miss, down MARGIN_STEP * MISS_Q / (1 - MISS_Q)
#: on a hit, between 1 and MARGIN_MAX.
MISS_Q = cython.declare(cython.double, 0.005)
MARGIN_STEP = cython.declare(cython.double, 0.01)
MARGIN_MAX = cython.declare(cython.double, 1.5)
#: A model whose lane's higher tiers take this share of the device or more (their
#: admitted items at their estimates) is refused at admission: its turn would not come.
LOAD_MAX = cython.declare(cython.double, 0.95)

_INF = cython.declare(cython.double, math.inf)
_RUNNING = cython.declare(cython.int, Precedence.RUNNING.value)
_ALL = cython.declare(cython.int, Precedence.ALL.value)
_UNSERVED_KEY = cython.declare(cython.longlong, 1 << 60)
#: A queue's taken slots are dropped once this many have piled up at its front (_Model).
_COMPACT_AT = cython.declare(cython.Py_ssize_t, 256)


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


# The objects made per request and per step (Ticket, Refusal, Batch, Step, Counters) are
# Cython extension types when compiled: a C struct to make and read, where a Python
# dataclass runs an interpreted __init__ (frozen ones one object.__setattr__ per field).
# Dataclasses either way, with the same fields, equality and repr.


@cython.dataclasses.dataclass(eq=False)
@cython.cclass
class Ticket:
    """One admitted request: `n` items of model `model` (its index in the core)."""

    model: cython.int
    n: cython.longlong
    arrival: cython.double
    deadline: cython.double
    payload: object = None
    behind: cython.bint = False  # admitted behind work, on the `margin` (`_Model`)


@cython.dataclasses.dataclass(frozen=True)
@cython.cclass
class Refusal:
    ticket: Ticket
    reason: object  # RefusalReason
    message: str
    # How long from now the same refusal stands for the model's next requests (s): its
    # predicted finish was this far past its deadline, and a later request's deadline is
    # as much later while the work ahead of it finishes no sooner than predicted. 0 where
    # no finish was predicted (`server.frontends` refuses within it without asking).
    stands_s: cython.double = 0.0


@cython.dataclasses.dataclass(frozen=True)
@cython.cclass
class Batch:
    """A launched batch: its tickets in queue order, `n` items in all."""

    model: str
    index: cython.int
    tickets: tuple  # of Ticket
    n: cython.longlong
    started: cython.double
    reuse: cython.bint


@cython.dataclasses.dataclass(frozen=True)
@cython.cclass
class Failure:
    """Tickets taken off the queues because the dispatch path itself failed."""

    tickets: tuple  # of Ticket
    message: str
    error: object = None  # the BaseException, if any


@cython.dataclasses.dataclass(frozen=True)
@cython.cclass
class Step:
    launches: tuple = ()  # of Batch
    refusals: tuple = ()  # of Refusal
    failures: tuple = ()  # of Failure
    wake_at: object = None  # float | None


def _no_refusals() -> dict:
    return {r.value: 0 for r in RefusalReason}


@cython.dataclasses.dataclass
@cython.cclass
class Counters:
    """Per model, since start-up."""

    arrived: cython.longlong = 0
    admitted: cython.longlong = 0
    refused: dict = cython.dataclasses.field(default_factory=_no_refusals)  # per rule
    served: cython.longlong = 0
    within_slo: cython.longlong = 0
    failed: cython.longlong = 0
    batches: cython.longlong = 0
    items: cython.longlong = 0
    queue_s: cython.double = 0.0
    compute_s: cython.double = 0.0

    @property
    def refused_total(self) -> int:
        return sum(self.refused.values())


@cython.cclass
class _Model:
    """One model's queue and state (internal).

    The queue is a list read from `head` on (taken slots are set to None and dropped in
    bulk): appending to and reading a list compiles to C, where a deque's methods are
    Python calls. Its oldest ticket's arrival and deadline are copied into typed fields,
    which every step reads for every model."""

    spec: object  # CoreModel
    name: str
    slo_s: cython.double
    max_batch: cython.longlong
    max_queue: cython.longlong  # 64-bit, as every count here: any configured bound fits
    queue: list  # tickets, FIFO from `head`
    head: cython.Py_ssize_t
    qlen: cython.Py_ssize_t  # tickets queued
    items: cython.longlong  # items queued
    arrived: cython.longlong  # items ever queued (the policy's QueueView.arrived)
    head_arrival: cython.double  # of the oldest queued ticket (while qlen > 0)
    head_deadline: cython.double
    running = cython.declare(cython.bint, visibility="public")
    run_until: cython.double  # when the running batch should end (the estimate's fast end)
    run_high_until: cython.double  # ... and by its slow end (read with work queued ahead)
    last_done: cython.double  # when its last batch ended (or serving began)
    est_refused: cython.bint  # it has refused by estimate since its last finished batch
    probing: cython.bint  # a probe is queued or running (its batch is not trimmed)
    # When the last probe was admitted: a request let through whatever the estimate
    # says, or while the model is passed over (one a `probe_s` for both).
    probed_at: cython.double
    probe_deadline: cython.double  # ... and its deadline (which marks it in the queue)
    multi_at: cython.double  # when it last launched a batch of more than one item
    joinable: cython.bint  # a slope probe is queued: requests may join its batch
    slope_probe: cython.bint  # the running batch is a slope probe's (re-measures)
    launched_at: cython.double  # when it last launched a batch (or serving began)
    passed_over: cython.bint  # a request expired queued, no batch running, since then
    counters: Counters
    estimate: object  # LinearLatency | None
    # The estimate's `trusted` and one item's trusted estimate (0 while not trusted),
    # refreshed by `learned` whenever the core changes the estimate (it is the only one
    # that does): admission, the steps and launches read them for every request.
    trusted: cython.bint
    one_s: cython.double
    # What a batch costs beyond the compute its worker timed (the estimate's unit): the
    # hand-over to the worker and back, from launch to `complete`. A mean of recent
    # batches; added to every batch whose end the core predicts (0 in the simulator).
    overhead_s: cython.double
    # What an answer takes from its batch's end to its sender (the server's event loop
    # resuming the request, `observe_delivery`): a running 90th percentile, added to the
    # end of a request's own batch wherever the core predicts one (0 in the simulator).
    delivery_s: cython.double
    # Items admitted per second, decayed with RATE_TAU_S, as of `rate_at`: how fast later
    # requests join a batch that has not launched yet (refused ones never count, so a
    # storm of refusals and retries cannot inflate it). The decayed count of
    # `dstack.policies.rate_batching.ArrivalRate`, kept here as typed fields and updated
    # at each admission: that class reads a cumulative count when a policy looks, and
    # admission would look only now and then (its first look would take all the history
    # as arriving at once).
    rate: cython.double
    rate_at: cython.double
    # How much longer than the estimates say a request admitted behind work is taken to
    # need (its predicted finish is scaled by it): a running (1 - MISS_Q) quantile, fed
    # by the outcome of every such request (`outcome`). The slow end is the 90th
    # percentile of one batch; a request admitted at the margin of a full queue misses
    # if any of the batches before it, or its own, runs long.
    margin: cython.double
    unserved: object  # why the policy does not serve it (str), or None
    # Requests let through by `refuse_early(hold=True)` (the server's check of a header)
    # and not yet back (`release`) to be admitted: when each hold lapses (its SLO after
    # it was taken), oldest first. Admission counts them as queued, one item each.
    holds: list
    # Its lane mates (`Policy.lane_mates`): their positions, and for each which of its
    # work goes before a batch of this model (a `Precedence`).
    mates: list
    mate_kinds: list
    # A guest worker (`Policy.guests`): the position of the model whose queue it takes
    # batches from; it has no queue of its own. -1: a model's own worker.
    host: cython.Py_ssize_t
    guests: list  # a model's guest workers' positions
    dirty: cython.bint  # its queue view must be made again

    def __init__(self, spec: CoreModel, estimate: LinearLatency | None) -> None:
        self.spec = spec
        self.name = spec.name
        self.slo_s = spec.slo_s
        self.max_batch = spec.max_batch
        self.max_queue = spec.max_queue
        self.queue = []
        self.head = 0
        self.qlen = 0
        self.items = 0
        self.arrived = 0
        self.head_arrival = 0.0
        self.head_deadline = 0.0
        self.running = False
        self.run_until = 0.0
        self.run_high_until = 0.0
        self.last_done = 0.0
        self.est_refused = False
        self.probing = False
        self.probed_at = -_INF
        self.probe_deadline = -_INF
        self.multi_at = 0.0
        self.joinable = False
        self.slope_probe = False
        self.launched_at = 0.0
        self.passed_over = False
        self.counters = Counters()
        self.estimate = estimate
        self.unserved = None
        self.holds = []
        self.mates = []
        self.mate_kinds = []
        self.host = -1
        self.guests = []
        self.dirty = True
        self.overhead_s = 0.0
        self.delivery_s = 0.0
        self.rate = 0.0
        self.rate_at = 0.0
        self.margin = 1.0
        self.learned()

    @cython.ccall
    def learned(self) -> cython.void:
        """The estimate changed (or was set)."""
        est = self.estimate
        self.trusted = est is not None and est.trusted
        self.one_s = (est.refusal_s(1) + self.overhead_s + self.delivery_s if self.trusted
                      else 0.0)

    @cython.cfunc
    def rate_now(self, now: cython.double) -> cython.double:
        """Items admitted per second lately (see `rate`)."""
        if now <= self.rate_at:
            return self.rate
        return self.rate * math.exp((self.rate_at - now) / RATE_TAU_S)

    @cython.cfunc
    def outcome(self, t: Ticket, missed: cython.bint) -> cython.void:
        """Ticket `t` was answered (late: `missed`) or refused after it was admitted."""
        if not t.behind:
            return
        if missed:
            self.margin = min(MARGIN_MAX, self.margin * (1.0 + MARGIN_STEP))
        else:
            self.margin = max(1.0, self.margin * (1.0 - MARGIN_STEP * MISS_Q / (1.0 - MISS_Q)))

    @cython.cfunc
    def push(self, t: Ticket) -> cython.void:
        self.rate = self.rate_now(t.arrival) + t.n / RATE_TAU_S
        if t.arrival > self.rate_at:
            self.rate_at = t.arrival
        if self.qlen == 0:
            self.head_arrival = t.arrival
            self.head_deadline = t.deadline
        self.queue.append(t)
        self.qlen += 1
        self.items += t.n
        self.arrived += t.n
        self.dirty = True

    @cython.cfunc
    def first(self) -> Ticket:
        """The oldest queued ticket (qlen > 0)."""
        return self.queue[self.head]

    @cython.cfunc
    def pop(self) -> Ticket:
        """Take the oldest queued ticket (qlen > 0)."""
        q: list = self.queue
        t: Ticket = q[self.head]
        q[self.head] = None  # the caller owns the ticket (and its payload) now
        self.head += 1
        self.qlen -= 1
        self.items -= t.n
        self.dirty = True
        if self.qlen == 0:
            del q[:]
            self.head = 0
        else:
            if self.head >= _COMPACT_AT and self.head * 2 >= len(q):
                del q[:self.head]
                self.head = 0
            h: Ticket = q[self.head]
            self.head_arrival = h.arrival
            self.head_deadline = h.deadline
        return t


@cython.cclass
class _Core:
    """The dispatch core's state and rules (`DispatchCore`, below, is this class: a Python
    subclass only so that its methods can be wrapped, as tests that record every decision
    of the core do). See the module docstring."""

    names = cython.declare(list, visibility="public")  # model names, in the core's order
    index = cython.declare(dict, visibility="public")  # model name -> its position
    # served model -> its replicas' positions (models with more than one worker only)
    groups = cython.declare(dict, visibility="public")
    estimates = cython.declare(dict, visibility="public")  # model name -> LinearLatency
    _m = cython.declare(list, visibility="public")  # of _Model, in the core's order
    probe_s = cython.declare(cython.double, visibility="public")
    queued = cython.declare(cython.longlong, visibility="public")  # items over all models
    policy = cython.declare(object, visibility="public")
    _views: dict
    _unserved: dict
    n_models: cython.Py_ssize_t

    def __init__(self, models: Sequence[CoreModel], policy: Policy,
                 estimates: dict[str, LinearLatency] | None = None, *, now: float = 0.0,
                 probe_s: float = PROBE_S,
                 groups: Mapping[str, Sequence[str]] | None = None) -> None:
        self.names = [m.name for m in models]
        self.index = {m.name: i for i, m in enumerate(models)}
        self.groups = {name: [self.index[r] for r in members]
                       for name, members in (groups or {}).items() if len(members) > 1}
        self.estimates = dict(estimates or {})
        self._m = [_Model(m, self.estimates.get(m.name)) for m in models]
        self.n_models = len(self._m)
        self._views = {}
        self.probe_s = probe_s
        self.queued = 0
        self.policy = policy
        self._unserved = {}
        self.set_policy(policy, now)
        st: _Model
        for st in self._m:
            st.last_done = now
            st.launched_at = now
            st.multi_at = now

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
        st: _Model
        for st in self._m:
            st.unserved = self._unserved.get(st.name)
            mates = [(self.index[m], int(kind)) for m, kind in policy.lane_mates(st.name)
                     if m in self.index]
            st.mates = [j for j, _ in mates]
            st.mate_kinds = [kind for _, kind in mates]
            st.host = -1
            st.guests = []
        guests = getattr(policy, "guests", None)
        hst: _Model
        for guest, host in (guests() if guests is not None else {}).items():
            if guest in self.index and host in self.index:
                st = self._m[self.index[guest]]
                st.host = self.index[host]
                hst = self._m[st.host]
                hst.guests.append(self.index[guest])

    def set_estimate(self, model: str, est: LinearLatency) -> None:
        """Replace a model's latency estimate (a new measurement, say)."""
        self.estimates[model] = est
        st: _Model = self._m[self.index[model]]
        st.estimate = est
        st.learned()

    # ------------------------------------------------------------------ models

    def add_models(self, models: Sequence[CoreModel], now: float,
                   groups: Mapping[str, Sequence[str]] | None = None) -> None:
        """Serve more models (loaded at run time), after the others; `groups` as in the
        constructor, for the new ones. Hand over to a policy that serves them
        (`set_policy`) before the next step."""
        st: _Model
        for m in models:
            if m.name in self.index:
                raise ValueError(f"model {m.name} is served already")
            st = _Model(m, self.estimates.get(m.name))
            st.last_done = now
            st.launched_at = now
            self.index[m.name] = len(self._m)
            self.names.append(m.name)
            self._m.append(st)
        self.n_models = len(self._m)
        for name, members in (groups or {}).items():
            if len(members) > 1:
                self.groups[name] = [self.index[r] for r in members]

    def remove_models(self, names: Sequence[str]) -> None:
        """Stop serving models (unloaded at run time) that have nothing queued or running.
        Their places stay, empty, so that other tickets' and batches' positions hold; hand
        over to a policy without them (`set_policy`) before the next step."""
        st: _Model
        for name in names:
            st = self._m[self.index[name]]
            if st.qlen or st.running:
                raise ValueError(f"model {name} has requests queued or running")
        for name in names:
            st = self._m[self.index.pop(name)]
            st.dirty = False  # never again: views() leaves it out
            self._views.pop(name, None)
            self.estimates.pop(name, None)
            self.groups.pop(name, None)

    # ------------------------------------------------------------------ admission

    def admit(self, model: str, n: int, now: float, payload: object = None,
              since_s: float = 0.0) -> Ticket | Refusal:
        """Queue a request of `n` items for `model` (a served model with replicas: to one
        of them, see the module docstring), or refuse it. `since_s`: how long ago the
        request arrived (the server read its first byte, then its body): its deadline
        counts from then."""
        i: cython.Py_ssize_t
        group = self.groups.get(model) if self.groups else None
        i = self.index[model] if group is None else self._route(group)
        st: _Model = self._m[i]
        k: cython.longlong = n
        st.counters.arrived += 1
        # Made without its __init__ (one per request; the fields are set right here).
        t: Ticket = Ticket.__new__(Ticket)
        t.model = i
        t.n = k
        t.arrival = now - since_s if since_s > 0 else now
        t.deadline = t.arrival + st.slo_s
        t.payload = payload
        r = self._check(st, t, model, now, now)
        if r is not None:
            return r
        if self._probe_due(st, now):
            st.probing = True
            st.probed_at = now
            st.probe_deadline = t.deadline
        if self._passed_over(st, now):
            st.probed_at = now
        st.push(t)
        self.queued += k
        st.counters.admitted += 1
        return t

    def refuse_early(self, model: str, n: int, now: float, since_s: float = 0.0,
                     ready_s: float = 0.0, hold: bool = False) -> Refusal | None:
        """`admit`'s refusal for a request of `n` items, received `since_s` ago, that can
        be queued `ready_s` from now (its body still to be parsed), without queuing it:
        the Refusal (counted, as `admit` counts one), or None when `admit` would queue it
        (nothing counted: the request is admitted, and counted, by `admit` later). `hold`:
        a request let through is counted as queued until it comes back (`release`), or
        its SLO has gone by: requests whose headers pass while its body is read see it."""
        i: cython.Py_ssize_t
        group = self.groups.get(model) if self.groups else None
        i = self.index[model] if group is None else self._route(group)
        st: _Model = self._m[i]
        t: Ticket = Ticket.__new__(Ticket)
        t.model = i
        t.n = n
        t.arrival = now - since_s if since_s > 0 else now
        t.deadline = t.arrival + st.slo_s
        r = self._check(st, t, model, now, now + ready_s if ready_s > 0 else now)
        if r is not None:
            st.counters.arrived += 1
        elif hold:
            st.holds.append(now + st.slo_s)
        return r

    def count_refused(self, model: str, reason: str, n: int) -> None:
        """`n` requests for `model` were refused by rule `reason` (a RefusalReason's
        value) without asking: within a refusal that still stands (`Refusal.stands_s`).
        Counted as `refuse_early` counts its refusals (a served model with replicas: on
        its first)."""
        group = self.groups.get(model) if self.groups else None
        st: _Model = self._m[self.index[model] if group is None else group[0]]
        st.counters.arrived += n
        st.counters.refused[RefusalReason(reason).value] += n

    def release(self, model: str) -> None:
        """A request let through by `refuse_early(hold=True)` is back (to be admitted or
        refused, or gone): its hold ends (a model served by replicas: the hold of the
        replica with the most)."""
        i = self.index.get(model)
        if i is None:
            return
        st: _Model = self._m[i]
        other: _Model
        group = self.groups.get(model) if self.groups else None
        for j in group or ():
            other = self._m[j]
            if len(other.holds) > len(st.holds):
                st = other
        if st.holds:
            del st.holds[0]

    @cython.cfunc
    def _held(self, st: _Model, now: cython.double) -> cython.Py_ssize_t:
        """The model's holds that have not lapsed (those that have are dropped)."""
        holds: list = st.holds
        k: cython.Py_ssize_t = 0
        while k < len(holds) and holds[k] < now:
            k += 1
        if k:
            del holds[:k]
        return len(holds)

    @cython.cfunc
    def _check(self, st: _Model, t: Ticket, model: str, now: cython.double,
               ready: cython.double) -> object:
        """The Refusal of ticket `t` (not queued yet, and not before `ready`) by the
        admission rules, or None."""
        k: cython.longlong = t.n
        queued: cython.longlong = st.items + (self._held(st, now) if st.holds else 0)
        if queued + k > st.max_queue:
            return self._refusal(st, t, RefusalReason.QUEUE_FULL,
                                 f"model {model}: queue is full ({queued} items waiting, "
                                 f"max_queue {st.spec.max_queue}); retry later")
        why = st.unserved
        if why is not None:
            return self._refusal(st, t, RefusalReason.UNPLANNED,
                                 f"model {model} is not served by the current plan: {why}")
        if self._passed_over(st, now) and now - st.probed_at < self.probe_s:
            return self._refusal(
                st, t, RefusalReason.WORK_AHEAD,
                f"model {model}: none of its batches has started for "
                f"{1000 * (now - st.launched_at):.0f} ms (the device went to other models' "
                f"work first) and its queued requests expired; one request each "
                f"{self.probe_s:g} s is let through until a batch starts")
        # The estimate refuses nothing while a probe's batch runs; while the probe waits
        # in the queue (behind a lane mate's work) a request is judged as any other.
        est = None if not st.trusted or (st.probing and st.running) or self._probe_due(
            st, now) else st.estimate
        cap: cython.longlong = self.policy.batch_cap(model)
        if cap > st.max_batch:
            cap = st.max_batch
        if cap < 1:
            cap = 1
        if st.probing and st.running and queued + k > cap:
            return self._refusal(
                st, t, RefusalReason.WORK_AHEAD,
                f"model {model}: a probe's batch is re-measuring its latency and {queued} "
                f"items already wait for the batch after it (batch cap {cap}); retry later")
        if est is None:
            if ready > t.deadline:  # no estimate to go by: it cannot even queue in time
                return self._refusal(
                    st, t, RefusalReason.WORK_AHEAD,
                    f"model {model}: this request could be queued no sooner than "
                    f"{1000 * (ready - t.arrival):.1f} ms after arrival (its body to parse, "
                    f"or the server's loop to get to it), over its SLO of "
                    f"{st.spec.slo_s * 1000:g} ms")
            if st.mates:  # its own work unknown: its lane mates' that goes first, at least
                wait_s: cython.double = self._lane_start(st, t.deadline, now, 0.0)
                if now + wait_s > t.deadline:
                    return self._lane_refusal(st, t, model, wait_s, now + wait_s - t.deadline)
        else:
            ahead: cython.longlong = queued
            full_batches: cython.longlong = ahead // cap
            own: cython.longlong = ahead % cap + k
            if own > cap:
                own = cap
            start: cython.double = now
            per_batch: cython.double
            # It waits behind work: its own, or a lane mate's that goes first.
            slow_end: cython.bint = ahead > 0 or st.running or (
                len(st.mates) > 0 and self._mates_busy(st, now))
            if slow_end:
                if st.running and st.run_high_until > now:
                    start = st.run_high_until
                per_batch = est.high_s(cap)
            else:
                if st.running and st.run_until > now:
                    start = st.run_until
                per_batch = est.refusal_s(cap)
            per_batch += st.overhead_s
            # Its batch launches after the running one and the full batches ahead; what
            # arrives meanwhile joins it, up to the cap (under load every batch is full):
            # a request admitted on its batch as it is now would be answered late, or
            # refused at launch as `expired` after waiting, whenever its batch filled up.
            launch: cython.double = start + full_batches * per_batch
            mates_s: cython.double = 0.0  # how much later its lane mates make that
            if st.mates:
                mates_s = self._lane_start(st, t.deadline, now, launch - now) - (launch - now)
                if mates_s == _INF:  # its lane mates' load (no probe: see below)
                    return self._lane_refusal(st, t, model, mates_s, _INF)
                launch += mates_s
            if ready > launch and slow_end:
                # Its body is still to come when the work ahead ends: the batch that starts
                # then goes without it (the requests queued, bodies in, past the full
                # batches), and it can ride the one after.
                left: cython.longlong = st.items - full_batches * cap
                if left > cap:
                    left = cap
                if left > 0:
                    launch += est.estimate_s(left) + st.overhead_s
            if ready > launch:  # its body is still being parsed when its batch could go
                launch = ready
            if own < cap and launch > now:
                joining: cython.double = st.rate_now(now) * (launch - now)
                own = own + cython.cast(cython.longlong, joining + 0.5)  # the likeliest count
                if own > cap:
                    own = cap
            own_s: cython.double = est.high_s(own) if slow_end else est.refusal_s(own)
            own_s += st.overhead_s + st.delivery_s
            finish: cython.double = launch + own_s
            if slow_end:
                finish = now + (finish - now) * st.margin
                t.behind = True
                # (no probe of a request that cannot even queue before its deadline)
                if finish > t.deadline and 1 < cap and ahead + k <= cap and mates_s == 0 and (
                        ready < t.deadline) and (
                        st.joinable or now - st.multi_at >= self.probe_s):
                    st.joinable = True  # a slope probe (module docstring)
                    return None
            if finish > t.deadline and st.guests and self._guest_finish(
                    st, ahead + k, now) <= t.deadline:
                return None  # an idle lane's guest worker of the model takes it
            if finish > t.deadline:
                # A probe re-measures the model's own batches: it is due when they refused
                # the request, not when its lane mates' work did (their batches run and
                # measure it); a probe admitted on their account waits behind that work
                # and is answered late.
                if finish - mates_s * (st.margin if slow_end else 1.0) > t.deadline:
                    st.est_refused = True
                parse: str = (f" (its body takes about {1000 * (ready - now):.0f} ms more to "
                              "arrive or parse, or the server's loop that long to get to it)"
                              ) if ready - now >= 0.0005 else ""
                first: str = (f" (and {1000 * mates_s:.1f} ms of work of the models that "
                              f"share its slice before it)") if mates_s > 0 else ""
                # A finish behind work nears a later request's deadline `margin` times as
                # fast as time passes (it scales the time from now).
                return self._refusal(
                    st, t, RefusalReason.WORK_AHEAD,
                    f"model {model}: {ahead} items are queued ahead; at about "
                    f"{per_batch * 1000:.1f} ms per batch of {cap}{first} this request would "
                    f"finish {1000 * (finish - t.arrival):.1f} ms after arrival{parse}, over "
                    f"its SLO of {st.spec.slo_s * 1000:g} ms",
                    (finish - t.deadline) / (st.margin if slow_end else 1.0))
        return None

    @cython.cfunc
    def _guest_finish(self, st: _Model, items: cython.longlong,
                      now: cython.double) -> cython.double:
        """When the `items` queued for `st` (its own worker busy) would be answered by its
        guest workers whose lanes are idle now (each a batch of up to its cap, at its
        estimate's slow end), or _INF when they cannot take them all."""
        g: _Model
        cap: cython.longlong
        left: cython.longlong = items
        finish: cython.double = now
        end: cython.double
        for j in st.guests:
            g = self._m[j]
            if left <= 0:
                break
            if g.running or not g.trusted or self._mates_busy(g, now):
                continue
            cap = self.policy.batch_cap(g.name)
            if cap > g.max_batch:
                cap = g.max_batch
            if cap < 1:
                continue
            n: cython.longlong = left if left < cap else cap
            end = now + g.estimate.high_s(n) + g.overhead_s + g.delivery_s
            if end > finish:
                finish = end
            left -= n
        return finish if left <= 0 else _INF

    @cython.cfunc
    def _mates_busy(self, st: _Model, now: cython.double) -> cython.bint:
        """Whether a lane mate of `st` runs a batch, or has queued work that goes first."""
        i: cython.Py_ssize_t
        m: _Model
        for i in range(len(st.mates)):
            m = self._m[st.mates[i]]
            if m.running or (m.qlen and st.mate_kinds[i] != _RUNNING):
                return True
        return False

    @cython.cfunc
    def _lane_start(self, st: _Model, deadline: cython.double, now: cython.double,
                    own_s: cython.double) -> cython.double:
        """Seconds from `now` until a batch of `st` whose own work ahead takes `own_s` can
        start, its lane mates' work that goes first counted too (on the slow end): their
        running batches; a higher tier's queued batches and, while it waits, the share of
        the device its admitted items keep taking (`load`); an earliest-deadline peer's
        queued items due before `deadline`, and those that arrive while they would still
        be due before it (until `deadline` - its SLO). In a fluid model the start s is
        then the least solution of
            s = running + queued + load * s + sum of peer load * min(s, until peer's),
        or _INF when the higher tiers' load is LOAD_MAX or more."""
        fixed: cython.double = own_s
        load: cython.double = 0.0
        peers: list = []  # (until, load) of each earliest-deadline peer still arriving
        i: cython.Py_ssize_t
        m: _Model
        kind: cython.int
        mcap: cython.longlong
        n: cython.double
        share: cython.double
        for i in range(len(st.mates)):
            m = self._m[st.mates[i]]
            kind = st.mate_kinds[i]
            if m.running and m.run_high_until > now:
                fixed += m.run_high_until - now
            if kind == _RUNNING or not m.trusted:
                continue
            mcap = self.policy.batch_cap(m.name)
            if mcap > m.max_batch:
                mcap = m.max_batch
            if mcap < 1:
                mcap = 1
            n = m.items
            if kind != _ALL and m.qlen:
                # its queued deadlines run from its head's to about now + its SLO
                if m.head_deadline >= deadline:
                    n = 0.0
                elif now + m.slo_s > deadline:
                    n *= (deadline - m.head_deadline) / (now + m.slo_s - m.head_deadline)
            if n > 0:
                fixed += math.ceil(n / mcap) * (m.estimate.high_s(mcap) + m.overhead_s)
            share = m.rate_now(now) * (m.estimate.estimate_s(mcap) + m.overhead_s) / mcap
            if kind == _ALL:
                load += share
            elif deadline - m.slo_s > now:
                peers.append((deadline - m.slo_s - now, share))
        peers.sort()
        # Segment by segment: while s is past a peer's `until`, that peer adds
        # share * until, a constant; before it, share * s.
        arriving: cython.double = load
        for _, share in peers:
            arriving += share
        until: cython.double
        s: cython.double
        lo: cython.double = 0.0
        for until, share in peers:
            if arriving < 1.0:
                s = fixed / (1.0 - arriving)
                if s <= until:
                    return s if s > lo else lo
            fixed += share * until
            arriving -= share
            lo = until
        if load >= LOAD_MAX:
            return _INF
        s = fixed / (1.0 - load)
        return s if s > lo else lo

    def _lane_refusal(self, st: _Model, t: Ticket, model: str, wait_s: float,
                      over_s: float) -> Refusal:
        """The refusal of a request that its lane mates' work would keep from starting
        for `wait_s` (_INF: never), `over_s` past its deadline."""
        if wait_s == _INF:
            first = ", ".join([self.names[j] for j, k in zip(st.mates, st.mate_kinds,
                                                             strict=True) if k == _ALL])
            why = (f"the models whose work goes before its batches on its slice ({first}) "
                   f"take {100 * LOAD_MAX:.0f}% of it or more")
        else:
            mates = ", ".join([self.names[j] for j in st.mates])
            why = (f"the work of the models that share its slice ({mates}) that goes "
                   f"first would take {1000 * wait_s:.0f} ms")
        return self._refusal(st, t, RefusalReason.WORK_AHEAD,
                             f"model {model}: {why}; its turn would not come within its "
                             f"SLO of {st.spec.slo_s * 1000:g} ms", over_s)

    @cython.cfunc
    def _route(self, group: list) -> cython.Py_ssize_t:
        best: cython.Py_ssize_t = -1
        best_key: cython.longlong = 0
        key: cython.longlong
        i: cython.Py_ssize_t
        st: _Model
        for i in group:
            st = self._m[i]
            if st.host >= 0:  # a guest worker: it takes from its host's queue
                continue
            key = 2 * (st.items + len(st.holds)) + (1 if st.running else 0)
            if st.unserved is not None:  # left out of the plan: it would refuse
                key += _UNSERVED_KEY
            if best < 0 or key < best_key:
                best, best_key = i, key
        return best

    @cython.cfunc
    def _refusing_estimate(self, st: _Model, now: cython.double) -> object:
        """The estimate that may refuse requests of this model now, or None: not trusted
        yet, a probe under way, or a probe due (see the module docstring)."""
        if not st.trusted or st.probing or self._probe_due(st, now):
            return None
        return st.estimate

    @cython.cfunc
    @cython.inline
    def _passed_over(self, st: _Model, now: cython.double) -> cython.bint:
        return st.passed_over and now - st.launched_at > (
            st.slo_s if st.slo_s > self.probe_s else self.probe_s)

    @cython.cfunc
    @cython.inline
    def _probe_due(self, st: _Model, now: cython.double) -> cython.bint:
        return (st.est_refused and not st.running and not st.probing
                and now - st.last_done >= self.probe_s and now - st.probed_at >= self.probe_s)

    @cython.cfunc
    def _refusal(self, st: _Model, t: Ticket, reason: object, message: str,
                 stands_s: cython.double = 0.0) -> Refusal:
        st.counters.refused[reason.value] += 1
        return Refusal(t, reason, message, stands_s)

    # ------------------------------------------------------------------ dispatch

    def views(self) -> dict[str, QueueView]:
        """Every model's view, in the core's order (remade only for models that changed;
        the dict is the core's: read it, do not keep it)."""
        out: dict = self._views
        st: _Model
        for st in self._m:
            if not st.dirty:
                continue
            st.dirty = False
            if st.qlen:
                out[st.name] = QueueView(st.name, st.items, st.head_arrival, st.head_deadline,
                                         st.running, st.arrived)
            else:
                out[st.name] = QueueView(st.name, 0, None, None, st.running, st.arrived)
        return out

    def step(self, now: float, *, blocked: frozenset[str] = frozenset()) -> Step:
        """Refuse what expired, ask the policy, take the launched batches off the queues.
        `blocked`: models whose worker cannot take a batch now (restarting, switching to a
        shadow): the policy sees them as busy."""
        refusals: list = []
        doom = self._refuse_expired(now, refusals, blocked)
        views = self.views()
        if blocked:
            views = dict(views)
            for name in blocked:
                v = views[name]
                views[name] = QueueView(name, v.items, v.head_arrival, v.head_deadline, True,
                                        v.arrived)
        try:
            decision = self.policy.decide(now, views)
        except Exception as e:  # noqa: BLE001 - a policy bug must not hang a client
            return Step((), tuple(refusals), (self._fail_all(f"scheduler error: {e!r}", e),),
                        None)
        launches: list = []
        for launch in decision.launches:
            if blocked and (launch.model in blocked or launch.on in blocked):
                continue
            if launch.on is not None and launch.on not in self.index:
                continue  # a guest worker this core does not have
            b = self._take(launch.model, launch.max_items, launch.reuse, now, refusals,
                           launch.on)
            if b is not None:
                launches.append(b)
        wake = decision.wake_at
        if doom is not None:
            # min(wake, doom), and the policy's own value where they are equal
            wake = doom if wake is None or doom < wake else wake
        return Step(tuple(launches), tuple(refusals), (), wake)

    @cython.cfunc
    def _refuse_expired(self, now: cython.double, out: list, blocked: frozenset) -> object:
        """Refuse queued tickets that cannot finish by their deadline even if run alone
        now; return when the next head will expire (None: nothing is queued). A model
        that is not running, and whose worker could take a batch, was passed over."""
        nxt: cython.double = _INF
        any_left: cython.bint = False
        run_s: cython.double
        st: _Model
        for st in self._m:
            if st.qlen == 0:
                continue
            run_s = st.one_s
            if st.probing or (st.est_refused and self._probe_due(st, now)):
                run_s = 0.0
            if (not st.running and st.head_deadline - run_s < now
                    and not (blocked and st.name in blocked)):
                st.passed_over = True
            while st.qlen and st.head_deadline - run_s < now:
                t: Ticket = st.pop()
                self.queued -= t.n
                st.outcome(t, True)
                if t.deadline == st.probe_deadline:
                    st.probing = False  # the probe expired queued: it is over
                if run_s > 0 and (st.running or not st.mates):
                    # a probe re-measures the model's own batches (module docstring): due
                    # when its head waited on them, not on its lane mates' work alone
                    st.est_refused = True
                out.append(self._refusal(
                    st, t, RefusalReason.EXPIRED,
                    f"model {st.spec.name}: request waited {1000 * (now - t.arrival):.1f} ms "
                    f"and can no longer be answered within its SLO of "
                    f"{st.spec.slo_s * 1000:g} ms"))
            if st.qlen:
                t_doom: cython.double = st.head_deadline - run_s
                if not any_left or t_doom < nxt:
                    nxt = t_doom
                any_left = True
        return nxt if any_left else None

    @cython.cfunc
    def _take(self, model: str, max_items: cython.longlong, reuse: cython.bint,
              now: cython.double, refusals: list, on: object = None) -> object:
        q: _Model = self._m[self.index[model]]  # the queue it takes from
        i: cython.Py_ssize_t = self.index[model] if on is None else self.index[on]
        st: _Model = self._m[i]  # the worker that runs it
        if st.running or q.qlen == 0:
            return None
        limit: cython.longlong = max_items if max_items < st.max_batch else st.max_batch
        if limit < 1:
            limit = 1
        tickets: list = []
        taken: cython.longlong = 0
        t: Ticket
        # The first request always goes (admission checked it fits max_batch), then whole
        # requests while they fit.
        while q.qlen and (not tickets or taken + q.first().n <= limit):
            t = q.pop()
            self.queued -= t.n
            tickets.append(t)
            taken += t.n
        if taken > 1:
            st.multi_at = now
        probe: cython.bint = st.joinable and q is st  # a slope probe's batch: run as it is
        if q is st:
            st.joinable = False
        else:  # its host's queue was served
            q.launched_at = now
            q.passed_over = False
        st.slope_probe = probe
        # Refuse, rather than serve late, the heads this batch would answer after their
        # deadline: FIFO order is deadline order (one SLO per model), so only heads.
        est = None if probe else self._refusing_estimate(st, now)
        if est is not None:
            k: cython.Py_ssize_t = 0
            run_s: cython.double
            while k < len(tickets):
                t = tickets[k]
                # it runs now: its likeliest length, then its answers' way out
                run_s = est.estimate_s(taken) + st.overhead_s + st.delivery_s
                if not t.deadline < now + run_s:
                    break
                taken -= t.n
                st.est_refused = True
                st.outcome(t, True)
                refusals.append(self._refusal(
                    st, t, RefusalReason.EXPIRED,
                    f"model {model}: request waited {1000 * (now - t.arrival):.1f} ms; the next "
                    f"batch would answer it after its SLO of {st.spec.slo_s * 1000:g} ms"))
                k += 1
            if k:
                tickets = tickets[k:]
        if not tickets:
            return None
        st.running = True
        st.launched_at = now
        st.passed_over = False
        st.dirty = True
        if est is None:
            est = st.estimate
        st.run_until = now + (est.refusal_s(taken) + st.overhead_s if est is not None else 0.0)
        st.run_high_until = now + (est.high_s(taken) + st.overhead_s if est is not None else 0.0)
        return Batch(self.names[i], i, tuple(tickets), taken, now, reuse)

    # ------------------------------------------------------------------ results

    def complete(self, batch: Batch, compute_s: float, now: float) -> tuple[Ticket, ...]:
        """The batch ran in `compute_s`: count it, learn from it, tell the policy. Returns
        its tickets for the caller to answer (every one of them: a policy that raises in
        `on_batch_done` is the caller's to log, after answering)."""
        st: _Model = self._m[batch.index]
        self._finished(st, now)
        c: Counters = st.counters
        c.batches += 1
        c.items += batch.n
        c.compute_s += compute_s
        started: cython.double = batch.started
        answered: cython.double = now + st.delivery_s
        t: Ticket
        for t in batch.tickets:
            c.served += 1
            c.queue_s += started - t.arrival
            if now <= t.deadline:
                c.within_slo += 1
            st.outcome(t, answered > t.deadline)
        extra: cython.double = now - started - compute_s
        if extra < 0:
            extra = 0.0
        st.overhead_s += OVERHEAD_ALPHA * (extra - st.overhead_s)
        if st.estimate is not None:
            if st.probing or st.slope_probe:  # it was refusing requests: believe a probe
                st.estimate.remeasure(batch.n, compute_s)
            else:
                st.estimate.observe(batch.n, compute_s)
            st.learned()
        st.probing = False
        st.slope_probe = False
        st.est_refused = False
        return batch.tickets

    def notify_policy(self, batch: Batch, compute_s: float, now: float) -> None:
        """`policy.on_batch_done` for a completed batch (may raise: the policy's bug)."""
        self.policy.on_batch_done(batch.model, batch.n, compute_s, now)

    def observe_delivery(self, model: int, seconds: float) -> None:
        """An answer of the model at position `model` (a ticket's) reached its sender
        `seconds` after its batch ended (see `delivery_s`)."""
        st: _Model = self._m[model]
        step: cython.double = DELIVERY_STEP_S
        if seconds > st.delivery_s:
            st.delivery_s += step * DELIVERY_Q
        else:
            st.delivery_s = max(0.0, st.delivery_s - step * (1 - DELIVERY_Q))
        st.learned()

    def fail(self, batch: Batch, now: float) -> tuple[Ticket, ...]:
        """The batch failed (worker error or death): its tickets, to be failed."""
        st: _Model = self._m[batch.index]
        self._finished(st, now)
        st.counters.failed += len(batch.tickets)
        st.probing = False
        st.slope_probe = False
        return batch.tickets

    @cython.cfunc
    def _finished(self, st: _Model, now: cython.double) -> cython.void:
        st.running = False
        st.dirty = True
        st.run_until = now
        st.run_high_until = now
        st.last_done = now

    def drain(self, model: str | None = None) -> tuple[Ticket, ...]:
        """Take every queued ticket (of one model, or all) off the queues, to be failed:
        shutdown, a worker that cannot be restarted."""
        out: list = []
        st: _Model
        for st in self._m:
            if model is not None and st.name != model:
                continue
            while st.qlen:
                t: Ticket = st.pop()
                self.queued -= t.n
                st.counters.failed += 1
                out.append(t)
            st.joinable = False
        return tuple(out)

    @cython.cfunc
    def _fail_all(self, message: str, error: BaseException) -> Failure:
        return Failure(self.drain(), message, error)

    # ------------------------------------------------------------------ reading

    def counters(self, model: str) -> Counters:
        """A model's counters; a served model with replicas: theirs summed (a copy)."""
        group = self.groups.get(model) if self.groups else None
        st: _Model
        if group is None:
            st = self._m[self.index[model]]
            return st.counters
        out = Counters()
        for i in group:
            st = self._m[i]
            c: Counters = st.counters
            out.arrived += c.arrived
            out.admitted += c.admitted
            for rule, k in c.refused.items():
                out.refused[rule] += k
            out.served += c.served
            out.within_slo += c.within_slo
            out.failed += c.failed
            out.batches += c.batches
            out.items += c.items
            out.queue_s += c.queue_s
            out.compute_s += c.compute_s
        return out

    def pending(self, model: str) -> int:
        """Requests queued or in a running batch (the running batch counts as one); a
        served model with replicas: over all of them."""
        group = self.groups.get(model) if self.groups else None
        if group is None:
            group = [self.index[model]]
        total: cython.Py_ssize_t = 0
        st: _Model
        for i in group:
            st = self._m[i]
            total += st.qlen + (1 if st.running else 0)
        return total

    def admission_terms(self, model: str) -> tuple[float, float, float]:
        """What admission adds to `model`'s batches' compute (for /metrics): the hand-over
        of each batch (`overhead_s`), an answer's way out (`delivery_s`) and the `margin` a
        finish behind work is scaled by; a served model with replicas: the largest of
        theirs."""
        group = self.groups.get(model) if self.groups else None
        if group is None:
            group = [self.index[model]]
        over: cython.double = 0.0
        out: cython.double = 0.0
        margin: cython.double = 1.0
        st: _Model
        for i in group:
            st = self._m[i]
            over = max(over, st.overhead_s)
            out = max(out, st.delivery_s)
            margin = max(margin, st.margin)
        return over, out, margin

    def trusted_estimates(self) -> dict[str, LinearLatency]:
        """The latency estimates that real batches have confirmed, by worker name."""
        out: dict[str, LinearLatency] = {}
        st: _Model
        for i in range(len(self._m)):
            st = self._m[i]
            if st.trusted and st.estimate is not None:
                out[self.names[i]] = st.estimate
        return out

    def batch_s(self, model: str) -> float:
        """What a batch of one item of `model` takes by its estimate (its fast end, as
        admission of a request to an idle model reads it; 0 with none); a served model
        with replicas: the quickest of theirs."""
        group = self.groups.get(model) if self.groups else None
        best: cython.double = _INF
        st: _Model
        for i in group or [self.index[model]]:
            st = self._m[i]
            if st.estimate is not None:
                best = min(best, st.estimate.refusal_s(1) + st.overhead_s)
        return 0.0 if best == _INF else best

    def running(self, model: str) -> bool:
        st: _Model = self._m[self.index[model]]
        return st.running

    def queue_items(self, model: str) -> int:
        st: _Model = self._m[self.index[model]]
        return st.items


class DispatchCore(_Core):
    """See the module docstring. `estimates` (model name -> LinearLatency) are owned here
    and handed to the policy (`Policy.use_estimates`); a model without one is never
    refused by estimate."""
