"""How long a re-plan in a thread holds up a busy event loop, at CPython's default switch
interval and at the one `dstack serve` sets (`python -m bench.gil_handoff`).

One process, one uvloop loop busy `--busy` of the time (pure-Python work in 1 ms turns, a
short sleep between them, as the dispatch process's loop under overload), and the
`dstack` policy's re-plan for the H100 mix (`configs/bench-mix-h100-dstack.yaml`, its
committed profiles: pure Python, a few ms alone) solved `--replans` times with
`asyncio.to_thread`, as the runtime's re-planner does. For each switch interval it prints
the loop's worst lateness during each re-plan and each re-plan's wall time, medians and
the ratio of the two intervals' medians. Why: the docstring of `dstack.common.pauses`. (At
the default interval a re-plan can take a minute: the loop starves it.)
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import uvloop

from dstack.common.config import load_config
from dstack.common.pauses import SWITCH_INTERVAL_S
from dstack.common.slices import MpsSlices
from dstack.policies.planning import PolicySetup, replan, served_profiles, setup_policy

CONFIG = Path(__file__).resolve().parents[1] / "configs/bench-mix-h100-dstack.yaml"
TURN_S = 0.001
HELD_S = 0.002  # a turn this late: the loop held up


async def _busy(share: float, stop: asyncio.Event, lates: list[float]) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        x = 0
        while time.perf_counter() - t < TURN_S * share:
            x += 1
        due = time.perf_counter() + TURN_S * (1 - share)
        await asyncio.sleep(TURN_S * (1 - share))
        lates.append(max(0.0, time.perf_counter() - due))


def replan_of_the_h100_mix(k: int) -> Callable[[], PolicySetup | None]:
    """The `k`-th re-plan of the H100 mix the benchmarks solve: rates 10x the mix's, 10%
    more each time."""
    cfg = load_config(CONFIG)
    backend = MpsSlices(100)
    current = setup_policy(cfg, backend, origin=0.0,
                           profiles=served_profiles(cfg, check_device=False))
    rates = {m.name: 10.0 * m.rate_rps * (1 + 0.1 * k) for m in cfg.models}
    return functools.partial(replan, cfg, backend, current, origin=0.0, rates=rates)


async def _measure(replans: int, share: float) -> tuple[list[float], list[float], list[int]]:
    solves = [replan_of_the_h100_mix(k) for k in range(replans)]  # set up before the loop runs
    stop = asyncio.Event()
    lates: list[float] = []
    busy = asyncio.create_task(_busy(share, stop, lates))
    await asyncio.sleep(0.2)
    worst, walls, held = [], [], []
    for solve in solves:
        seen = len(lates)
        t = time.perf_counter()
        await asyncio.to_thread(solve)
        walls.append(time.perf_counter() - t)
        await asyncio.sleep(2 * TURN_S)  # the loop's turn that the re-plan's end held
        worst.append(max(lates[seen:], default=0.0))
        held.append(sum(late > HELD_S for late in lates[seen:]))
    stop.set()
    await busy
    return worst, walls, held


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replans", type=int, default=3)
    p.add_argument("--busy", type=float, default=0.8, help="the loop's busy share")
    args = p.parse_args(argv)
    default = sys.getswitchinterval()
    medians = {}
    for interval in (default, SWITCH_INTERVAL_S):
        sys.setswitchinterval(interval)
        worst, walls, held = uvloop.run(_measure(args.replans, args.busy))
        medians[interval] = (statistics.median(worst), statistics.median(walls))
        print(f"switch interval {1000 * interval:g} ms: the loop's worst lateness during a "
              f"re-plan {', '.join(f'{1000 * w:.1f}' for w in worst)} ms (median "
              f"{1000 * medians[interval][0]:.1f}); a re-plan's wall time "
              f"{', '.join(f'{1000 * w:.0f}' for w in walls)} ms (median "
              f"{1000 * medians[interval][1]:.0f}); the loop's turns more than "
              f"{1000 * HELD_S:g} ms late during each: {', '.join(map(str, held))}", flush=True)
    sys.setswitchinterval(default)
    (late_d, wall_d), (late_s, wall_s) = medians[default], medians[SWITCH_INTERVAL_S]
    print(f"{1000 * SWITCH_INTERVAL_S:g} ms against {1000 * default:g} ms: the loop's worst "
          f"lateness {late_s / late_d:.2f}x, a re-plan's wall time {wall_s / wall_d:.4f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
