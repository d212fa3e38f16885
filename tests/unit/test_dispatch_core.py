"""The dispatch core on a fake clock with a fake worker: admission, refusal rules, probes,
completion, counters, and faults in the policy."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np
import pytest

from dstack.common.config import PolicyName
from dstack.common.slices import CpuSlices
from dstack.common.types import Schedule, SolverStatus
from dstack.policies.contract import Decision, ModelParams, QueueView
from dstack.policies.lane_planning import Lane, LanePlan
from dstack.policies.lane_policy import LanePolicy
from dstack.policies.latency import LinearLatency
from dstack.policies.registry import make_policy
from dstack.runtime.dispatch import (
    Batch,
    CoreModel,
    DispatchCore,
    Refusal,
    RefusalReason,
    Ticket,
)

A, B = "a", "b"


def core_for(policy: str = "shared", *, slo_s: float = 0.1, max_queue: int = 64,
             estimates: dict[str, LinearLatency] | None = None, probe_s: float = 1.0,
             policy_obj: object = None) -> DispatchCore:
    params = {m: ModelParams(m, 4, 0.0, slo_s) for m in (A, B)}
    pol = policy_obj or make_policy(PolicyName(policy), params, CpuSlices((0, 1)))
    return DispatchCore([CoreModel(m, slo_s, 4, max_queue) for m in (A, B)], pol,
                        estimates, now=0.0, probe_s=probe_s)


def trusted(k_s: float, t_s: float = 0.0) -> LinearLatency:
    return LinearLatency(k_s, t_s, observations=10)


def run(core: DispatchCore, b: Batch, seconds: float) -> tuple[Ticket, ...]:
    """The fake worker: the batch takes `seconds`, then the core is told."""
    done = core.complete(b, seconds, b.started + seconds)
    core.notify_policy(b, seconds, b.started + seconds)
    return done


def test_admitted_requests_are_launched_fifo_and_counted() -> None:
    core = core_for()
    t1, t2 = core.admit(A, 1, 0.0), core.admit(A, 2, 0.001)
    assert isinstance(t1, Ticket) and isinstance(t2, Ticket)
    assert t1.deadline == pytest.approx(0.1)
    s = core.step(0.001)
    assert [b.model for b in s.launches] == [A]
    b = s.launches[0]
    assert b.tickets == (t1, t2) and b.n == 3
    assert core.running(A) and core.queue_items(A) == 0
    assert run(core, b, 0.01) == (t1, t2)
    c = core.counters(A)
    assert (c.arrived, c.admitted, c.served, c.within_slo, c.batches, c.items) == (2, 2, 2, 2, 1, 3)
    assert not core.running(A)


def test_a_full_queue_refuses_with_its_rule() -> None:
    core = core_for(max_queue=2)
    assert isinstance(core.admit(A, 2, 0.0), Ticket)
    r = core.admit(A, 1, 0.0)
    assert isinstance(r, Refusal) and r.reason is RefusalReason.QUEUE_FULL
    assert "queue is full" in r.message
    assert isinstance(core.admit(B, 1, 0.0), Ticket)  # the other model is not affected
    assert core.counters(A).refused == {"queue_full": 1, "unplanned": 0, "work_ahead": 0,
                                        "expired": 0}


def test_work_ahead_refuses_only_on_a_trusted_estimate() -> None:
    # 40 ms per batch of up to 4, SLO 100 ms: 8 items queued ahead = two batches (80 ms)
    # then its own (40 ms) ends at 120 ms > 100 ms.
    seed = LinearLatency(0.04, 0.0)  # not trusted yet: refuses nothing
    core = core_for(estimates={A: seed})
    for _ in range(9):
        assert isinstance(core.admit(A, 1, 0.0), Ticket)
    core2 = core_for(estimates={A: trusted(0.04)})
    for _ in range(8):
        assert isinstance(core2.admit(A, 1, 0.0), Ticket)
    r = core2.admit(A, 1, 0.0)
    assert isinstance(r, Refusal) and r.reason is RefusalReason.WORK_AHEAD
    assert "8 items are queued ahead" in r.message and "SLO of 100 ms" in r.message
    # With 4 ahead it fits (one batch of 4 then its own: 80 ms).
    core3 = core_for(estimates={A: trusted(0.04)})
    for _ in range(5):
        assert isinstance(core3.admit(A, 1, 0.0), Ticket)


def test_a_queued_request_that_can_no_longer_make_it_is_refused_as_expired() -> None:
    core = core_for(estimates={A: trusted(0.03)})
    t = core.admit(A, 1, 0.0)
    assert isinstance(t, Ticket)
    core._m[0].running = True  # noqa: SLF001 - a batch of A is running (fake)
    s = core.step(0.05)
    assert s.refusals == () and s.wake_at == pytest.approx(0.07)  # 100 ms - 30 ms
    s = core.step(0.0701)
    assert [r.reason for r in s.refusals] == [RefusalReason.EXPIRED]
    assert s.refusals[0].ticket is t and "waited 70.1 ms" in s.refusals[0].message


def test_a_batch_drops_the_heads_it_would_answer_late() -> None:
    core = core_for(estimates={A: trusted(0.01, 0.02)})  # 4 items: 90 ms
    old = core.admit(A, 1, 0.0)
    new = [core.admit(A, 1, 0.04) for _ in range(3)]
    s = core.step(0.04)  # whole batch of 4 would end at 130 ms > old's 100 ms deadline
    assert [r.ticket for r in s.refusals] == [old]
    assert s.launches[0].tickets == tuple(new)


def test_an_estimate_that_refuses_is_reprobed_within_the_probe_time() -> None:
    """A stale estimate ("500 ms") refuses at first; once the model has been idle for the
    probe time the next request goes through, and its batch corrects the estimate."""
    core = core_for(estimates={A: trusted(0.5)}, probe_s=1.0)
    r = core.admit(A, 1, 0.0)
    assert isinstance(r, Refusal) and r.reason is RefusalReason.WORK_AHEAD
    assert isinstance(core.admit(A, 1, 0.5), Refusal)  # within the probe time: still refused
    probe = core.admit(A, 1, 1.0)
    assert isinstance(probe, Ticket)
    s = core.step(1.0)
    assert s.refusals == () and s.launches[0].tickets == (probe,)
    # Meanwhile the estimate refuses nothing: the probe is under way.
    assert isinstance(core.admit(A, 1, 1.001), Ticket)
    run(core, s.launches[0], 0.005)
    for _ in range(3):  # real batches: the estimate comes down and stops refusing
        s = core.step(1.01)
        for b in s.launches:
            run(core, b, 0.005)
        core.admit(A, 1, 1.01)
    assert core.estimates[A].estimate_s(1) < 0.1
    assert isinstance(core.admit(A, 1, 1.1), Ticket)


def test_while_a_probes_batch_runs_one_batch_may_queue_behind_it_no_more() -> None:
    """The estimate refuses nothing while a probe re-measures it, but only the batch after
    the probe's may fill meanwhile (the batch cap, 4): the requests beyond it would wait
    for batches nobody has measured, and under a lane mate's load they expired queued
    (237 of 255 `expired` refusals in one overload run, docs/decisions.md)."""
    core = core_for(estimates={A: trusted(0.5)}, probe_s=1.0)
    assert isinstance(core.admit(A, 1, 0.0), Refusal)
    probe = core.admit(A, 1, 1.0)
    assert isinstance(probe, Ticket)
    s = core.step(1.0)
    assert s.launches[0].tickets == (probe,)
    during = [core.admit(A, 1, 1.001 + i / 1000) for i in range(10)]
    assert [isinstance(r, Ticket) for r in during] == [True] * 4 + [False] * 6
    late = during[-1]
    assert isinstance(late, Refusal) and late.reason is RefusalReason.WORK_AHEAD
    assert "probe" in late.message and "4 items already wait" in late.message
    run(core, s.launches[0], 0.005)  # measured: the estimate judges from here
    s = core.step(1.02)
    assert s.launches[0].tickets == tuple(during[:4])


def test_unserved_models_are_refused_and_the_others_served() -> None:
    class Partial:
        name = PolicyName.SHARED

        def __init__(self) -> None:
            self.inner = make_policy(PolicyName.SHARED,
                                     {m: ModelParams(m, 4, 0.0, 0.1) for m in (A, B)},
                                     CpuSlices((0, 1)))

        def __getattr__(self, item: str) -> object:
            return getattr(self.inner, item)

        def unserved(self) -> Mapping[str, str]:
            return {B: "b needs 300 ms at batch 1 on 100%; its SLO is 100 ms"}

    core = core_for(policy_obj=Partial())
    r = core.admit(B, 1, 0.0)
    assert isinstance(r, Refusal) and r.reason is RefusalReason.UNPLANNED
    assert "needs 300 ms" in r.message
    assert isinstance(core.admit(A, 1, 0.0), Ticket)
    assert [b.model for b in core.step(0.0).launches] == [A]


class Raising:
    """A policy whose decide (or batch-done) raises, as a bug would."""

    name = PolicyName.SHARED

    def __init__(self, *, in_decide: bool = True) -> None:
        self.in_decide = in_decide
        self.fail = True

    def slices(self) -> dict:
        return {}

    def decide(self, now: float, queues: Mapping[str, QueueView]) -> Decision:
        if self.in_decide and self.fail:
            raise ZeroDivisionError("policy bug")
        from dstack.policies.contract import Launch
        return Decision(tuple(Launch(m, 4) for m, q in queues.items()
                              if q.items and not q.running))

    def on_batch_done(self, model: str, n: int, compute_s: float, now: float) -> None:
        if not self.in_decide and self.fail:
            raise ZeroDivisionError("policy bug after a batch")

    def use_estimates(self, estimates: object) -> None: ...

    def reanchor(self, now: float) -> None: ...

    def batch_cap(self, model: str) -> int:
        return 4

    def lane_mates(self, model: str) -> tuple:
        return ()

    def unserved(self) -> Mapping[str, str]:
        return {}

    def plan(self) -> None: ...

    def schedule(self) -> None: ...


def test_a_policy_raising_in_decide_fails_the_queued_requests_later_ones_are_served() -> None:
    pol = Raising()
    core = core_for(policy_obj=pol)
    t1, t2 = core.admit(A, 1, 0.0), core.admit(B, 1, 0.0)
    s = core.step(0.0)
    assert s.launches == () and len(s.failures) == 1
    f = s.failures[0]
    assert set(f.tickets) == {t1, t2} and "ZeroDivisionError" in f.message
    assert isinstance(f.error, ZeroDivisionError)
    assert core.queue_items(A) == core.queue_items(B) == 0
    pol.fail = False
    t3 = core.admit(A, 1, 0.1)
    s = core.step(0.1)
    assert s.launches[0].tickets == (t3,)


def test_a_policy_that_raises_after_a_batch_still_gets_the_batch_answered() -> None:
    pol = Raising(in_decide=False)
    core = core_for(policy_obj=pol)
    t = core.admit(A, 1, 0.0)
    b = core.step(0.0).launches[0]
    assert core.complete(b, 0.01, 0.01) == (t,)  # answered first ...
    with pytest.raises(ZeroDivisionError):
        core.notify_policy(b, 0.01, 0.01)  # ... then the policy's bug surfaces
    t2 = core.admit(A, 1, 0.02)
    assert core.step(0.02).launches[0].tickets == (t2,)


def test_a_failed_batch_returns_its_tickets_and_frees_the_model() -> None:
    core = core_for()
    t = core.admit(A, 1, 0.0)
    b = core.step(0.0).launches[0]
    assert core.fail(b, 0.01) == (t,)
    assert not core.running(A) and core.counters(A).failed == 1
    t2 = core.admit(A, 1, 0.02)
    assert core.step(0.02).launches[0].tickets == (t2,)


def test_blocked_models_launch_nothing_until_unblocked() -> None:
    core = core_for()
    t = core.admit(A, 1, 0.0)
    assert core.step(0.0, blocked=frozenset({A})).launches == ()
    assert core.step(0.001).launches[0].tickets == (t,)


def test_drain_takes_every_queued_ticket() -> None:
    core = core_for()
    ts = [core.admit(m, 1, 0.0) for m in (A, B, A)]
    assert set(core.drain()) == set(ts)
    assert core.queued == 0 and core.pending(A) == 0


def test_slower_batches_raise_the_refusal_estimate_only_slowly() -> None:
    """Contention (batches at 5x their usual time, say while refused clients flood the
    server) moves the mean at once but the fast end that refusals read only slowly, so a
    burst of slow batches does not start refusing; a faster batch brings it down at once."""
    est = LinearLatency(0.010, 0.0)
    for _ in range(5):
        est.observe(1, 0.010)
    for _ in range(20):
        est.observe(1, 0.050)
    assert est.estimate_s(1) > 0.040  # the mean follows
    assert est.refusal_s(1) < 0.020  # the fast end barely moved
    core = core_for(slo_s=0.1, estimates={A: est})
    assert isinstance(core.admit(A, 1, 0.0), Ticket)  # nothing ahead: the fast end
    for _ in range(2000):  # persistent: the fast end gets there in the end
        est.observe(1, 0.050)
    assert est.refusal_s(1) > 0.045
    est.observe(1, 0.012)
    assert est.refusal_s(1) < 0.035


def test_a_request_behind_others_is_admitted_on_the_slow_end() -> None:
    """Batches of 4 take 40 ms on the mean, 60 ms at the slow end (the spread of recent
    batches: 1.5x), 20 ms at the fast end; SLO 100 ms. To an idle model with nothing
    queued the fast end decides, so a model that goes idle always takes its next request
    (here even a model whose mean alone, 150 ms, would refuse it). A request that would
    wait behind others, queued or running, is admitted only where the slow end still
    answers it in time: under overload the queue fills to the last request admitted, and
    one admitted on the mean would be late about as often as not."""
    est = LinearLatency(0.04, 0.0, observations=10, lo_s=0.02, slow=1.5)
    core = core_for(estimates={A: est})
    for _ in range(4):  # 0 ahead: fast end; 1-3 ahead: its own batch, 60 ms at the slow end
        assert isinstance(core.admit(A, 1, 0.0), Ticket)
    r = core.admit(A, 1, 0.0)  # 4 ahead: a full batch and its own, 120 ms at the slow end
    assert isinstance(r, Refusal) and r.reason is RefusalReason.WORK_AHEAD
    assert "4 items are queued ahead" in r.message and "60.0 ms per batch" in r.message
    on_mean = core_for(estimates={A: LinearLatency(0.04, 0.0, observations=10, lo_s=0.02)})
    for _ in range(5):  # slow end == mean (no spread): 40 + 40 ms fits
        assert isinstance(on_mean.admit(A, 1, 0.0), Ticket)
    slow = core_for(estimates={A: LinearLatency(0.15, 0.0, observations=10, lo_s=0.02)})
    assert isinstance(slow.admit(A, 1, 0.0), Ticket)  # nothing ahead: the fast end (20 ms)
    assert isinstance(slow.admit(A, 1, 0.0), Refusal)  # one ahead: 150 ms at the slow end
    busy = core_for(estimates={A: LinearLatency(0.06, 0.0, observations=10, lo_s=0.02,
                                                slow=1.5)})
    assert isinstance(busy.admit(A, 1, 0.0), Ticket) and busy.step(0.0).launches
    r = busy.admit(A, 1, 0.0)  # nothing queued, but a batch runs: 90 + 90 ms at the slow end
    assert isinstance(r, Refusal) and r.reason is RefusalReason.WORK_AHEAD


def test_the_slow_end_follows_the_spread_of_batches_not_their_level() -> None:
    """`slow` is a high quantile of observed / estimated: batches that vary (8 in 10 at
    10 ms, 2 in 10 at 22 ms) put the slow end at the slow ones; one outlier moves it by one
    small step; a machine that got uniformly slower moves the mean, not the spread. (At
    25 ms the slow pair sat on the 2x far-off line of a 12.5 ms mean, where two in a row
    are believed as a change of level: which side of it they fell on was chance.)"""
    est = LinearLatency(0.010, 0.0)
    for i in range(600):
        est.observe(1, 0.022 if i % 10 >= 8 else 0.010)
    assert 0.018 < est.high_s(1) < 0.027
    assert est.estimate_s(1) < 0.015
    steady = LinearLatency(0.010, 0.0)
    for _ in range(100):
        steady.observe(1, 0.010)
    assert steady.high_s(1) == pytest.approx(0.010)
    steady.observe(1, 0.100)  # one stall
    assert steady.high_s(1) < 0.011 * 1.1
    for _ in range(300):  # twice as slow from now on
        steady.observe(1, 0.020)
    assert steady.estimate_s(1) == pytest.approx(0.020, rel=0.05)
    assert steady.high_s(1) < 0.020 * 1.1


def test_admission_counts_what_a_batch_costs_beyond_its_compute() -> None:
    """The worker times its compute (40 ms a batch here); the batch ends at the server 30
    ms later (the hand-over there and back, on a busy machine). Admission counts both:
    with a full batch of 4 queued ahead a request would end 140 ms after arrival, over its
    100 ms SLO; a core whose batches end when their compute does admits it (80 ms)."""
    def learned(extra_s: float) -> tuple[DispatchCore, float]:
        core = core_for(estimates={A: trusted(0.04)})
        now = 0.0
        for _ in range(60):
            assert isinstance(core.admit(A, 1, now), Ticket)
            b = core.step(now).launches[0]
            now += 0.04 + extra_s
            core.complete(b, 0.04, now)
        for _ in range(4):
            assert isinstance(core.admit(A, 1, now), Ticket)
        return core, now

    slow_hand_over, now = learned(0.03)
    r = slow_hand_over.admit(A, 1, now)
    assert isinstance(r, Refusal) and r.reason is RefusalReason.WORK_AHEAD
    quick, now = learned(0.0)
    assert isinstance(quick.admit(A, 1, now), Ticket)


def test_refuse_early_answers_as_admit_would_without_queuing() -> None:
    core = core_for(estimates={A: trusted(0.04)})
    assert core.refuse_early(A, 1, 0.0) is None
    c = core.counters(A)
    assert (c.arrived, c.admitted, core.queue_items(A)) == (0, 0, 0)  # nothing counted
    for _ in range(8):
        assert isinstance(core.admit(A, 1, 0.0), Ticket)
    r = core.refuse_early(A, 1, 0.0)
    assert isinstance(r, Refusal) and r.reason is RefusalReason.WORK_AHEAD
    c = core.counters(A)
    assert (c.arrived, c.admitted, c.refused["work_ahead"]) == (9, 8, 1)
    assert core.queue_items(A) == 8 and core.refuse_early(B, 1, 0.0) is None


def test_a_request_past_its_deadline_at_its_header_is_no_slope_probe() -> None:
    """A slope probe lets a request through that the estimate would refuse, to re-measure
    a bigger batch; one whose deadline went by before its header was read would only
    expire in the queue: it is refused."""
    core = core_for(estimates={A: trusted(0.04)})
    assert isinstance(core.admit(A, 1, 2.0), Ticket)
    assert core.refuse_early(A, 1, 2.0, since_s=0.09) is None  # the probe: in time, maybe
    late = core.refuse_early(A, 1, 2.0, since_s=1.0)
    assert isinstance(late, Refusal) and late.reason is RefusalReason.WORK_AHEAD


def test_refuse_early_counts_the_time_before_and_after_the_header() -> None:
    """A batch takes 40 ms, the SLO is 100 ms, the model is idle. A request whose body
    took 70 ms to arrive, or whose JSON takes 70 ms more to parse, is refused before its
    numbers are parsed, and the refusal says why; 50 ms of either is admitted."""
    core = core_for(estimates={A: trusted(0.04)})
    assert core.refuse_early(A, 1, 0.0, since_s=0.05) is None
    assert core.refuse_early(A, 1, 0.0, ready_s=0.05) is None
    late = core.refuse_early(A, 1, 0.0, since_s=0.07)
    assert isinstance(late, Refusal) and late.reason is RefusalReason.WORK_AHEAD
    assert "finish 110.0 ms after arrival" in late.message and "parse" not in late.message
    slow = core.refuse_early(A, 1, 0.0, ready_s=0.07)
    assert isinstance(slow, Refusal) and slow.reason is RefusalReason.WORK_AHEAD
    assert "its body takes about 70 ms more to arrive or parse" in slow.message
    assert core.counters(A).refused["work_ahead"] == 2


def test_a_body_still_coming_when_the_work_ahead_ends_misses_the_batch_that_starts_then() -> (
        None):
    """Batches take 20 ms + 10 ms per item; SLO 90 ms. A batch of one runs until 30 ms and
    one request waits, its body in. When the running batch ends, the waiting request's
    batch starts at once: a request whose header comes now and whose body takes 35 ms more
    is not in it, and rides the batch after (60 to 100 ms): refused at its header, rather
    than let through to be refused after its body or answered late. Its body in by 20 ms,
    it joins the batch at 30 ms (ends at 70 ms); with nobody waiting, no batch leaves
    without it and its own starts when its body is in (ends at 65 ms)."""
    def busy(waiting: int) -> DispatchCore:
        core = core_for(slo_s=0.09, estimates={A: trusted(0.02, 0.01)})
        assert isinstance(core.admit(A, 1, 0.0), Ticket)
        assert core.step(0.0).launches[0].n == 1  # runs until 30 ms
        for _ in range(waiting):
            assert isinstance(core.admit(A, 1, 0.0), Ticket)
        return core

    r = busy(1).refuse_early(A, 1, 0.0, ready_s=0.035)
    assert isinstance(r, Refusal) and r.reason is RefusalReason.WORK_AHEAD
    assert "finish 100.0 ms after arrival" in r.message
    assert "its body takes about 35 ms more to arrive" in r.message
    assert busy(1).refuse_early(A, 1, 0.0, ready_s=0.02) is None
    assert busy(0).refuse_early(A, 1, 0.0, ready_s=0.035) is None


def test_with_no_estimate_to_go_by_a_request_that_cannot_queue_in_time_is_refused() -> None:
    """Untrusted estimate (nothing refuses by it), SLO 100 ms: a request that cannot be
    queued for 120 ms (a server loop that far behind) is refused before its body is read;
    one that can in 80 ms is let through."""
    core = core_for()
    assert core.refuse_early(A, 1, 0.0, ready_s=0.08) is None
    r = core.refuse_early(A, 1, 0.0, ready_s=0.12)
    assert isinstance(r, Refusal) and r.reason is RefusalReason.WORK_AHEAD
    assert "queued no sooner than 120.0 ms after arrival" in r.message
    assert core.counters(A).refused["work_ahead"] == 1


def test_admission_counts_the_requests_that_will_join_its_batch_before_it_launches() -> None:
    """Batches take 20 ms + 10 ms per item (a full batch of 4: 60 ms); SLO 100 ms. A batch
    of 3 runs until 50 ms. A new request's batch launches then; counted as it is now (1
    item) it would end at 80 ms, but requests that arrive meanwhile join it up to the
    cap: at 100 requests/s, five come in 50 ms and its batch of 4 ends at 110 ms, late
    (before, it was admitted, then refused at launch after waiting, or answered late).
    Where requests trickle in, the same request is admitted."""
    def core_at(rate_rps: float) -> tuple[DispatchCore, float]:
        core = core_for(estimates={A: trusted(0.02, 0.01)})
        now = 0.0
        while now < 2.0:  # a steady stream, each request served alone
            assert isinstance(core.admit(A, 1, now), Ticket)
            b = core.step(now).launches[0]
            core.complete(b, 0.03, now + 0.03)
            now += 1.0 / rate_rps
        for _ in range(3):
            core.admit(A, 1, now)
        assert core.step(now).launches[0].n == 3  # runs until 50 ms
        return core, now

    busy, now = core_at(100.0)
    r = busy.admit(A, 1, now)
    assert isinstance(r, Refusal) and r.reason is RefusalReason.WORK_AHEAD
    assert "finish 110.0 ms after arrival" in r.message
    quiet, now = core_at(2.0)
    assert isinstance(quiet.admit(A, 1, now), Ticket)  # alone, it ends at 80 ms


def test_the_slo_counts_from_receipt_to_the_answer_reaching_the_sender() -> None:
    """A batch takes 60 ms; SLO 100 ms. A request whose body took 30 ms to arrive has 70
    ms left: it is admitted (60 ms), and one that took 50 ms is refused at once. Once
    answers are seen to reach their sender 30 ms after their batch (a busy event loop),
    a request with 70 ms left is refused too, and so is the queued one at launch, rather
    than answered after its SLO by the client's clock."""
    core = core_for(estimates={A: trusted(0.06)})
    t = core.admit(A, 1, 0.5, since_s=0.03)
    assert isinstance(t, Ticket) and t.deadline == pytest.approx(0.57)
    core2 = core_for(estimates={A: trusted(0.06)})
    r = core2.admit(A, 1, 0.5, since_s=0.05)
    assert isinstance(r, Refusal) and r.reason is RefusalReason.WORK_AHEAD
    for _ in range(400):
        core.observe_delivery(t.model, 0.03)
    r = core.admit(A, 1, 0.5, since_s=0.03)
    assert isinstance(r, Refusal) and "finish 120.0 ms" in r.message  # 30 + 60 + 30
    s = core.step(0.5)
    assert [x.ticket for x in s.refusals] == [t] and s.launches == ()


