"""From a Plan to a Schedule, and a pure check of any Schedule.

The minimal packer puts each model's one batch per cycle at its shelf's start
(`ModelPlan.offset_ms`) for its predicted latency on its slice. The runtime's schedule
builder (`dstack/policies/schedule.py`) may do more (reuse idle capacity); `validate_schedule`
is the contract both satisfy.
"""

from __future__ import annotations

from collections.abc import Iterable

from dstack.common.types import Plan, Schedule, Slot

EPS = 1e-6


def pack(plan: Plan) -> Schedule:
    """One slot per model: start at its shelf's start, last its predicted latency."""
    return Schedule(
        cycle_ms=plan.cycle_ms,
        slots=tuple(
            Slot(m.model, start_ms=m.offset_ms, duration_ms=m.latency_ms, percent=m.percent)
            for m in plan.models
        ),
    )


def validate_schedule(schedule: Schedule, models: Iterable[str] | None = None) -> list[str]:
    """Problems with a schedule, in words; empty when it is sound.

    Checks: a positive cycle; every slot inside [0, cycle] with a positive duration and a
    percent in (0, 100]; at every instant the overlapping slots sum to <= 100% and use
    disjoint `units`; every model in `models` (if given) has at least one slot."""
    problems: list[str] = []
    cycle = schedule.cycle_ms
    if not cycle > 0:
        problems.append(f"cycle is {cycle} ms; it must be positive")
    for s in schedule.slots:
        if s.duration_ms <= 0:
            problems.append(f"{s.model}: slot at {s.start_ms:.3f} ms has no duration")
        if s.start_ms < -EPS or s.end_ms > cycle + EPS:
            problems.append(
                f"{s.model}: slot {s.start_ms:.3f}-{s.end_ms:.3f} ms leaves the "
                f"{cycle:.3f} ms cycle"
            )
        if not 0 < s.percent <= 100 + EPS:
            problems.append(f"{s.model}: slot has {s.percent:g}%; it must be in (0, 100]")
    # Sweep: the load only rises at a slot's start, so check every start.
    for s in sorted(schedule.slots, key=lambda s: s.start_ms):
        live = [o for o in schedule.slots if o.start_ms <= s.start_ms + EPS < o.end_ms]
        load = sum(o.percent for o in live)
        if load > 100 + EPS:
            who = ", ".join(f"{o.model} {o.percent:g}%" for o in live)
            problems.append(f"at {s.start_ms:.3f} ms the slots sum to {load:g}% ({who})")
        seen: dict[int, str] = {}
        for o in live:
            for unit in o.units:
                if unit in seen and seen[unit] != o.model:
                    problems.append(
                        f"at {s.start_ms:.3f} ms unit {unit} is given to both "
                        f"{seen[unit]} and {o.model}"
                    )
                seen[unit] = o.model
    if models is not None:
        have = {s.model for s in schedule.slots}
        for name in models:
            if name not in have:
                problems.append(f"{name}: no slot in the schedule")
    return sorted(set(problems), key=problems.index)
