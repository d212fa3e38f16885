"""The `dstack` plan: a lane plan for a config on a device (`optimizer.lanes` searches it).

`plan_lanes` never refuses: a model whose batch-1 latency on the whole device exceeds its
SLO is left out with the numbers (the policy refuses its requests as `unplanned`); every
other model is placed in some lane, unless under overload leaving it out lets the others
serve more than 1% more (`optimizer.lanes.DROP_GAIN`; never when a rate is unknown); one
served below its planned rate is named.
"""

from __future__ import annotations

import time
from collections import Counter

from dstack.common.config import DeployConfig
from dstack.common.slices import CpuSlices, MpsSlices, SliceBackend
from dstack.common.types import (
    ModelPlan,
    Priority,
    Profile,
    Schedule,
    Shortfall,
    Slot,
    SolverStatus,
)
from dstack.policies.baseline_params import knee_percent, temporal_batch
from dstack.policies.lane_policy import GAP_SAFETY, Lane, LanePlan
from dstack.policies.replicas import public_name
from optimizer.lanes import (
    LaneChoice,
    LaneEval,
    LaneInstance,
    LaneModel,
    Reference,
    candidate_batches,
    capped,
    planning_latency,
    score_lane,
    solve_lanes,
)

#: Planning latency = the profile's p50 x (1 + this): slack against noise.
LATENCY_MARGIN = 0.10


def backend_of(profiles: dict[str, Profile]) -> SliceBackend:
    """The profiles' device as a slice backend (CPU: its cores; else MPS percentages)."""
    dev = next(iter(profiles.values())).device
    if dev.kind == "cpu":
        return CpuSlices(tuple(range(dev.units)))
    return MpsSlices(dev.units)


def lane_widths(backend: SliceBackend, profiles: dict[str, Profile]) -> tuple[float, ...]:
    if backend.kind == "cpu":
        n = backend.total_units
        return tuple(100.0 * k / n for k in range(1, n + 1))
    pcts = {float(p) for prof in profiles.values() for p in prof.percentages if 0 < p <= 100}
    pcts.add(100.0)
    return tuple(sorted(pcts))


def _instance(cfg: DeployConfig, profiles: dict[str, Profile], backend: SliceBackend,
              rates: dict[str, float] | None, margin: float
              ) -> tuple[LaneInstance, list, list[tuple[str, str]], bool]:
    """The lane search's instance for `cfg` at `rates`: (instance, the served models'
    configs, the models no lane can serve with why, whether some rate was guessed)."""
    grow = 1.0 + cfg.rate_headroom
    served, unserved = [], []
    for m in cfg.models:
        prof = profiles[m.name]
        full = max(prof.percentages)
        b0 = min(prof.batch_sizes)
        fastest = prof.latency_ms(b0, full)
        if fastest >= m.slo_ms:
            unserved.append((m.name, f"{m.name} needs {fastest:.1f} ms at batch {b0} on "
                                     f"{full:g}%; its SLO is {m.slo_ms:g} ms: no lane can "
                                     f"serve it"))
            continue
        served.append(m)
    workers = Counter(public_name(m.name) for m in cfg.models)
    models = []
    guessed = False  # some rate unknown: its guess is no demand to leave a model out for
    for m in served:
        prof = profiles[m.name]
        rate = (rates or {}).get(m.name, m.rate_rps)
        if rate <= 0:  # unknown: a device's worth of its smallest batch
            guessed = True
            rate = 1000.0 * min(prof.batch_sizes) / prof.latency_ms(min(prof.batch_sizes),
                                                                   max(prof.percentages))
        models.append(LaneModel(m.name, m.slo_ms, rate, m.priority.weight,
                                candidate_batches(prof, m.max_batch_size),
                                planning_latency(prof, margin=margin),
                                low=m.priority is Priority.LOW, grown_rps=grow * rate,
                                workers=workers[public_name(m.name)]))
    return LaneInstance(tuple(models), lane_widths(backend, profiles)), served, unserved, \
        guessed


def predicted_goodput(plan: LanePlan, cfg: DeployConfig, profiles: dict[str, Profile],
                      backend: SliceBackend, rates: dict[str, float], *,
                      margin: float = LATENCY_MARGIN) -> float:
    """G of `plan`'s lanes and caps (as they are) at `rates`: how well the plan in force
    would do at the rates measured now, to compare with a re-plan for them."""
    inst = _instance(cfg, profiles, backend, rates, margin)[0]
    index = {m.name: i for i, m in enumerate(inst.models)}
    total = 0.0
    for lane in plan.lanes:
        keep = [(n, c) for n, c in zip(lane.models, lane.caps, strict=True)
                if n in index and n not in lane.fill]
        members = [index[n] for n, _ in keep]
        caps = [c for _, c in keep]
        if members:
            total += score_lane(inst, members, lane.percent, caps).value
    return total


