"""Fleets in the simulator: dstack placement + lane plans against the way Ray Serve users
serve many models today, and the devices `dstack cluster plan --nodes auto` needs.

    .venv/bin/python -m bench.bench_cluster [--models 50] [--nodes 8] [--seed 1]
        [--duration 20] [--load 0.7] [--scale-models 200 --scale-nodes 64]

Every figure is predicted or simulated (virtual clock, latencies from the H100 profiles in
profiles/nvidia-h100-80gb-hbm3): see docs/cluster.md for what each baseline is.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from dstack.cluster.config import ClusterConfig, parse_cluster
from dstack.common.types import load_profiles
from dstack.simulate.ideal import cost_per_request_s

H100 = Path(__file__).resolve().parent.parent / "profiles" / "nvidia-h100-80gb-hbm3"
H100_MEMORY_MB = 81559.0


def random_cluster(n_models: int, n_nodes: int, seed: int, *, load: float = 0.7,
                   profiles: Path = H100, memory_mb: float = H100_MEMORY_MB,
                   slo_factor: tuple[float, float] = (4.0, 20.0)) -> ClusterConfig:
    """`n_models` models drawn from `profiles` (names repeat as `zoo-i`), each with an SLO
    of f x its batch-1 latency on the whole device (f uniform in `slo_factor`) and a rate
    such that the fleet's load (sum of rate x cheapest device-seconds a request) is `load`
    x `n_nodes` devices, split by a flat Dirichlet; `n_nodes` identical nodes."""
    rng = np.random.default_rng(seed)
    profs = load_profiles(profiles)
    zoo = sorted(profs)
    shares = rng.dirichlet(np.ones(n_models))
    models = []
    for i in range(n_models):
        z = zoo[int(rng.integers(len(zoo)))]
        prof = profs[z]
        l1 = prof.latency_ms(min(prof.batch_sizes), max(prof.percentages))
        slo = round(l1 * float(rng.uniform(*slo_factor)), 2)
        cost = cost_per_request_s(prof, slo / 2, 64)  # a request may wait out one batch
        rate = round(float(shares[i]) * load * n_nodes / cost, 1)
        models.append({"name": f"{z}-{i}", "zoo_name": z, "slo_ms": slo,
                       "rate_rps": max(rate, 1.0), "max_batch_size": 64,
                       "max_queue_delay_ms": round(min(2.0, slo / 4), 3)})
    return parse_cluster({
        "policy": "dstack",
        "nodes": [{"name": "h100", "device": "cuda", "profiles": str(profiles),
                   "memory_mb": memory_mb, "worker_overhead_mb": 500, "count": n_nodes}],
        "models": models,
    }, source=f"random cluster (seed {seed})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=int, default=50)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--load", type=float, default=0.7)
    ap.add_argument("--duration", type=float, default=20.0, help="virtual seconds")
    ap.add_argument("--scale-models", type=int, default=200)
    ap.add_argument("--scale-nodes", type=int, default=64)
    args = ap.parse_args()
    from dstack.cluster.fleet import format_fleet, ray_serve_copies, simulate_fleet
    from dstack.cluster.planning import ClusterPlanner
    from dstack.common.config import PolicyName
    from dstack.simulate.workload import generate

    cfg = random_cluster(args.models, args.nodes, args.seed, load=args.load)
    planner = ClusterPlanner(cfg)
    t0 = time.perf_counter()
    placement = planner.place()
    placed_s = time.perf_counter() - t0
    arrivals = generate("poisson", {m.name: m.rate_rps for m in cfg.models}, args.duration,
                        args.seed)
    reports = [simulate_fleet("dstack", planner, placement.copies, PolicyName.DSTACK,
                              arrivals, args.duration, seed=args.seed)]
    for strategy in ("round_robin", "first_fit"):
        copies = ray_serve_copies(planner, "h100", args.nodes, strategy)
        reports.append(simulate_fleet(f"ray serve, {strategy.replace('_', ' ')}", planner,
                                      copies, PolicyName.SHARED, arrivals, args.duration,
                                      seed=args.seed))
    rate = sum(m.rate_rps for m in cfg.models)
    print(f"{args.models} models on {args.nodes} H100s (seed {args.seed}, load {args.load}: "
          f"{rate:.0f} rps in all), Poisson, {args.duration:g} virtual s; dstack placement "
          f"{placed_s:.1f} s ({placement.method}, predicted {placement.value:.0f} rps "
          f"weighted). Simulated, not measured.")
    print(format_fleet(reports, args.duration))
    best_ray = max(r.goodput_rps for r in reports[1:])
    print(f"dstack / best Ray Serve way: {reports[0].goodput_rps / best_ray:.2f}x goodput")

    t0 = time.perf_counter()
    got = planner.fewest_nodes("h100")
    auto_s = time.perf_counter() - t0
    alone = planner.one_model_per_device("h100")
    print(f"--nodes auto: {got[0] if got else 'none'} H100s serve every model within its SLO "
          f"(predicted; {auto_s:.1f} s); one model per GPU: {alone} H100s")

    big = random_cluster(args.scale_models, args.scale_nodes, args.seed, load=args.load)
    bp = ClusterPlanner(big)
    t0 = time.perf_counter()
    p = bp.place()
    print(f"placement of {args.scale_models} models on {args.scale_nodes} H100s: "
          f"{time.perf_counter() - t0:.2f} s ({p.method}, {p.evaluations} node plans), "
          f"predicted weighted goodput {p.value:.0f} of {sum(m.rate_rps for m in big.models):.0f}"
          f" rps, {len(bp.served_whole(p))} models short of their rate")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
