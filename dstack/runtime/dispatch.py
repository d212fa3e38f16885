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
  queue in time (`lanes.guest_finish`).
- `step(now)` -> `Step`: batches to launch now (their tickets taken off the queues),
  tickets refused because they can no longer make their deadline, failures (a policy that
  raised: its queued tickets, with the reason), and when to step again at the latest.
- `complete(batch, compute_s, now)` -> the batch's tickets, to be answered; feeds the
  model's latency estimate and the policy. `fail(batch, now)` -> the same tickets, to be
  failed (a worker that died, returned the wrong number of rows, ...).

- `refuse_early(model, n, now, since_s, ready_s, hold)` asks the admission rules without
  queuing (the server, before reading a request's body). `ready_s`: how long from now the
  request cannot be queued (its body still to parse). With `hold=True` a request let
  through counts as queued, one item, until `release(model)` or until its SLO has gone by.

The refusal rules, in the order admission applies them (each refusal names its reason; a
line's test, in tests/unit/test_dispatch_core.py unless named, shows it):

1. ``queue_full``: the queue (held requests included) already holds `max_queue` items.
   `test_a_full_queue_refuses_with_its_rule`,
   `test_a_request_let_through_with_a_hold_counts_as_queued_until_released_or_lapsed`.
2. ``unplanned``: the policy does not serve the model; the message says why.
   `test_unserved_models_are_refused_and_the_others_served`.
3. ``work_ahead``, passed over: a request of it expired queued while it ran no batch, and
   it has started none for `probe_s` (or its SLO): one request a `probe_s` goes through.
   `test_a_model_the_policy_passes_over_is_refused_at_admission_not_left_to_expire`.
4. ``work_ahead``, behind a probe: while a probe's batch runs, one batch may queue behind
   it, no more. `test_while_a_probes_batch_runs_one_batch_may_queue_behind_it_no_more`.
5. ``work_ahead``, no estimate to go by (not trusted yet, a probe under way or due): only
   when it cannot be queued before its deadline, or its lane mates' work that goes first
   alone takes it past it.
   `test_with_no_estimate_to_go_by_a_request_that_cannot_queue_in_time_is_refused`,
   `test_a_request_its_lane_mates_would_keep_past_its_deadline_is_refused_at_admission`.
6. ``work_ahead``, lane load: the higher tiers of its lane take LOAD_MAX of it or more.
   `test_a_low_tier_request_is_refused_while_its_lane_has_no_time_for_it`.
7. ``work_ahead``, estimated finish past the deadline: the running batch, the full batches
   ahead, its lane mates' work that goes first (`lanes.lane_start`), its own batch as the
   arrivals before its launch fill it, each batch's `overhead_s` and its answer's
   `delivery_s`; behind work on the estimate's slow end, scaled by the model's `margin`.
   `test_a_request_behind_others_is_admitted_on_the_slow_end`,
   `test_admission_counts_the_requests_that_will_join_its_batch_before_it_launches`,
   `test_admission_counts_what_a_batch_costs_beyond_its_compute`,
   `test_behind_a_full_queue_admission_keeps_misses_rare_when_batches_vary`.
   Let in all the same: a slope probe (no batch of more than one item for `probe_s`:
   `test_a_latency_line_gone_steep_cannot_hold_a_model_to_batches_of_one`), and a request
   idle guest workers would finish in time (tests/unit/test_borrow_lanes.py). An
   estimate that refused and has seen no batch for `probe_s` lets one probe through
   (`test_an_estimate_that_refuses_is_reprobed_within_the_probe_time`).
8. ``expired``, queued: it can no longer finish by its deadline even if its batch started
   now. `test_a_queued_request_that_can_no_longer_make_it_is_refused_as_expired`.
9. ``expired``, at launch: the batch it would join would end after its deadline.
   `test_a_batch_drops_the_heads_it_would_answer_late`.

Why each rule is as it is, with what was measured: `dstack.runtime.core_state`'s docstring.
An estimate is *trusted* once it has seen `TRUST_AFTER` real batches; expiry in the queue
and admission to an idle model read its fast end (`LinearLatency.refusal_s`), so a model
that goes idle always gets its next request through.

Written in Cython's pure-Python mode with `core_state.py` and `lanes.py` (setup.py compiles
the three; their .pxd files give the core their C layout; uncompiled they run as they read,
with the same results, tests/unit/test_compiled.py): the simulator drives it millions of
times an hour, so per-model state is a typed class, the objects made per request and per
step are extension types, and a queue's head is kept in typed fields.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import cython

from dstack.policies.contract import Policy, Precedence, QueueView
from dstack.policies.latency import LinearLatency
from dstack.runtime.core_state import CoreModel, RefusalReason
from dstack.runtime.lanes import LOAD_MAX

if cython.compiled:
    from cython.cimports.dstack.runtime.core_state import (
        Batch,
        Counters,
        Failure,
        Refusal,
        Step,
        Ticket,
        _Model,
    )
    from cython.cimports.dstack.runtime.lanes import guest_finish, lane_start, mates_busy
else:
    from dstack.runtime.core_state import Batch, Counters, Failure, Refusal, Step, Ticket, _Model
    from dstack.runtime.lanes import guest_finish, lane_start, mates_busy
if cython.compiled:  # a cimported type is no attribute of the module: these are its imports
    import dstack.runtime.core_state as _state

    globals().update({name: getattr(_state, name) for name in (
        "Batch", "Counters", "Failure", "Refusal", "Step", "Ticket")})

__all__ = ["Batch", "CoreModel", "Counters", "DispatchCore", "Failure", "PROBE_S", "Refusal",
           "RefusalReason", "Step", "Ticket"]

#: Seconds after which a model that refuses by estimate gets a probe request through.
PROBE_S = 1.0
#: Weight of a new batch in the mean of `overhead_s` (launch to completion minus compute).
OVERHEAD_ALPHA = cython.declare(cython.double, 0.1)
#: `delivery_s` is this quantile of the delay from a batch's end to its answers' sender,
#: tracked by steps of DELIVERY_STEP_S (up DELIVERY_Q of it, down the rest).
DELIVERY_Q = cython.declare(cython.double, 0.9)
DELIVERY_STEP_S = cython.declare(cython.double, 0.0002)

_INF = cython.declare(cython.double, math.inf)
_ALL = cython.declare(cython.int, Precedence.ALL.value)
_UNSERVED_KEY = cython.declare(cython.longlong, 1 << 60)


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
                wait_s: cython.double = lane_start(self._m, self.policy, st, t.deadline, now, 0.0)
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
                len(st.mates) > 0 and mates_busy(self._m, st, now))
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
                mates_s = lane_start(self._m, self.policy, st, t.deadline, now,
                                     launch - now) - (launch - now)
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
                    st.joinable = True  # a slope probe (`core_state` docstring)
                    return None
            if finish > t.deadline and st.guests and guest_finish(
                    self._m, self.policy, st, ahead + k, now) <= t.deadline:
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
        yet, a probe under way, or a probe due (`core_state` docstring)."""
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
                    # a probe re-measures the model's own batches (`core_state` docstring): due
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
