"""The `dstack` lane planner: its speed, and its MILP against the greedy merge search.

    .venv/bin/python -m bench.bench_optimizer [--seeds 3] [--sizes 10 50] [--repeat 3]
        [--compare 7 20]

Mixes from the policy suite's generator (`bench.bench_policies.draw_mix`), the number of
models fixed. 1. Plan time of `plan_lanes` on H100 mixes of each `--sizes` (median of
`--repeat`), with how its search ended. 2. On mixes of 7-20 models (one per device and
size), the predicted goodput G of the greedy plan and of the MILP's, every model placed;
up to 8 models also the optimum (the MILP over every subset at every width).
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench import bench_policies
from dstack.policies import lane_planning
from dstack.policies.planning import served_profiles
from optimizer import lane_milp
from optimizer.lanes import Lanes

H100 = "nvidia-h100-80gb-hbm3"
#: Up to this many models the comparison also solves the MILP over every lane (the optimum).
EXACT_UP_TO = 8


def mix_of(n: int, seed: int, device: str | None = None, start: int = 0):
    """The first suite mix (from index `start`) of `n` models, on `device` if given."""
    bench_policies.MODELS_RANGE = (n, n)
    i = start
    while True:
        mix = bench_policies.draw_mix(seed, i)
        if device is None or mix.device_dir == device:
            return mix
        i += 1


def plan_time(sizes: list[int], seeds: int, repeat: int) -> None:
    print(f"plan time: plan_lanes on H100 mixes (each mix's median of {repeat} run(s))")
    for n in sizes:
        times = []
        for seed in range(seeds):
            mix = mix_of(n, seed, H100)
            cfg = bench_policies.mix_config(mix)
            profiles = served_profiles(cfg, check_device=False)
            runs = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                plan, _, _ = lane_planning.plan_lanes(cfg, profiles, None)
                runs.append(time.perf_counter() - t0)
            dt = statistics.median(runs)
            times.append(dt)
            print(f"  {n:3d} models seed {seed}: {dt:7.3f} s  G {plan.objective:9.1f}  "
                  f"{len(plan.lanes):2d} lanes  {plan.status.value:10s} {plan.search}")
        print(f"  {n:3d} models: median {statistics.median(times):.3f} s, "
              f"max {max(times):.3f} s")


def compare(lo: int, hi: int, seed: int) -> None:
    print(f"MILP against greedy, mixes of {lo}-{hi} models (seed {seed}), every model placed")
    print(f"  {'mix':12s} {'n':>3s} {'greedy G':>10s} {'MILP G':>10s} {'MILP/greedy':>11s} "
          f"{'greedy s':>8s} {'MILP s':>7s}  status")
    wins = {"milp": 0, "tie": 0, "greedy": 0}
    for n in range(lo, hi + 1):
        for k in range(len(bench_policies.DEVICES)):
            mix = mix_of(n, seed, start=k)
            cfg = bench_policies.mix_config(mix)
            profiles = served_profiles(cfg, check_device=False)
            backend = lane_planning.backend_of(profiles)
            inst = lane_planning._instance(cfg, profiles, backend, None,
                                           lane_planning.LATENCY_MARGIN)[0]
            t0 = time.perf_counter()
            greedy = Lanes(inst).greedy()
            t1 = time.perf_counter()
            best = lane_milp.search(Lanes(inst), drop=False)
            t2 = time.perf_counter()
            exact = ""
            if n <= EXACT_UP_TO:  # every lane a candidate: the optimum, for reference
                full = lane_milp.search(Lanes(inst), drop=False, exact_max=n,
                                        time_limit_s=60.0)
                exact = f"; optimum {full.value:.1f} ({full.value / best.value:.4f}x MILP)"
            ratio = best.value / greedy.value if greedy.value > 0 else 1.0
            who = "milp" if ratio > 1 + 1e-6 else "greedy" if ratio < 1 - 1e-6 else "tie"
            wins[who] += 1
            dev = bench_policies.DEVICE_SHORT.get(mix.device_dir, mix.device_dir)
            print(f"  {mix.id + ' ' + dev:12s} {n:3d} {greedy.value:10.1f} {best.value:10.1f} "
                  f"{ratio:11.4f} {t1 - t0:8.2f} {t2 - t1:7.2f}  "
                  f"{best.status.describe() if best.status else ''}{exact}")
    print(f"  MILP higher on {wins['milp']}, equal on {wins['tie']}, greedy higher on "
          f"{wins['greedy']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3, help="H100 mixes per size for plan time")
    ap.add_argument("--sizes", type=int, nargs="*", default=[10, 50])
    ap.add_argument("--repeat", type=int, default=3,
                    help="plan each plan-time mix this many times, report the median")
    ap.add_argument("--compare", type=int, nargs=2, default=[7, 20], metavar=("LO", "HI"),
                    help="model counts of the MILP/greedy comparison (0 0: skip it)")
    ap.add_argument("--seed", type=int, default=1, help="the comparison's suite seed")
    args = ap.parse_args()
    if args.sizes:
        plan_time(args.sizes, args.seeds, args.repeat)
    if args.compare[1] > 0:
        compare(args.compare[0], args.compare[1], args.seed)


if __name__ == "__main__":
    main()