def overloaded(core: DispatchCore, rate_rps: float, seconds: float,
               batch_s: Callable[[int], float], seed: int = 3,
               launched: list[tuple[float, int]] | None = None) -> tuple[int, int, int]:
    """Drive model A of `core` on a fake clock: Poisson arrivals of one item at `rate_rps`
    for `seconds`, each batch of n running `batch_s(n)`. Returns (admitted, answered
    within SLO, missed): the admitted requests answered late or refused after waiting.
    `launched` gets each batch's (launch time, items)."""
    rng = np.random.default_rng(seed)
    arrivals = list(np.cumsum(rng.exponential(1 / rate_rps, int(rate_rps * seconds))))
    admitted = within = missed = 0
    running: tuple[Batch, float, float] | None = None  # the batch, its end, its compute
    wake: float | None = None
    i = 0
    while i < len(arrivals) or running is not None or core.queue_items(A):
        now = min(arrivals[i] if i < len(arrivals) else math.inf,
                  running[1] if running is not None else math.inf,
                  wake if wake is not None else math.inf)
        if running is not None and now == running[1]:
            b, end, compute = running
            for t in core.complete(b, compute, end):
                within += end <= t.deadline
                missed += end > t.deadline
            running = None
        elif i < len(arrivals) and now == arrivals[i]:
            admitted += isinstance(core.admit(A, 1, now), Ticket)
            i += 1
        s = core.step(now)
        missed += len(s.refusals)  # every refusal in a step is of an admitted request
        for b in s.launches:
            compute = batch_s(b.n)
            running = (b, now + compute, compute)
            if launched is not None:
                launched.append((now, b.n))
        wake = s.wake_at if s.wake_at is None or s.wake_at > now else None
    return admitted, within, missed