def plan_lanes(cfg: DeployConfig, profiles: dict[str, Profile], backend: SliceBackend | None,
               rates: dict[str, float] | None = None, *,
               margin: float = LATENCY_MARGIN) -> tuple[LanePlan, Schedule, Reference]:
    """The lane plan, its schedule (lanes side by side, each lane's batches one after
    another), and the baseline assignments it was compared with."""

    t0 = time.perf_counter()
    if backend is None:
        backend = backend_of(profiles)
    inst, served, unserved, guessed = _instance(cfg, profiles, backend, rates, margin)
    fills: list[LaneModel] = []
    if any(not m.low for m in inst.models):  # low priority only fills the others' gaps
        fills = [m for m in inst.models if m.low]
        served = [c for c, m in zip(served, inst.models, strict=True) if not m.low]
        inst = LaneInstance(tuple(m for m in inst.models if not m.low), inst.widths)
    models = inst.models
    spatial_w = temporal_caps = None
    if models:
        knees = {m.name: knee_percent(profiles[m.name], m.max_batch_size) for m in served}
        spatial = backend.allocate(knees)
        units = [u for s in spatial.values() for u in s.units]
        if len(units) == len(set(units)):  # disjoint: expressible as lanes
            spatial_w = [spatial[m.name].percent for m in served]
        temporal_caps = [temporal_batch(profiles[m.name], m.slo_ms, len(served),
                                        m.max_batch_size) for m in served]
    # Measured rates (a re-plan) never leave a model out: they count every arrival, and a
    # closed loop resends a refused request at once, so they overstate demand; on their
    # word a re-plan once left resnet18 out of the CPU mix and refused all its traffic.
    choice, ref = solve_lanes(inst, spatial_widths=spatial_w, temporal_caps=temporal_caps,
                              drop=not guessed and rates is None)
    infeasible = bool(unserved)
    for i in choice.dropped(len(models)):
        lm = models[i]
        unserved.append((lm.name, f"{lm.name} left out: the device cannot serve every "
                                  f"model's rate ({lm.rate_rps:.1f} rps planned), and the "
                                  f"others serve more requests within SLO without it"))
    placed = _place_fills(inst, choice, fills, unserved)
    lone = {}
    for ev in choice.lanes:
        if len(ev.members) == 1:
            lm = inst.models[ev.members[0]]
            lone[lm.name] = lone_latencies(profiles[lm.name], lm.batches[-1], ev.width)
    plan, sched = _realise(inst, choice, backend, unserved, time.perf_counter() - t0,
                           infeasible, placed, lone)
    return plan, sched, ref


def lone_latencies(profile: Profile, max_batch: int, width: float) -> tuple[float, ...]:
    """The profile's latency (ms) on a `width`% lane for batches 1..max_batch, made
    non-decreasing (a batch may always be cut to a smaller one that took longer)."""
    lat = planning_latency(profile, margin=0.0)
    out, top = [], 0.0
    for b in range(1, max_batch + 1):
        top = max(top, lat(b, width))
        out.append(round(top, 4))
    return tuple(out)


_Fill = tuple[LaneModel, int, float]  # a low-priority model, its cap, its predicted rps


def lane_gap_ms(inst: LaneInstance, ev: LaneEval) -> float:
    """How long a lane's planned models can wait for a batch that started just before
    their request arrived and still meet their SLO: min_m (S_m - L_m(cap_m))."""
    return min(inst.models[i].slo_ms - lat for i, lat in zip(ev.members, ev.lat_ms,
                                                             strict=True))


def gap_lanes(plan: LanePlan, profile: Profile, *, margin: float = LATENCY_MARGIN) -> int:
    """How many of `plan`'s lanes have a gap that fits a batch of 1 of the model profiled
    in `profile` (a low-priority model: one worker per such lane uses all their gaps)."""
    lat = planning_latency(profile, margin=margin)
    by_name = {m.model: m for m in plan.models}
    n = 0
    for lane in plan.lanes:
        planned = [by_name[m] for m in lane.models if m not in lane.fill and m in by_name]
        gap = min((m.slo_ms - m.latency_ms for m in planned), default=0.0)
        if planned and lat(min(profile.batch_sizes), lane.percent) <= GAP_SAFETY * gap:
            n += 1
    return n


