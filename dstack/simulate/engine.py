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
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from dstack.policies import Policy, QueueView

INF = math.inf
_NUDGE_S = 1e-9


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
    n_models = len(models)
    names = [m.name for m in models]
    index = {n: j for j, n in enumerate(names)}
    slo = [m.slo_s for m in models]
    cap = [m.max_batch for m in models]
    max_queue = [m.max_queue for m in models]
    pct = [m.percent for m in models]
    table = [m.latency_s for m in models]
    lat_est = getattr(policy, "latency", {})
    est = [lat_est.get(n) for n in names]
    counts = [ModelCounts() for _ in models]
    # estimate(1) and SLO - estimate(1) per model, the admission and doom tests: kept here
    # and refreshed when the model's latency estimate learns (after each of its batches),
    # which is the only time they change.
    # As in the runtime, an estimate refuses nothing until it is trusted (a few observed
    # batches); the runtime's stale-estimate probe is not modelled (the simulated batches
    # always run at the profile's latency, so an estimate cannot stay too slow).
    one = [e.estimate_s(1) if e is not None and e.trusted else 0.0 for e in est]
    limits = [slo[j] - one[j] for j in range(n_models)]

    queues: list[deque[float]] = [deque() for _ in models]  # arrival times
    running = [False] * n_models
    rem = [0.0] * n_models  # solo work left in the running batch
    bstart = [0.0] * n_models
    breqs: list[list[float]] = [[] for _ in models]
    breuse = [False] * n_models
    active: list[int] = []
    views: dict[str, QueueView] = {n: QueueView(n, 0, None, None, False) for n in names}
    dirty = [False] * n_models
    lat_out = array("d")
    timeline: list[BatchSpan] = []

    load = 0.0  # S, sum of running percentages
    rate = 1.0
    last = 0.0
    busy = 0.0
    t_fin = INF
    fin_j = -1
    wake = INF
    queued = 0
    decisions = 0
    i = 0
    n_arr = len(times)
    decide = policy.decide
    done_cb = policy.on_batch_done

    def advance(now: float) -> None:
        nonlocal last, busy
        dt = now - last
        if dt > 0 and active:
            used = dt * rate
            for j in active:
                rem[j] -= used
            hi = now if now < duration_s else duration_s
            if hi > last:
                busy += (load if load < 100.0 else 100.0) / 100.0 * (hi - last)
        last = now

    def reschedule() -> None:
        nonlocal rate, t_fin, fin_j
        rate = 1.0 if load <= 100.0 else 100.0 / load
        t_fin, fin_j = INF, -1
        for j in active:
            t = last + rem[j] / rate
            if t < t_fin:
                t_fin, fin_j = t, j

    def dispatch(now: float) -> None:
        nonlocal wake, queued, load, decisions
        # Refuse the doomed (Runtime._refuse_doomed).
        doom = INF
        for j in range(n_models):
            q = queues[j]
            if not q:
                continue
            limit = limits[j]
            while q and q[0] + limit < now:
                q.popleft()
                queued -= 1
                counts[j].refused_deadline += 1
                dirty[j] = True
            if q and q[0] + limit < doom:
                doom = q[0] + limit
        for j in range(n_models):
            if dirty[j]:
                q = queues[j]
                head = q[0] if q else None
                views[names[j]] = QueueView(names[j], len(q), head,
                                            None if head is None else head + slo[j], running[j])
                dirty[j] = False
        decisions += 1
        d = decide(now, views)
        for launch in d.launches:
            j = index[launch.model]
            q = queues[j]
            if running[j] or not q:
                continue
            k = max(1, min(launch.max_items, cap[j], len(q)))
            # Refuse, rather than serve late, the heads the batch would finish after
            # their deadline (Runtime._launch).
            e = est[j]
            if e is not None and e.trusted:
                while k and q[0] + slo[j] < now + e.estimate_s(k):
                    q.popleft()
                    queued -= 1
                    k -= 1
                    counts[j].refused_deadline += 1
                if not k:
                    dirty[j] = True
                    continue
            reqs = [q.popleft() for _ in range(k)]
            queued -= k
            advance(now)
            running[j] = True
            rem[j] = table[j][k]
            bstart[j] = now
            breqs[j] = reqs
            breuse[j] = launch.reuse
            active.append(j)
            load += pct[j]
            reschedule()
            dirty[j] = True
        w = d.wake_at if d.wake_at is not None else INF
        if doom < w:
            w = doom
        if w <= now:
            w = now + _NUDGE_S
        wake = w

    while True:
        ta = times[i] if i < n_arr else INF
        if ta == INF and not active and queued == 0:
            break
        if t_fin <= ta and t_fin <= wake:
            now = t_fin
            j = fin_j
            advance(now)
            active.remove(j)
            load -= pct[j]
            if not active:
                load = 0.0  # no drift from float sums
            running[j] = False
            reqs = breqs[j]
            k = len(reqs)
            c = counts[j]
            c.batches += 1
            c.items += k
            c.served += k
            deadline_slack = now - slo[j]
            for a in reqs:
                lat_out.append(now - a)
                if a >= deadline_slack:
                    c.within_slo += 1
            compute_s = now - bstart[j]
            if bstart[j] < timeline_s:
                timeline.append(BatchSpan(names[j], bstart[j], now, pct[j], k, breuse[j]))
            e = est[j]
            if e is not None:
                e.observe(k, compute_s)
                one[j] = e.estimate_s(1) if e.trusted else 0.0
                limits[j] = slo[j] - one[j]
            done_cb(names[j], k, compute_s, now)
            reschedule()
            dirty[j] = True
            dispatch(now)
        elif ta <= wake:
            now = ta
            j = model_idx[i]
            i += 1
            c = counts[j]
            c.arrived += 1
            q = queues[j]
            if len(q) + 1 > max_queue[j]:
                c.refused_full += 1
                continue
            if one[j] > slo[j]:
                c.refused_deadline += 1
                continue
            q.append(now)
            queued += 1
            dirty[j] = True
            if not running[j]:
                dispatch(now)
        elif wake < INF:
            now = wake
            wake = INF
            dispatch(now)
        else:  # requests queued but nothing will ever move them: cannot happen (doom)
            raise AssertionError("simulator stalled with requests queued")
    end_s = last
    advance(max(last, duration_s))
    return RunResult(
        duration_s=duration_s,
        end_s=end_s,
        counts=dict(zip(names, counts, strict=True)),
        latencies_s=lat_out,
        busy_integral=busy,
        decisions=decisions,
        timeline=timeline,
    )