def test_behind_a_full_queue_admission_keeps_misses_rare_when_batches_vary() -> None:
    """Batches take 10 ms + 5 ms per item times a spread (12% lognormal, one batch in 20
    half again as long); SLO 100 ms; three times as many requests arrive as a batch of 4
    every 30 ms can serve. Every request is admitted at the margin of a full queue, and
    on the 90th-percentile slow end of one batch 2.2% of them were answered late or
    refused after waiting. The core widens its margin on each miss until they are rare,
    and serves as many within their SLO."""
    def spread(rng: np.random.Generator) -> Callable[[int], float]:
        def batch_s(n: int) -> float:
            stall = 1.5 if rng.random() < 0.05 else 1.0
            return (0.01 + 0.005 * n) * stall * float(rng.lognormal(0.0, 0.12))
        return batch_s

    for seed in (1, 2, 3):
        batch_s = spread(np.random.default_rng(seed))
        core = core_for(estimates={A: trusted(0.01, 0.005)})
        admitted, within, missed = overloaded(core, 400.0, 60.0, batch_s, seed)
        assert missed <= 0.01 * admitted
        assert within >= 0.9 * 60.0 * 4 / 0.03  # a batch of 4 every 30 ms, for a minute


def test_a_latency_line_gone_steep_cannot_hold_a_model_to_batches_of_one() -> None:
    """Seen under overload on the real server: a line through 7.6 ms for one item and 29
    ms for two, with a slow end of 2x, refuses every request that would wait behind a
    running batch (SLO 60 ms), so only batches of one run, and they measure nothing but a
    batch of one. The batches really take 4 ms + 3 ms an item. Within a second (the probe
    time) a request is admitted behind work whatever the estimate says, with those that
    join its batch; that batch re-measures the line, and the model is back to full
    batches. (Without it: batches of 1.0 for the whole run, the line steeper still.)"""
    est = LinearLatency(-0.0142, 0.0218, observations=10, p_kk=1.0, p_kt=0.0, p_tt=1.0,
                        slow=2.0)
    core = core_for(slo_s=0.06, estimates={A: est})
    launched: list[tuple[float, int]] = []
    admitted, within, missed = overloaded(core, 400.0, 10.0, lambda n: 0.004 + 0.003 * n,
                                          launched=launched)
    later = [n for t, n in launched if t >= 3.0]
    assert sum(later) / len(later) > 3.5  # max batch 4
    assert est.estimate_s(4) == pytest.approx(0.016, rel=0.3)
    assert missed <= 0.01 * admitted


