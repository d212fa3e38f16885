"""Fleets in the simulator: dstack placement + lane plans against the way Ray Serve users
serve many models today, and the devices `dstack cluster plan --nodes auto` needs
(docs/cluster.md says what each baseline is).

    .venv/bin/python -m bench.bench_cluster [--models 50] [--nodes 8] [--seed 1]
    .venv/bin/python -m bench.bench_cluster --real [--real-seconds 12] [--target 0.99]

--real measures `dstack cluster serve` (a local Ray) with two one-core CPU nodes, then one,
on a 4-model CPU mix: the highest open-loop rate at which every model keeps >= 99% of its
requests within its SLO, and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from bench.servers import ROOT, get_json, serving
from dstack.cluster.config import ClusterConfig, parse_cluster
from dstack.common.types import load_profiles
from dstack.simulate.ideal import cost_per_request_s

H100 = ROOT / "profiles" / "nvidia-h100-80gb-hbm3"
H100_MEMORY_MB = 81559.0


def random_cluster(n_models: int, n_nodes: int, seed: int, *, load: float = 0.7,
                   profiles: Path = H100, memory_mb: float = H100_MEMORY_MB,
                   slo_factor: tuple[float, float] = (4.0, 20.0)) -> ClusterConfig:
    """`n_models` models drawn from `profiles`, SLOs f x their batch-1 latency on the whole
    device (f uniform in `slo_factor`), rates making the fleet's load (sum of rate x
    cheapest device-seconds a request) `load` x `n_nodes`, split by a flat Dirichlet."""
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


#: The real benchmark's CPU mix (profiles/cpu): (name, zoo model, SLO ms, rate at scale 1).
REAL_MIX = (("tiny_cnn", "tiny_cnn", 300, 20.0), ("mobilenet", "mobilenet_v3_small", 400, 10.0),
            ("resnet18", "resnet18", 600, 4.0), ("resnet18_slow", "resnet18", 1200, 2.0))


def real_config(n_nodes: int, plan_scale: float) -> dict[str, Any]:
    """`n_nodes` one-core CPU nodes serving `REAL_MIX` planned at `plan_scale` x its rates."""
    cpu = ROOT / "profiles" / "cpu"
    return {
        "policy": "dstack",
        "ingress": {"replace_on_drift": False},
        "nodes": [{"name": f"n{i}", "device": "cpu", "profiles": str(cpu), "memory_mb": 4096,
                   "num_cpus": 1, "cores": [i]} for i in range(n_nodes)],
        "models": [{"name": n, "zoo_name": z, "slo_ms": slo, "rate_rps": r * plan_scale,
                    "max_batch_size": 8} for n, z, slo, r in REAL_MIX],
    }


def highest_scale(host: str, seconds: float, start: float, target: float, log: list[str]
                  ) -> float:
    """The highest scale of `REAL_MIX`'s rates at which every model meets `target`: up by
    x1.4 from `start` until one misses, then a bisection."""
    from bench.chaos_load import open_loop, p99

    slos = {n: float(slo) for n, _, slo, _ in REAL_MIX}

    def ok(scale: float) -> bool:
        rates = {n: r * scale for n, _, _, r in REAL_MIX}
        out = asyncio.run(open_loop(host, rates, slos, seconds, seed=int(scale * 1000)))
        att = {m: (o.ok / o.sent if o.sent else 0.0) for m, o in out.items()}  # misses too
        good = all(a >= target for a in att.values())
        line = (f"  scale {scale:6.2f} ({sum(rates.values()):6.1f} rps): " + ", ".join(
            f"{m} {att[m] * 100:5.1f}% ({o.late} late, {o.refused.total()} refused, "
            f"{o.errors} err, "
            f"p99 {p99(o):.0f} ms)" for m, o in out.items()) + ("  ok" if good else "  MISS"))
        print(line, flush=True)
        log.append(line)
        return good

    asyncio.run(open_loop(host, {n: r for n, _, _, r in REAL_MIX}, slos, 4.0))  # warm up
    lo, hi = 0.0, start
    if ok(hi):
        while ok(hi * 1.4):
            hi *= 1.4
            if hi > 200:
                return hi
        lo, hi = hi, hi * 1.4
    else:
        while lo == 0.0 and hi > start / 8:
            hi /= 1.6
            if ok(hi):
                lo, hi = hi, hi * 1.6
        if lo == 0.0:
            return 0.0
    mid = (lo + hi) / 2
    return mid if ok(mid) else lo


def run_real(seconds: float, target: float, outdir: Path) -> int:
    """Two one-core CPU nodes against one, on `REAL_MIX`, through `dstack cluster serve`."""
    outdir.mkdir(parents=True, exist_ok=True)
    results: dict[int, float] = {}
    log: list[str] = []
    for n_nodes, plan_scale, start in ((1, 2.0, 1.0), (2, 4.0, 2.0)):
        cfg = outdir / f"cluster-{n_nodes}.yaml"
        cfg.write_text(yaml.safe_dump(real_config(n_nodes, plan_scale)))
        print(f"{n_nodes} one-core node(s), planned at scale {plan_scale:g}; load average "
              f"{os.getloadavg()[0]:.2f}", flush=True)
        with serving(cfg, outdir / f"cluster-{n_nodes}.log", 400,
                     command=("cluster", "serve"), grace_s=60) as srv:
            host = srv.host
            placed = get_json(host + "/v1/cluster")
            print(f"  placement: {placed['serving']}", flush=True)
            results[n_nodes] = highest_scale(host, seconds, start, target, log)
        rate = results[n_nodes] * sum(r for *_, r in REAL_MIX)
        print(f"{n_nodes} node(s): highest scale {results[n_nodes]:.2f} ({rate:.1f} rps) with "
              f"every model >= {target * 100:g}% within its SLO", flush=True)
    ratio = results[2] / results[1] if results[1] else float("inf")
    print(f"\ntwo one-core nodes / one: {ratio:.2f}x the highest rate at >= "
          f"{target * 100:g}% attainment (target >= 1.5x); load average at the end "
          f"{os.getloadavg()[0]:.2f} (a shared 2-core machine: indicative)")
    (outdir / "result.json").write_text(json.dumps(
        {"scale": results, "ratio": ratio, "trials": log}, indent=1))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--real", action="store_true",
                    help="the real benchmark: two one-core CPU nodes vs one on Ray (REAL_MIX)")
    ap.add_argument("--real-seconds", type=float, default=12.0, help="seconds per trial")
    ap.add_argument("--target", type=float, default=0.99, help="attainment every model needs")
    ap.add_argument("--out", default="out/bench-cluster", help="configs and logs (--real)")
    ap.add_argument("--models", type=int, default=50)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--load", type=float, default=0.7)
    ap.add_argument("--duration", type=float, default=20.0, help="virtual seconds")
    args = ap.parse_args()
    if args.real:
        return run_real(args.real_seconds, args.target, Path(args.out))
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

    big = random_cluster(200, 64, args.seed, load=args.load)
    bp = ClusterPlanner(big)
    t0 = time.perf_counter()
    p = bp.place()
    print("placement of 200 models on 64 H100s: "
          f"{time.perf_counter() - t0:.2f} s ({p.method}, {p.evaluations} node plans), "
          f"predicted weighted goodput {p.value:.0f} of {sum(m.rate_rps for m in big.models):.0f}"
          f" rps, {len(bp.served_whole(p))} models short of their rate")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
