"""Keep CPython's garbage collector from walking a serving process's start-up objects, and
a thread of the process from holding the event loop's GIL for 5 ms at a time.

A process that has imported torch, numpy and the server holds about 370,000 objects that
live until it exits, and CPython's full collection (generation 2) walks every one of them:
157 ms in the HTTP process and 151 ms in a model worker, measured on the 2-core machine of
`docs/decisions.md`. In the server those are 157 ms in which the event loop reads,
refuses and answers nothing; in a worker, a batch 151 ms late and every request queued
behind it with it. `freeze_startup_objects()` moves every object alive at the end of
start-up into the permanent generation (`gc.freeze`), which collections skip: a full
collection after it walks only what was made since (well under 1 ms then). Frozen objects
are still freed by reference counting when dropped; only a cycle among them would never be
collected, and start-up objects live until the process exits anyway.

The server calls it when its workers are up, just before it says ready; each worker, after
its warm-up, just before it reports ready; the benchmark's load generators before each
measured window, so that their own pauses are not counted as the server's.

A thread of a serving process that runs Python (the re-planner's solve, `asyncio.to_thread`)
competes with the event loop's thread for the GIL, and CPython hands it over only when the
thread that waits has waited its switch interval, 5 ms by default. Under load the loop's
thread takes the GIL back each time it leaves the kernel, so the other thread gets it
only after waiting 5 ms, and the loop's thread then waits as long for it back: a re-plan
of 5-8 ms of Python beside a loop busy 80% of the time took 8.5-62 s (a plan that long
out of date), and each time it got the GIL it held the loop 5-8 ms. At
`SWITCH_INTERVAL_S` the same re-plans took 15-25 ms and the loop was at most 0.6 ms late
(the removed `bench.gil_handoff`; docs/decisions.md).
`dstack serve` and `dstack cluster serve` set it (`prompt_gil_handoffs`,
`server.switch_interval_ms`). The interval matters only while two threads want the GIL:
with one running thread, nothing switches.

`Lateness` counts what pauses are left, as an event loop's periodic timer sees them: the
server's (`Runtime.loop_late`, /metrics `dstack_event_loop_late_seconds`), so that a slow
answer can be told apart as the server's loop held up.
"""

from __future__ import annotations

import asyncio
import bisect
import gc
import sys
import time

#: How long a thread that holds the GIL keeps it while another thread waits for it, in a
#: serving process (`server.switch_interval_ms`; CPython's default: 5 ms).
SWITCH_INTERVAL_S = 0.0005
#: The bounds, in seconds, a timer's lateness is counted under (`Lateness`).
LATE_BOUNDS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)


class Lateness:
    """How late a periodic timer fired, tick by tick: `counts[i]` ticks at most
    `LATE_BOUNDS_S[i]` late (and more than the bound before), the last count over the last
    bound; `sum_s` their lateness together."""

    def __init__(self) -> None:
        self.counts = [0] * (len(LATE_BOUNDS_S) + 1)
        self.sum_s = 0.0

    def add(self, late_s: float) -> None:
        self.counts[bisect.bisect_left(LATE_BOUNDS_S, late_s)] += 1
        self.sum_s += late_s

    def merge(self, other: Lateness) -> None:
        self.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        self.sum_s += other.sum_s

    @property
    def count(self) -> int:
        return sum(self.counts)

    def over(self, bound_s: float) -> int:
        """Ticks more than `bound_s` (one of LATE_BOUNDS_S) late."""
        return sum(self.counts[LATE_BOUNDS_S.index(bound_s) + 1:])

    def worst_s(self) -> float:
        """The bound the latest tick came under (inf: over the last), 0 without ticks."""
        for i in range(len(self.counts) - 1, -1, -1):
            if self.counts[i]:
                return LATE_BOUNDS_S[i] if i < len(LATE_BOUNDS_S) else float("inf")
        return 0.0

    def quantile_s(self, q: float) -> float:
        """The bound that a share `q` of the counts come under (inf: over the last), 0
        without counts: e.g. `quantile_s(0.99)` bounds the p99 from above."""
        need, seen = q * self.count, 0
        for i, n in enumerate(self.counts):
            seen += n
            if n and seen >= need:
                return LATE_BOUNDS_S[i] if i < len(LATE_BOUNDS_S) else float("inf")
        return 0.0

    def since(self, before: Lateness) -> Lateness:
        """The ticks counted after `before` (an earlier copy of these counts)."""
        out = Lateness()
        out.counts = [a - b for a, b in zip(self.counts, before.counts, strict=True)]
        out.sum_s = self.sum_s - before.sum_s
        return out

    def summary(self) -> str:
        """'late > 5 / 10 / 20 ms: a / b / c of N ticks, worst <= W ms'."""
        if not self.count:
            return "no ticks"
        worst = self.worst_s()
        return (f"late > 5 / 10 / 20 ms: {self.over(0.005)} / {self.over(0.01)} / "
                f"{self.over(0.02)} of {self.count} ticks, worst "
                + (f"<= {1000 * worst:g} ms" if worst != float("inf") else
                   f"> {1000 * LATE_BOUNDS_S[-1]:g} ms"))


def prompt_gil_handoffs(interval_s: float = SWITCH_INTERVAL_S) -> None:
    """Hand the GIL to a waiting thread within `interval_s` (module docstring)."""
    sys.setswitchinterval(interval_s)


def freeze_startup_objects() -> int:
    """Collect what is garbage now, then exempt every object still alive from later
    collections. Returns how many objects are frozen (all calls so far together)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


async def count_lateness(late: Lateness, tick_s: float = 0.01) -> None:
    """For ever: sleep `tick_s` on the running loop and count in `late` how late it woke."""
    while True:
        due = time.monotonic() + tick_s
        await asyncio.sleep(tick_s)
        late.add(max(0.0, time.monotonic() - due))


__all__ = ["LATE_BOUNDS_S", "Lateness", "count_lateness", "freeze_startup_objects"]