def test_a_model_whose_batches_of_two_do_not_fit_gets_one_probe_batch_a_second() -> None:
    """Batches of one that really take 40 ms, two 75 ms, SLO 60 ms: batches of one are
    right, and the probes that test a bigger batch cost at most one batch a probe time."""
    core = core_for(slo_s=0.06, estimates={A: trusted(0.005, 0.035)}, probe_s=1.0)
    launched: list[tuple[float, int]] = []
    overloaded(core, 100.0, 10.0, lambda n: 0.005 + 0.035 * n, launched=launched)
    bigger = [t for t, n in launched if n > 1]
    assert 1 <= len(bigger) <= 11
    assert all(b - a >= 1.0 for a, b in zip(bigger, bigger[1:], strict=False))


class AFirst(Raising):
    """One batch at a time on the whole device, A's before B's: B runs only when A has
    nothing queued (the low tier of a lane that A keeps busy)."""

    def __init__(self) -> None:
        super().__init__()
        self.fail = False

    def decide(self, now: float, queues: Mapping[str, QueueView]) -> Decision:
        from dstack.policies.contract import Launch
        if any(q.running for q in queues.values()):
            return Decision(())
        for m in (A, B):
            if queues[m].items:
                return Decision((Launch(m, 4),))
        return Decision(())


