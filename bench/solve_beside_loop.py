"""What a re-plan's solve costs an event loop that serves an open-loop load, solved in a
thread of its process or in a process of its own (`python -m bench.solve_beside_loop`).

One uvloop loop in this process serves work items that arrive every `--period-ms` whether
it is ready or not (an open loop, as requests do), each `--busy` of a period of pure
Python; an item is late by how long after its arrival plus its own work it was done. The
`dstack` policy's re-plan for the H100 mix (`configs/bench-mix-h100-dstack.yaml`, its
committed profiles) is solved `--replans` times beside it, as the runtime's re-planner
does: with `asyncio.to_thread`, then with `dstack.runtime.replanner.SolverProcess`, at the
GIL switch interval `dstack serve` sets. Printed for each: the worst lateness of the items
that arrived during each solve (and until the loop was on time again), each solve's wall
time, and the ratio of the medians; and, for comparison, the worst lateness in a window
as long without a solve. A loop that runs its work and then sleeps whatever
happened meanwhile (`bench.gil_handoff`) never falls behind, and cannot show this; one
that must serve what has arrived does. Why it matters: docs/reliability.md, "thirty-eighth
step"; the process needs a core of its own to run on, which a CUDA host has.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import uvloop

from bench.gil_handoff import replan_of_the_h100_mix
from dstack.common.pauses import SWITCH_INTERVAL_S
from dstack.runtime.replanner import SolverProcess

Solve = Callable[[Callable[[], Any]], Awaitable[Any]]


async def _serve(period_s: float, busy_s: float, stop: asyncio.Event,
                 done: list[tuple[float, float]]) -> None:
    """Items arrive every `period_s` from now; each takes `busy_s` of Python. Appends
    (arrival, lateness) per item."""
    t0 = time.perf_counter()
    i = 0
    while not stop.is_set():
        due = t0 + i * period_s
        ahead = due - time.perf_counter()
        if ahead > 0:
            await asyncio.sleep(ahead)
        t = time.perf_counter()
        while time.perf_counter() - t < busy_s:
            pass
        done.append((due, max(0.0, time.perf_counter() - due - busy_s)))
        i += 1
        if ahead <= 0 and i % 8 == 0:
            await asyncio.sleep(0)  # behind: still let the solve's result in


async def _measure(solve: Solve, replans: int, period_s: float,
                   busy_s: float) -> tuple[list[float], list[float], float]:
    solves = [replan_of_the_h100_mix(k) for k in range(replans)]  # set up before the loop runs
    stop = asyncio.Event()
    done: list[tuple[float, float]] = []
    server = asyncio.create_task(_serve(period_s, busy_s, stop, done))
    await asyncio.sleep(0.5)
    t = time.perf_counter()
    await asyncio.sleep(0.3)  # the control: as long a window without a solve
    calm = max((late for due, late in done if due >= t), default=0.0)
    worst, walls = [], []
    for one in solves:
        t = time.perf_counter()
        await solve(one)
        end = time.perf_counter()
        walls.append(end - t)
        await asyncio.sleep(0.3)  # the loop catches up
        during = [late for due, late in done if t <= due <= end + 0.3]
        worst.append(max(during, default=0.0))
    stop.set()
    await server
    return worst, walls, calm


async def _with_process(replans: int, period_s: float,
                        busy_s: float) -> tuple[list[float], list[float], float]:
    solver = SolverProcess()
    await solver.start()
    try:
        return await _measure(solver.call, replans, period_s, busy_s)
    finally:
        solver.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replans", type=int, default=5)
    p.add_argument("--period-ms", type=float, default=1.0)
    p.add_argument("--busy", type=float, default=0.75, help="the loop's busy share")
    args = p.parse_args(argv)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    period_s, busy_s = args.period_ms / 1000, args.busy * args.period_ms / 1000
    medians = {}
    for where, run in (
            ("a thread", lambda: _measure(asyncio.to_thread, args.replans, period_s, busy_s)),
            ("a process", lambda: _with_process(args.replans, period_s, busy_s))):
        worst, walls, calm = uvloop.run(run())
        medians[where] = (statistics.median(worst), statistics.median(walls))
        print(f"solved in {where}: the items' worst lateness during each solve "
              f"{', '.join(f'{1000 * w:.1f}' for w in worst)} ms (median "
              f"{1000 * medians[where][0]:.1f}; {1000 * calm:.1f} in as long a window "
              f"without a solve); each solve's wall time "
              f"{', '.join(f'{1000 * w:.0f}' for w in walls)} ms (median "
              f"{1000 * medians[where][1]:.0f})", flush=True)
    (late_t, wall_t), (late_p, wall_p) = medians["a thread"], medians["a process"]
    print(f"a process against a thread: the items' worst lateness "
          f"{late_p / late_t if late_t else float('nan'):.2f}x, a solve's wall time "
          f"{wall_p / wall_t:.2f}x (switch interval {1000 * SWITCH_INTERVAL_S:g} ms, the "
          f"loop busy {args.busy:.0%} of the time)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
