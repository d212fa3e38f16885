"""How fast each core of this machine runs, second by second (`python -m bench.machine_speed`).

One process per core, pinned to it, times a fixed piece of pure-Python work over and over
for `--seconds` and prints, per core, the median time of the piece in each second, and
how many of the seconds it took over 1.5x its fastest second's time. Run it on an idle
machine: anything else on the cores slows the pieces too.

Why: on the shared 2-core machine these benchmarks run on, each core switched between
two speeds 1.75-1.9x apart for seconds at a time, independently of the other core, with
nothing else running and no steal time in /proc/stat (the host's doing: another tenant on
the same physical core, say), and both speeds were 2.2x faster an hour later. The steps
hit pure-Python code such as the server, its front ends and a load generator; a worker's
tensor compute far less (a batch of 4 of mobilenet_v3_small on one core took 22-25 ms in
both). Windows of a benchmark that ran at different speeds are not comparable
(docs/reliability.md, "Overload, twenty-fourth step").
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

WORK = 100_000  # additions per timed piece (2.7-12 ms on the machine the docstring speaks of)


def _probe(core: int, seconds: float, out: mp.Queue) -> None:
    os.sched_setaffinity(0, {core})
    t0 = time.monotonic()
    per_s: dict[int, list[float]] = {}
    while (now := time.monotonic()) - t0 < seconds:
        t = time.perf_counter()
        s = 0
        for i in range(WORK):
            s += i
        per_s.setdefault(int(now - t0), []).append(1000 * (time.perf_counter() - t))
    out.put((core, [statistics.median(v) for _, v in sorted(per_s.items())]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--cores", type=int, nargs="*", help="default: every core this process may use")
    args = p.parse_args(argv)
    if args.seconds < 1:
        p.error(f"--seconds {args.seconds:g}: at least 1")
    mine = sorted(os.sched_getaffinity(0))
    cores = args.cores or mine
    if not set(cores) <= set(mine):
        p.error(f"--cores {' '.join(map(str, cores))}: this process may use cores "
                f"{' '.join(map(str, mine))}")
    out: mp.Queue = mp.Queue()
    procs = [mp.Process(target=_probe, args=(c, args.seconds, out)) for c in cores]
    for pr in procs:
        pr.start()
    rows = dict(out.get(timeout=args.seconds + 60) for _ in procs)
    for pr in procs:
        pr.join()
    for c in cores:
        ms = rows[c]
        fast = min(ms)
        slow = sum(m > 1.5 * fast for m in ms)
        print(f"core {c}: ms per piece, each second: {' '.join(f'{m:.1f}' for m in ms)}")
        print(f"core {c}: fastest {fast:.1f} ms, slowest {max(ms):.1f} ms "
              f"({max(ms) / fast:.2f}x); {slow} of {len(ms)} seconds over 1.5x the fastest")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
