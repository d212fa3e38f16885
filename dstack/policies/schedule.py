"""From a Plan to a Schedule with concrete units, and the schedule checks.

The optimizer's packer places each model's batch at its shelf's start
(`optimizer.packing.pack`); here each slot also gets concrete units where the slice backend
has them (CPU cores): a sweep over slot starts hands each slot cores that no slot
overlapping it in time holds. `validate_schedule` is the pure contract every schedule meets.
"""

from __future__ import annotations

from dataclasses import replace

from dstack.common.slices import SliceBackend
from dstack.common.types import Plan, Schedule, Slot
from optimizer.packing import pack, validate_schedule

__all__ = ["build_schedule", "validate_schedule", "ScheduleError"]


class ScheduleError(ValueError):
    """A plan that cannot be realised on this device's units."""


def build_schedule(plan: Plan, backend: SliceBackend | None = None) -> Schedule:
    base = pack(plan)
    if backend is None or backend.kind != "cpu":
        return base
    all_units = tuple(backend.whole().units)
    placed: list[Slot] = []
    for s in sorted(base.slots, key=lambda s: (s.start_ms, -s.percent)):
        held = {u for o in placed if o.start_ms < s.end_ms and s.start_ms < o.end_ms
                for u in o.units}
        free = [u for u in all_units if u not in held]
        want = backend.slice_for(s.percent)
        n = len(want.units)
        if n > len(free):
            raise ScheduleError(
                f"{s.model} needs {n} cores at {s.start_ms:.1f} ms but only {len(free)} are free"
            )
        units = tuple(free[:n])
        placed.append(replace(s, units=units, percent=100.0 * n / len(all_units)))
    order = {s.model: i for i, s in enumerate(base.slots)}
    sched = Schedule(base.cycle_ms, tuple(sorted(placed, key=lambda s: order[s.model])))
    problems = validate_schedule(sched, [m.model for m in plan.models])
    if problems:
        raise ScheduleError("; ".join(problems))
    return sched
