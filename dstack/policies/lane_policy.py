"""The `dstack` policy: lanes shared in time, earliest deadline first within a lane.

The plan (`dstack.policies.lane_planning`, searched by `optimizer.lanes`) cuts the device
into *lanes*, disjoint slices (core sets on a CPU, MPS percentages summing to <= 100 on a
GPU). Each lane hosts one or more models; every model has a batch cap. At run time:

- a lane runs one batch at a time; whenever it is idle and some model of it has queued
  work, it starts the model whose oldest request has the earliest deadline (EDF),
  `low`-priority models only when no other model of the lane has work;
- the batch takes up to the model's cap (a model alone in its lane: up to the batch that
  runs in `LONE_BATCH_SLO` of its SLO, by its profile's shape at the live estimate's
  speed, if larger; of those, the one of the most items per second). A lone model with
  a backlog that already holds a larger batch, which its oldest request can still wait
  for (up to `SURGE_BATCH_SLO` of its SLO), takes that batch, and admission counts its
  queue at that rate: in a burst the lane serves more items a second. Heads a batch
  would answer late are refused by the dispatch core;
- lanes run concurrently; nothing waits for a timer (work-conserving);
- a burst borrows idle lanes (work-conserving across lanes): a model also has *guest*
  workers on other lanes' slices (`guests`, the widest other lanes first). A lane that is
  idle, with nothing of its own queued, runs a batch of a model whose own worker is busy
  and whose queue holds more than that worker takes, from that model's queue, in batches
  that end within the lane's gap (what its own models can wait and still meet their
  SLOs, x `GAP_SAFETY`). The dispatch core admits a request its own lane would finish
  late when idle guests can take the queue in time. Under steady load the lanes are as
  planned; under bursts the device's idle lanes serve the bursting model;
- a `low`-priority model (FIKIT) is planned into no lane width: it joins the lane with
  the most idle time whose *gap* fits a batch of it (the time its models can wait for a
  batch that started just before their request and still meet their SLOs), and runs
  only when that lane is idle and its other models have nothing queued, in batches its
  live estimate says end within the gap. So it never delays a planned model past its
  SLO by more than the estimate's error.

One lane per model is the `spatial` shape; one 100% lane with every model is the
`temporal` shape; tight-SLO models run more often than loose ones by EDF (multi-rate).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass

from dstack.common.config import PolicyName
from dstack.common.slices import SliceBackend, SliceSpec
from dstack.common.types import Plan, Schedule
from dstack.policies.contract import Decision, Launch, ModelParams, Precedence, QueueView
from dstack.policies.latency import LinearLatency

#: A model alone in its lane may batch up to what its live estimate runs in this share of
#: its SLO. GSLICE's 1/2 (wait one batch, run one) is the worst case; the dispatch core
#: refuses at admission what the queue ahead would make late, so admitted requests rarely
#: wait a whole batch. Measured on the simulator suite (bench/bench_policies.py, 60 s):
#: 0.5 left one mix at 0.973x the best baseline (median 0.839 of the ideal), 0.6 none
#: below 0.98x (median 0.810: two CPU mixes near load 0.9 lose), 0.7 was worse on both.
LONE_BATCH_SLO = 0.6
#: A lone model's backlog: a batch may run up to this share of its SLO, and no longer than
#: its oldest request can still wait. In the simulator suite (seeds 1 and 2, Poisson and
#: bursty halves) it lifted a bursty CPU mix from 0.768x to 0.979x `shared` and moved no
#: mix down by more than 3.3%; a backlog rule without the head's wait (0.9 of the SLO
#: whenever more than the cap waits) cost a bursty mix 10% (docs/decisions.md).
SURGE_BATCH_SLO = 0.9
#: A gap filler's batch must end within this share of its lane's gap (estimate error).
GAP_SAFETY = 0.8


@dataclass(frozen=True, slots=True)
class Lane:
    """A slice of `percent`% (`units`: its cores, or () on a GPU) shared in time by
    `models`, each with its batch cap; `round_ms` is the planned round (every model one
    capped batch), `low` the models that only use what the others leave idle. `fill`:
    low-priority models (FIKIT) that run only when the lane is idle and no other model of
    it has work, in batches that end within `gap_ms` x `GAP_SAFETY` (what the lane's other
    models can wait and still meet their SLOs); they are in `models` too, with no slot."""

    percent: float
    units: tuple[int, ...]
    models: tuple[str, ...]
    caps: tuple[int, ...]
    round_ms: float
    low: tuple[str, ...] = ()
    fill: tuple[str, ...] = ()
    gap_ms: float | None = None  # with gap fillers only
    #: a model alone in the lane: its profile's latency (ms) on this slice for batches
    #: 1, 2, ..., its max batch (empty: no profile)
    lone_ms: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class LanePlan(Plan):
    """A `Plan` that also says how the models share lanes (its JSON form shows them)."""

    lanes: tuple[Lane, ...] = ()
    unserved: tuple[tuple[str, str], ...] = ()  # (model, reason) never launched
    #: how the lane search ended, in words (`optimizer.lanes.SearchStatus.describe`)
    search: str = ""
    #: CBC's relative gap to its bound when the search stopped at its time limit, else 0
    gap: float = 0.0


def _thriftiest(shape: tuple[float, ...]) -> tuple[int, ...]:
    """For each batch k (1-based), the batch <= k of the most items per second by the
    latencies `shape` (ms by batch 1, 2, ...)."""
    out: list[int] = []
    best, rate = 0, 0.0
    for n, ms in enumerate(shape, start=1):
        if ms > 0 and n / ms > rate:
            best, rate = n, n / ms
        out.append(best or n)
    return tuple(out)


class LanePolicy:
    """The `dstack` policy over a `LanePlan` (module docstring)."""

    name = PolicyName.DSTACK
    concurrent = True  # lanes run side by side

    def __init__(self, models: dict[str, ModelParams], backend: SliceBackend, the_plan: Plan,
                 the_schedule: Schedule, origin: float = 0.0,
                 latency: dict[str, LinearLatency] | None = None,
                 reuse_idle: bool = True, guests: Mapping[str, str] | None = None) -> None:
        self.models = models
        self.backend = backend
        self.the_plan = the_plan
        self.the_schedule = the_schedule
        self.latency: Mapping[str, LinearLatency] = latency or {}
        lanes = getattr(the_plan, "lanes", ())
        if not lanes:  # a plain Plan: one lane per planned model
            lanes = tuple(Lane(m.percent, (), (m.model,), (m.batch,), m.latency_ms)
                          for m in the_plan.models)
        self.lanes: tuple[Lane, ...] = tuple(lanes)
        self._unserved = dict(getattr(the_plan, "unserved", ()))
        planned = {m for lane in self.lanes for m in lane.models}
        # Guest workers (`guests`: guest -> its host): the k-th guest of a model goes to
        # the k-th widest lane other than its host's (one without a lane idles).
        lane_of = {m: li for li, lane in enumerate(self.lanes) for m in lane.models}
        by_width = sorted(range(len(self.lanes)), key=lambda li: -self.lanes[li].percent)
        self._host: dict[str, str] = {}
        self._guest_lane: dict[str, int] = {}
        taken: dict[str, int] = {}
        for g, h in sorted((guests or {}).items()):
            if h not in lane_of or h in self._gap_fillers():
                continue
            others = [li for li in by_width if li != lane_of[h]]
            k = taken.get(h, 0)
            if k < len(others):
                self._host[g] = h
                self._guest_lane[g] = others[k]
                taken[h] = k + 1
        self._lane_guests = [tuple(g for g, li in self._guest_lane.items() if li == k)
                             for k in range(len(self.lanes))]
        for m in models:
            if m not in planned and m not in self._unserved and m not in (guests or {}):
                why = {s.model: s.reason for s in the_plan.shortfalls}
                self._unserved[m] = why.get(m, "not in the plan")
        self._cap = {m: c for lane in self.lanes for m, c in zip(lane.models, lane.caps,
                                                                  strict=True)}
        self._alone = {lane.models[0]: lane.lone_ms for lane in self.lanes
                       if len(lane.models) - len(lane.fill) == 1}
        # Per lone model with a profile: for each batch k, the batch <= k of the most items
        # per second (on a CPU profile a batch of 2 can run slower per item than one of 1).
        self._thrifty = {m: _thriftiest(shape) for m, shape in self._alone.items() if shape}
        self._surge: dict[str, int] = {}  # lone models with a backlog: their batch now
        # Per lane, its models in decision order: (name, tier): 0 planned, 1 low (only
        # when the others have nothing), 2 gap filler (and only within the lane's gap).
        self._members = [tuple((m, 2 if m in lane.fill else 1 if m in lane.low else 0)
                               for m in lane.models) for lane in self.lanes]
        # Per model, its lane's others and which of their work goes first (by tier).
        self._mates = {m: tuple((o, Precedence.ALL if to < tier else
                                 Precedence.DUE_EARLIER if to == tier else Precedence.RUNNING)
                                for o, to in members if o != m)
                       for members in self._members for m, tier in members}
        self._gap_s = {m: GAP_SAFETY * lane.gap_ms / 1000.0 for lane in self.lanes
                       if lane.gap_ms is not None for m in lane.fill}
        for g, li in self._guest_lane.items():  # a guest runs within its lane's gap
            gap = self.lanes[li].gap_ms
            self._gap_s[g] = GAP_SAFETY * gap / 1000.0 if gap is not None else 0.0
        # a lane's own models wait for its guests' running batch
        for li, gs in enumerate(self._lane_guests):
            for m, _ in self._members[li]:
                self._mates[m] = self._mates[m] + tuple((g, Precedence.RUNNING) for g in gs)
        for g, li in self._guest_lane.items():  # a guest waits for all of its lane's work
            self._mates[g] = tuple((m, Precedence.ALL) for m, _ in self._members[li])

    def _gap_fillers(self) -> set[str]:
        return {m for lane in self.lanes for m in lane.fill}

    # ------------------------------------------------------------------ contract

    def slices(self) -> dict[str, SliceSpec]:
        out: dict[str, SliceSpec] = {}
        for lane in self.lanes:
            spec = self.backend.slice_for(lane.percent, lane.units)
            for m in lane.models:
                out[m] = spec
        for g, li in self._guest_lane.items():
            lane = self.lanes[li]
            out[g] = self.backend.slice_for(lane.percent, lane.units)
        first = next(iter(out.values()), None) or self.backend.whole()
        for m in self.models:
            out.setdefault(m, first)  # never launched; its worker idles
        return out

    def decide(self, now: float, queues: Mapping[str, QueueView]) -> Decision:
        launches: list[Launch] = []
        idle: list[int] = []  # lanes idle with nothing of their own to run
        taken: dict[str, int] = {}  # items each model's own worker takes now
        for m in self._alone:
            q = queues.get(m)
            if q is not None:
                self._note_backlog(q, now)
        for li, members in enumerate(self._members):
            best: QueueView | None = None
            best_key = (3, 0.0)
            busy = any(queues[g].running for g in self._lane_guests[li] if g in queues)
            for m, tier in members:
                q = queues.get(m)
                if q is None:
                    continue
                if q.running or busy:
                    best = None
                    busy = True
                    break  # the lane is busy
                if q.items <= 0:
                    continue
                dl = q.head_deadline if q.head_deadline is not None else float("inf")
                key = (tier, dl)
                if best is None or key < best_key:
                    best, best_key = q, key
            if busy:
                continue
            if best is not None:
                n = self._batch(best, now)
                if n > 0:
                    launches.append(Launch(best.model, n, False))
                    taken[best.model] = n
                    continue
            if self._lane_guests[li]:
                idle.append(li)
        for li in idle:
            self._borrow(li, now, queues, taken, launches)
        return Decision(tuple(launches), None)

    def _borrow(self, li: int, now: float, queues: Mapping[str, QueueView],
                taken: dict[str, int], launches: list[Launch]) -> None:
        """An idle lane runs a batch of the guest whose host has the earliest head due
        among those whose own worker is busy with more queued than it takes."""
        best: tuple[float, str, str, int] | None = None
        for g in self._lane_guests[li]:
            h = self._host[g]
            q = queues.get(h)
            if q is None or q.items <= 0 or not (q.running or h in taken):
                continue
            left = q.items - taken.get(h, 0)
            if left <= 0:
                continue
            dl = q.head_deadline if q.head_deadline is not None else float("inf")
            if best is None or dl < best[0]:
                best = (dl, g, h, left)
        if best is None:
            return
        _, g, h, left = best
        n = min(left, self.batch_cap(g))
        if n > 0:
            launches.append(Launch(h, n, False, g))
            taken[h] = taken.get(h, 0) + n

    def batch_cap(self, model: str) -> int:
        """The planned cap; a model alone in its lane may go up to the batch that runs in
        LONE_BATCH_SLO of its SLO, or with a backlog the batch `decide` found for it
        (`_note_backlog`). How long a batch takes: the profile's latency by batch
        size, scaled to the live estimate at batch 1 (the profile gives the shape, the
        estimate the machine's speed now); without a profile, the live estimate. (The live
        estimate alone is a straight line and misses steps: tiny_cnn on one core takes
        0.36 ms at batch 1 and 0.86 ms at 2, where the line through 1 and 8 says 0.59.)"""
        host = self._host.get(model)
        if host is not None:  # a guest: the largest batch that ends within its lane's gap
            est = self.latency.get(model)
            top = self.models[host].max_batch
            return est.max_batch_within(self._gap_s[model], top) if est is not None else 0
        big = self._surge.get(model)
        return big if big is not None else self._lone_cap(model, LONE_BATCH_SLO)

    def _note_backlog(self, q: QueueView, now: float) -> None:
        """A lone model's backlog: when its queue holds more than its cap and already a
        batch of more items per second that its head can still wait for, that batch."""
        m = q.model
        self._surge.pop(m, None)
        if q.items <= self._cap.get(m, 1) or q.head_deadline is None:
            return
        calm = self._lone_cap(m, LONE_BATCH_SLO)
        if q.items <= calm:
            return
        p = self.models[m]
        big = self._lone_cap(m, min(SURGE_BATCH_SLO, (q.head_deadline - now) / p.slo_s))
        if calm < big <= q.items:
            self._surge[m] = big

    def _lone_cap(self, model: str, share: float) -> int:
        """The planned cap, or for a lone model the batch of the most items per second
        among those that run within `share` of its SLO, if larger."""
        cap = self._cap.get(model, 1)
        if model not in self._alone:
            return cap
        est = self.latency.get(model)
        if est is None:
            return cap
        p = self.models[model]
        budget = p.slo_s * share
        shape = self._alone[model]
        if not shape:
            return max(cap, est.max_batch_within(budget, p.max_batch))
        scale = est.estimate_s(1) * 1000.0 / shape[0]
        fit = bisect.bisect_right(shape, budget * 1000.0 / scale)  # shape is non-decreasing
        fit = min(fit, p.max_batch)
        return max(cap, self._thrifty[model][fit - 1]) if fit > 0 else cap

    def lane_mates(self, model: str) -> tuple[tuple[str, Precedence], ...]:
        """Its lane's other models: a higher tier's work all goes first, the same tier's
        requests due earlier (EDF), a lower tier's running batch only."""
        return self._mates.get(model, ())

    def _batch(self, q: QueueView, now: float) -> int:
        # A full batch even when the oldest request cannot make its deadline in it: the
        # dispatch core refuses such heads at launch, and shrinking batches under
        # overload would cut throughput exactly when it is short (measured: the
        # simulator suite's overloaded mixes lost half their goodput that way).
        n = max(1, min(q.items, self.batch_cap(q.model)))
        gap = self._gap_s.get(q.model)
        if gap is not None:  # a gap filler: what its live estimate runs within the gap
            est = self.latency.get(q.model)
            if est is not None:
                n = est.max_batch_within(gap, n)  # 0: not even one fits; wait
        return n

    def guests(self) -> dict[str, str]:
        """Guest worker -> the model whose queue it serves (those with a lane)."""
        return dict(self._host)

    def on_batch_done(self, model: str, n: int, compute_s: float, now: float) -> None:
        return None

    def use_estimates(self, estimates: Mapping[str, LinearLatency]) -> None:
        self.latency = estimates

    def reanchor(self, now: float) -> None:
        return None

    def unserved(self) -> Mapping[str, str]:
        return dict(self._unserved)

    def plan(self) -> Plan | None:
        return self.the_plan

    def schedule(self) -> Schedule | None:
        return self.the_schedule
