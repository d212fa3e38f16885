"""Benchmark: one simulated hour of 10 models at 1,000 rps in all, per policy: the wall time
of each policy's event loop, the CPU time of its whole run, the decisions per second. The
models: the reference V100 profiles scaled x0.5-x1.4, 100 rps each.

    .venv/bin/python bench/bench_simulate.py [--duration 3600] [--policies dstack,...]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

from dstack.common.config import PolicyName, parse_config
from dstack.common.types import load_profiles, scaled
from dstack.simulate import format_table, generate, simulate
from dstack.simulate.engine import COMPILED

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--duration", type=float, default=3600.0)
    ap.add_argument("--policies", default="dstack,temporal,shared,spatial")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    base = load_profiles(ROOT / "profiles" / "reference-v100")
    kinds = ["alexnet", "resnet50", "alexnet", "vgg19", "alexnet",
             "resnet50", "alexnet", "alexnet", "resnet50", "alexnet"]
    factors = [0.5, 0.6, 0.7, 0.5, 0.9, 0.7, 1.0, 1.2, 0.8, 1.4]
    slos = {"alexnet": 60.0, "resnet50": 120.0, "vgg19": 200.0}
    profiles, models = {}, []
    for i, (k, f) in enumerate(zip(kinds, factors, strict=True)):
        name = f"m{i}-{k}"
        profiles[name] = replace(scaled(base[k], f), model=name)
        models.append({"name": name, "slo_ms": slos[k], "max_batch_size": 32, "rate_rps": 100})
    cfg = parse_config({"device": "cuda", "policy": "shared", "models": models})
    t0 = time.perf_counter()
    arrivals = generate("poisson", {m["name"]: 100.0 for m in models}, args.duration, args.seed)
    print(f"workload: {arrivals.times.size} requests in {time.perf_counter() - t0:.1f} s; "
          f"event loop {'compiled' if COMPILED else 'uncompiled (Python)'}")
    reports = []
    for pol in args.policies.split(","):
        cpu0 = time.process_time()
        sim = simulate(cfg, profiles, arrivals, [PolicyName(pol)], args.duration)
        cpu = time.process_time() - cpu0
        setup_s, wall = sim.wall_s[pol]
        r = sim.reports[0]
        reports.append(r)
        # CPU time as well as wall time: on a shared machine the wall time of a run counts
        # the other processes' turns too.
        print(f"{pol:9s} event loop {wall:6.1f} s wall, run {cpu:6.1f} s CPU, for "
              f"{args.duration:g} simulated s ({args.duration / wall:5.0f}x real time; "
              f"{r.decisions} policy decisions, "
              f"{wall / max(r.decisions, 1) * 1e6:.0f} us per decision incl. its events); "
              f"setup + solve {setup_s:.1f} s", flush=True)
    print(format_table(reports))


if __name__ == "__main__":
    main()