def test_a_model_the_policy_passes_over_is_refused_at_admission_not_left_to_expire() -> None:
    """A keeps the device busy (400 requests/s against 200/s it can serve) until 3 s; B
    (20 requests/s) runs only when A has nothing queued. Before, every B request was
    admitted and refused `expired` after its whole SLO; now, once one has expired and B
    has started no batch for a second, B's requests are refused from admission, all but
    one a second; and once A's load stops, B's next request gets through and B is served
    again."""
    core = core_for(policy_obj=AFirst(), estimates={A: trusted(0.005), B: trusted(0.005)})
    dt, running = 0.005, []
    outcome: dict[str, list[tuple[float, str]]] = {A: [], B: []}
    for i in range(int(4.0 / dt)):
        now = i * dt
        for b in [b for b in running if b.started + 0.02 <= now]:
            running.remove(b)
            for t in run(core, b, 0.02):
                outcome[core.names[t.model]].append((t.arrival, "served"))
        arrivals = ([A, A] if now < 3.0 else []) + ([B] if i % 10 == 0 else [])
        for m in arrivals:
            r = core.admit(m, 1, now)
            if isinstance(r, Refusal):
                outcome[m].append((now, r.reason.value))
        s = core.step(now)
        for r in s.refusals:
            outcome[core.names[r.ticket.model]].append((r.ticket.arrival, r.reason.value))
        running.extend(s.launches)
    overload = [what for t, what in outcome[B] if 1.2 <= t < 3.0]
    assert overload.count("work_ahead") >= 32  # of 36 sent: refused when they arrive
    assert overload.count("expired") <= 2  # one let through a second, at most
    after = [what for t, what in outcome[B] if t >= 3.2]
    assert after and set(after) == {"served"}
    assert [what for t, what in outcome[A] if t < 3.0].count("served") > 400


