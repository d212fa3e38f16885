"""The dispatch core's per-request objects and one model's queue and state
(`dstack.runtime.dispatch` is the core, which reads this module's `_Model` at C speed
through `core_state.pxd`; keep the two in step). Compiled with Cython like the core.

Why the admission rules are as they are
---------------------------------------

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import cython

from dstack.policies.latency import LinearLatency

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

_INF = cython.declare(cython.double, math.inf)
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
    running: cython.bint  # readable and settable from Python (core_state.pxd: public)
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
