"""The lane model admission reads (`dstack.runtime.dispatch`): when a batch of a model can
start, given its lane mates' work that goes first (`Policy.lane_mates`), and when its guest
workers on idle lanes would finish its queue (`Policy.guests`). Pure functions of the
core's per-model state (`core_state._Model`, in the core's order: `ms`) and the policy;
compiled with Cython (`lanes.pxd` declares them for the core).
"""

from __future__ import annotations

import math

import cython

from dstack.policies.contract import Precedence

if cython.compiled:
    from cython.cimports.dstack.runtime.core_state import _Model
else:
    from dstack.runtime.core_state import _Model

#: A model whose lane's higher tiers take this share of the device or more (their
#: admitted items at their estimates) is refused at admission: its turn would not come.
LOAD_MAX = 0.95
_LOAD_MAX = cython.declare(cython.double, LOAD_MAX)

_INF = cython.declare(cython.double, math.inf)
_RUNNING = cython.declare(cython.int, Precedence.RUNNING.value)
_ALL = cython.declare(cython.int, Precedence.ALL.value)


@cython.cfunc
def mates_busy(ms: list, st: _Model, now: cython.double) -> cython.bint:
    """Whether a lane mate of `st` runs a batch, or has queued work that goes first."""
    i: cython.Py_ssize_t
    m: _Model
    for i in range(len(st.mates)):
        m = ms[st.mates[i]]
        if m.running or (m.qlen and st.mate_kinds[i] != _RUNNING):
            return True
    return False


@cython.cfunc
def lane_start(ms: list, policy: object, st: _Model, deadline: cython.double,
               now: cython.double, own_s: cython.double) -> cython.double:
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
        m = ms[st.mates[i]]
        kind = st.mate_kinds[i]
        if m.running and m.run_high_until > now:
            fixed += m.run_high_until - now
        if kind == _RUNNING or not m.trusted:
            continue
        mcap = policy.batch_cap(m.name)
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
    if load >= _LOAD_MAX:
        return _INF
    s = fixed / (1.0 - load)
    return s if s > lo else lo


@cython.cfunc
def guest_finish(ms: list, policy: object, st: _Model, items: cython.longlong,
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
        g = ms[j]
        if left <= 0:
            break
        if g.running or not g.trusted or mates_busy(ms, g, now):
            continue
        cap = policy.batch_cap(g.name)
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
