"""Speed of `optimizer.solve` on random instances (a benchmark, not a test).

    .venv/bin/python bench/bench_optimizer.py [--seeds 3] [--sizes 10 50]

Random models: latency L(b, p) = (k0 + t * b) * (knee / p) ** g below the knee, flat
above it; 6 batch sizes (1..32) x 10 slices (10..100%); SLOs 4-12x the batch-1 latency,
rates 0.2-1.5x what the model could do alone at batch 8. Prints solve time, status and
cycle per instance, and whether the plan is proven optimal (instances too large for the
exact MILP are solved by the heuristic, `optimizer/heuristic.py`, and are not).
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time

from dstack.common.types import Cell, DeviceInfo, ModelSLO, Priority, Profile
from optimizer import SolveOptions, pack, solve, validate_schedule

BATCHES = (1, 2, 4, 8, 16, 32)
PERCENTS = tuple(float(p) for p in range(10, 101, 10))


def random_instance(n: int, rng: random.Random) -> tuple[dict[str, Profile], list[ModelSLO]]:
    profiles: dict[str, Profile] = {}
    slos: list[ModelSLO] = []
    for i in range(n):
        name = f"m{i}"
        k0, t = rng.uniform(0.3, 3.0), rng.uniform(0.05, 1.0)
        knee, g = rng.uniform(20, 80), rng.uniform(0.6, 1.0)
        cells = tuple(
            Cell(b, p, lat, lat)
            for b in BATCHES
            for p in PERCENTS
            for lat in [round((k0 + t * b) * max(1.0, knee / p) ** g, 3)]
        )
        dev = DeviceInfo("reference", "random", 80, "SMs")
        profiles[name] = Profile(name, dev, "table", BATCHES, PERCENTS, cells)
        l1 = k0 + t
        cap8 = 1000 * 8 / (k0 + 8 * t)
        slos.append(
            ModelSLO(
                name,
                slo_ms=round(rng.uniform(4, 12) * l1 * max(1.0, n / 4), 1),
                rate_rps=round(rng.uniform(0.2, 1.5) * cap8 / n, 1),
                priority=rng.choice(list(Priority)),
            )
        )
    return profiles, slos


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--sizes", type=int, nargs="+", default=[10, 50])
    ap.add_argument("--time-limit", type=float, default=None, help="default: scaled to size")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="  %(levelname)s %(message)s")
    for n in args.sizes:
        times = []
        for seed in range(args.seeds):
            profiles, slos = random_instance(n, random.Random(1000 * n + seed))
            t0 = time.perf_counter()
            plan = solve(profiles, slos, SolveOptions(time_limit_s=args.time_limit))
            dt = time.perf_counter() - t0
            times.append(dt)
            problems = validate_schedule(pack(plan), [m.model for m in plan.models])
            print(
                f"{n:3d} models seed {seed}: {dt:7.3f} s  {plan.status.value:10s} "
                f"cycle {plan.cycle_ms:8.2f} ms  goodput {plan.objective:9.1f}  "
                f"short {len(plan.shortfalls):2d}  "
                f"{'proven' if plan.proven_optimal else 'not proven'}  "
                f"schedule {'ok' if not problems else problems}"
            )
        print(f"{n:3d} models: median {statistics.median(times):.3f} s, max {max(times):.3f} s")


if __name__ == "__main__":
    main()