def _place_fills(inst: LaneInstance, choice: LaneChoice, fills: list[LaneModel],
                 unserved: list[tuple[str, str]]) -> dict[int, list[_Fill]]:
    """Low-priority models (FIKIT): each goes to the lane with the most predicted idle
    time whose gap (`lane_gap_ms` x `GAP_SAFETY`) fits a batch of it, with the largest
    cap that fits; it takes no width and runs only when its lane is idle. One that fits
    no lane is left out with the numbers."""
    idle = [max(0.0, 1.0 - sum(inst.models[i].rate_rps * lat / cap / 1000.0
                               for i, lat, cap in zip(ev.members, ev.lat_ms, ev.caps,
                                                      strict=True)))
            for ev in choice.lanes]
    out: dict[int, list[_Fill]] = {}
    taken: dict[str, set[int]] = {}  # a model's replicas go to different lanes
    for f in fills:
        best, best_cap = -1, 0
        mine = taken.setdefault(public_name(f.name), set())
        for k, ev in enumerate(choice.lanes):
            budget = GAP_SAFETY * lane_gap_ms(inst, ev)
            fit = [b for b in f.batches if f.latency(b, ev.width) <= budget]
            if fit and k not in mine and (best < 0 or idle[k] > idle[best]):
                best, best_cap = k, fit[-1]
        if best < 0:
            why = "and there is no lane"
            room = [(GAP_SAFETY * lane_gap_ms(inst, ev) - f.latency(f.batches[0], ev.width),
                     ev) for k, ev in enumerate(choice.lanes) if k not in mine]
            if room:
                slack, ev = max(room, key=lambda x: x[0])
                why = (f"no lane can spare a batch of {f.batches[0]}: on the {ev.width:g}% "
                       f"lane with the most room it takes "
                       f"{f.latency(f.batches[0], ev.width):.1f} ms, and that lane's models "
                       f"can wait {GAP_SAFETY * lane_gap_ms(inst, ev):.1f} ms")
            unserved.append((f.name, f"{f.name} (priority low) runs only in the gaps the "
                                     f"other models leave, {why}"))
            continue
        lat = f.latency(best_cap, choice.lanes[best].width)
        served = min(f.rate_rps, idle[best] * 1000.0 * best_cap / lat)
        out.setdefault(best, []).append((f, best_cap, served))
        mine.add(best)
        idle[best] = max(0.0, idle[best] - served * lat / best_cap / 1000.0)
    return out


def _realise(inst: LaneInstance, choice: LaneChoice, backend: SliceBackend,
             unserved: list[tuple[str, str]], solve_s: float,
             infeasible: bool = False,
             fills: dict[int, list[_Fill]] | None = None,
             lone: dict[str, tuple[float, ...]] | None = None) -> tuple[LanePlan, Schedule]:
    cores = tuple(backend.whole().units)
    nxt = 0
    lanes: list[Lane] = []
    mplans: list[ModelPlan] = []
    slots: list[Slot] = []
    shortfalls = [Shortfall(m, why) for m, why in unserved]
    cycle = max((ev.round_ms for ev in choice.lanes), default=0.0) or 1.0
    for li, ev in enumerate(choice.lanes):
        if backend.kind == "cpu":
            k = backend.slice_for(ev.width).units
            units = cores[nxt:nxt + len(k)]
            nxt += len(k)
        else:
            units = ()
        spec = backend.slice_for(ev.width, units)
        names = tuple(inst.models[i].name for i in ev.members)
        short = {names[k] for k in capped([inst.models[i] for i in ev.members], ev.caps,
                                          ev.width)}
        gap_fill = (fills or {}).get(li, [])
        lanes.append(Lane(spec.percent, units, names + tuple(f.name for f, _, _ in gap_fill),
                          ev.caps + tuple(c for _, c, _ in gap_fill), ev.round_ms,
                          tuple(inst.models[i].name for i in ev.members
                                if inst.models[i].low or inst.models[i].name in short),
                          fill=tuple(f.name for f, _, _ in gap_fill),
                          gap_ms=lane_gap_ms(inst, ev),
                          lone_ms=(lone or {}).get(names[0], ()) if len(names) == 1 else ()))
        for f, cap, served in gap_fill:  # no slot: it runs only in the lane's idle time
            lat = f.latency(cap, ev.width)
            mplans.append(ModelPlan(f.name, cap, spec.percent, lat, 1000.0 * cap / lat,
                                    f.rate_rps, served, f.slo_ms, 0, 0.0))
        offset = 0.0
        for k, i in enumerate(ev.members):
            lm = inst.models[i]
            mplans.append(ModelPlan(lm.name, ev.caps[k], spec.percent, ev.lat_ms[k],
                                    ev.thr_rps[k], lm.rate_rps, ev.served_rps[k], lm.slo_ms,
                                    1, offset))
            slots.append(Slot(lm.name, offset, ev.lat_ms[k], spec.percent, units))
            offset += ev.lat_ms[k]
            if ev.served_rps[k] < lm.rate_rps * (1 - 1e-6):
                shortfalls.append(Shortfall(lm.name, (
                    f"{lm.name}: predicted {ev.served_rps[k]:.1f} of {lm.rate_rps:.1f} rps "
                    f"within its {lm.slo_ms:g} ms SLO (batch {ev.caps[k]} on "
                    f"{spec.percent:g}%, lane round {ev.round_ms:.2f} ms with "
                    f"{len(ev.members)} model(s))")))
    if infeasible:
        status = SolverStatus.INFEASIBLE
    elif len(shortfalls) > 0:
        status = SolverStatus.PARTIAL
    else:
        status = SolverStatus.OPTIMAL
    st = choice.status
    plan = LanePlan(tuple(mplans), cycle, choice.value, status, solve_s, tuple(shortfalls),
                    st is None or st.optimal, lanes=tuple(lanes), unserved=tuple(unserved),
                    search=st.describe() if st else "", gap=st.gap if st else 0.0)
    return plan, Schedule(cycle, tuple(slots))