def test_a_model_counts_its_time_without_a_batch_from_when_serving_began() -> None:
    """The server's clock is the machine's monotonic clock (1,000 s after boot here). A
    model whose first request expired behind another model's batch is not shut out until
    it has started no batch for `probe_s` since serving began; and the refusal then counts
    from there. Before, both counted from the clock's zero: right after start the second
    request was refused, saying none of its batches had started for 1,000,300 ms."""
    start = 1000.0
    core = DispatchCore([CoreModel(m, 0.1, 4, 64) for m in (A, B)], AFirst(),
                        {A: trusted(0.005), B: trusted(0.005)}, now=start, probe_s=1.0)
    assert isinstance(core.admit(A, 1, start), Ticket)
    assert isinstance(core.admit(B, 1, start), Ticket)
    assert [b.model for b in core.step(start).launches] == [A]  # ... and never ends
    assert [r.reason for r in core.step(start + 0.15).refusals] == [RefusalReason.EXPIRED]
    assert isinstance(core.admit(B, 1, start + 0.2), Ticket)
    assert isinstance(core.admit(B, 1, start + 0.3), Ticket)
    core.step(start + 1.5)  # both expired: B has started no batch for 1.5 s
    assert isinstance(core.admit(B, 1, start + 1.5), Ticket)  # one let through a second
    r = core.admit(B, 1, start + 1.6)
    assert isinstance(r, Refusal) and r.reason is RefusalReason.WORK_AHEAD
    assert "none of its batches has started for 1600 ms" in r.message


def test_under_temporal_a_request_that_another_models_running_batch_keeps_past_its_deadline_is_refused_at_once() -> None:  # noqa: E501
    """`temporal` runs one batch at a time on the whole device: a request of B that comes
    while a 200 ms batch of A runs cannot make its 100 ms SLO, and is refused as it
    arrives rather than admitted to expire; one that comes near that batch's end is
    admitted, and its batch is the next."""
    slos = {A: 0.5, B: 0.1}
    params = {m: ModelParams(m, 4, 0.0, slo) for m, slo in slos.items()}
    core = DispatchCore([CoreModel(m, slo, 4, 64) for m, slo in slos.items()],
                        make_policy(PolicyName.TEMPORAL, params, CpuSlices((0, 1))),
                        {A: trusted(0.2), B: trusted(0.005)}, now=0.0)
    for _ in range(4):
        core.admit(A, 1, 0.0)
    (a,) = core.step(0.0).launches
    r = core.admit(B, 1, 0.01)
    assert isinstance(r, Refusal) and r.reason is RefusalReason.WORK_AHEAD
    assert "190.0 ms of work of the models that share its slice before it" in r.message
    t = core.admit(B, 1, 0.15)
    assert isinstance(t, Ticket)
    run(core, a, 0.2)
    assert [b.tickets for b in core.step(0.2).launches] == [(t,)]


def one_lane(low: tuple[str, ...] = (), b_s: float = 0.035) -> DispatchCore:
    """A (60 ms SLO, 8 ms a request) and B (250 ms, `b_s`) in one lane of one core, batches
    of one: the `dstack` plan for mobilenet_v3_small and resnet18 on one core. EDF between
    them, or B only when A has nothing queued (`low`)."""
    lane = Lane(100.0, (0,), (A, B), (1, 1), 43.0, low=low)
    plan = LanePlan((), 43.0, 0.0, SolverStatus.OPTIMAL, lanes=(lane,))
    params = {A: ModelParams(A, 1, 0.0, 0.06), B: ModelParams(B, 1, 0.0, 0.25)}
    policy = LanePolicy(params, CpuSlices((0,)), plan, Schedule(43.0, ()))
    return DispatchCore([CoreModel(A, 0.06, 1, 64), CoreModel(B, 0.25, 1, 64)], policy,
                        {A: trusted(0.008), B: trusted(b_s)}, now=0.0)


def lane_outcomes(core: DispatchCore, a_rps: float, b_rps: float, seconds: float = 6.0,
                  since: float = 1.0) -> dict[str, dict[str, int]]:
    """Poisson arrivals of A and B on a 0.5 ms clock, each batch taking its model's time;
    per model, how many of the requests that arrived from `since` on (once the arrival
    rates the core measures have settled) were served in time, late, or refused by each
    rule."""
    rng = np.random.default_rng(5)
    run_s = {A: 0.008, B: 0.035}
    out: dict[str, dict[str, int]] = {A: {}, B: {}}

    def note(m: str, what: str, arrival: float) -> None:
        if arrival >= since:
            out[m][what] = out[m].get(what, 0) + 1

    running: list[tuple[Batch, float]] = []
    dt = 0.0005
    for i in range(int(seconds / dt)):
        now = i * dt
        for b, end in [x for x in running if x[1] <= now]:
            running.remove((b, end))
            for t in run(core, b, end - b.started):
                note(core.names[t.model], "served" if end <= t.deadline else "late",
                     t.arrival)
        for m, rate in ((A, a_rps), (B, b_rps)):
            for _ in range(rng.poisson(rate * dt)):
                r = core.admit(m, 1, now)
                if isinstance(r, Refusal):
                    note(m, r.reason.value, now)
        s = core.step(now)
        for r in s.refusals:
            note(core.names[r.ticket.model], r.reason.value, r.ticket.arrival)
        running += [(b, now + run_s[b.model] * b.n) for b in s.launches]
    return out


def test_a_request_its_lane_mates_would_keep_past_its_deadline_is_refused_at_admission() -> (
        None):
    """EDF in one lane: B's request waits for every A request due before it, those that
    arrive meanwhile too. With A at 4x what the lane serves, admission counted only B's
    own (empty) queue: B's requests were admitted and refused `expired` after waiting
    most of their 250 ms (here 56 of 93, and 4 answered late). Now they are refused on
    arrival, all but a few; A is served as before; and at a load the lane can carry, B
    is served. No probe is admitted on A's account: a probe re-measures B's own batches,
    which did not refuse (with one a second after each refusal, 7 of B's requests were
    late or expired here; 3 with one after each of B's requests that expired waiting
    for A's work; none now)."""
    over = lane_outcomes(one_lane(), 480.0, 20.0)
    b = over[B]
    assert b.get("work_ahead", 0) >= 0.8 * sum(b.values())
    assert b.get("expired", 0) + b.get("late", 0) <= 1
    assert over[A]["served"] >= 0.95 * 5 / 0.008  # the lane stays busy with A
    light = lane_outcomes(one_lane(), 50.0, 10.0)
    assert light[B]["served"] >= 0.9 * sum(light[B].values())
    assert light[A]["served"] >= 0.95 * sum(light[A].values())


def test_a_request_that_expired_waiting_for_its_lane_mates_makes_no_probe_due() -> None:
    """B (220 ms a request, SLO 250 ms) had a request expire while A's batch held the
    lane. That says nothing about B's own estimate, so no probe is due: a second later,
    behind about 50 ms of A's work, B's next request is judged by B's estimate (it would
    end about 273 ms after arrival) and refused at once. Before, it was admitted as a
    probe, whatever the estimate said."""
    core = one_lane(b_s=0.22)
    assert isinstance(core.admit(A, 1, 0.0), Ticket)
    (a1,) = core.step(0.0).launches
    assert isinstance(core.admit(B, 1, 0.001), Ticket)
    assert [r.reason for r in core.step(0.06).refusals] == [RefusalReason.EXPIRED]
    core.fail(a1, 0.1)  # A's worker died: the lane is free, nothing learnt
    for _ in range(6):
        assert isinstance(core.admit(A, 1, 1.2), Ticket)
    assert [b.model for b in core.step(1.2).launches] == [A]
    r = core.admit(B, 1, 1.2)
    assert isinstance(r, Refusal) and r.reason is RefusalReason.WORK_AHEAD
    assert "of work of the models that share its slice before it" in r.message
    assert "would finish 273" in r.message


def test_a_low_tier_request_is_refused_while_its_lane_has_no_time_for_it() -> None:
    """B runs only when A has nothing queued: while A's admitted requests take all of the
    lane, B's are refused on arrival, saying why; when A leaves it room, B is served."""
    core = one_lane(low=(B,))
    over = lane_outcomes(core, 480.0, 20.0)
    b = over[B]
    assert b.get("work_ahead", 0) >= 0.9 * sum(b.values())
    assert b.get("expired", 0) + b.get("late", 0) <= 3  # 5 when one a second got through
    r = core.admit(B, 1, 6.0)
    assert isinstance(r, Refusal) and "(a) take 95% of it or more" in r.message
    light = lane_outcomes(one_lane(low=(B,)), 50.0, 10.0)
    assert light[B]["served"] >= 0.9 * sum(light[B].values())


def test_a_request_let_through_with_a_hold_counts_as_queued_until_released_or_lapsed() -> None:
    """The server checks a request at its header, then reads its body, then admits it;
    a hold keeps its place meanwhile. Twenty at one instant: without holds every one
    passes (nothing is queued yet); with them, those the queue has room for pass and the
    rest are refused. A release gives a place back; a hold not given back lapses after
    the SLO."""
    core = core_for(estimates={A: trusted(0.01, 0.005)})  # a batch of 4: 30 ms; SLO 100 ms
    assert all(core.refuse_early(A, 1, 0.0) is None for _ in range(20))
    passed = [core.refuse_early(A, 1, 0.0, hold=True) is None for _ in range(20)]
    assert 4 <= sum(passed) < 20 and passed.index(False) == sum(passed)
    r = core.refuse_early(A, 1, 0.0)
    assert isinstance(r, Refusal) and r.reason is RefusalReason.WORK_AHEAD
    core.release(A)
    assert core.refuse_early(A, 1, 0.0) is None
    assert core.refuse_early(A, 1, 0.101) is None  # the holds lapsed with the SLO
    core.release("no such model")  # nothing to give back: ignored


def test_a_refusal_by_work_ahead_stands_as_long_as_the_core_would_repeat_it() -> None:
    """A front end answers a model's next requests with a refusal while it stands
    (`Refusal.stands_s`, `server.link.StandingRefusals`): the core itself must refuse a
    request that comes within that time, and take one that comes just after it."""
    core = core_for(estimates={A: trusted(0.04)})
    for _ in range(8):
        assert isinstance(core.admit(A, 1, 0.0), Ticket)
    assert [b.n for b in core.step(0.0).launches] == [4]  # 4 run, 4 wait
    r = core.refuse_early(A, 1, 0.0)
    assert isinstance(r, Refusal) and r.reason is RefusalReason.WORK_AHEAD
    assert 0.0 < r.stands_s < 0.1
    within = core.refuse_early(A, 1, 0.95 * r.stands_s)
    assert isinstance(within, Refusal) and within.reason is RefusalReason.WORK_AHEAD
    assert core.refuse_early(A, 1, 1.05 * r.stands_s) is None
    # Refusals counted without asking (a front end's, within one) count as the core's do.
    c = core.counters(A)
    refused, arrived = c.refused["work_ahead"], c.arrived
    core.count_refused(A, "work_ahead", 3)
    assert (c.refused["work_ahead"], c.arrived) == (refused + 3, arrived + 3)
    # A refusal with no predicted finish (a full queue) does not stand.
    full = core_for(max_queue=1)
    assert isinstance(full.admit(A, 1, 0.0), Ticket)
    q = full.refuse_early(A, 1, 0.0)
    assert isinstance(q, Refusal) and q.reason is RefusalReason.QUEUE_FULL and q.stands_s == 0
