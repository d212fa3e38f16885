"""Fidelity: the same arrivals on the real CPU runtime and in the simulator, side by side.

For each policy: one Poisson workload (`dstack.simulate.generate`, fixed seed) is replayed
open-loop against `dstack.runtime.serving.Runtime` in this process (real worker processes on
this machine's cores, `await rt.infer(...)` at each arrival instant, no HTTP, so the
numbers are the runtime's and not the web stack's), and simulated with the committed CPU
profiles (`profiles/cpu/`). Prints goodput, SLO attainment, p50/p99 of answered requests
and refused, for both, and the simulator's error.

    .venv/bin/python bench/sim_fidelity.py [--duration 60] [--policies dstack,shared]
        [--seed 1] [--scale 1.0]

The config is built here (below): resnet18 + mobilenet_v3_small, sized to load 2 cores
to about 70%, re-planning off (the simulator does not re-plan). `--scale` multiplies
both rates. One run of two policies at 60 s takes about 2.5 minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dstack.common.config import parse_config
from dstack.common.errors import DeadlineRefused, Overloaded
from dstack.policies.planning import served_profiles
from dstack.runtime.serving import Runtime
from dstack.simulate import generate, simulate

ROOT = Path(__file__).resolve().parent.parent

MODELS = [
    # name, SLO ms, max batch, rate rps
    ("resnet18", 400.0, 8, 10.0),
    ("mobilenet_v3_small", 150.0, 8, 40.0),
]


def config(policy: str, scale: float):
    return parse_config({
        "device": "cpu",
        "policy": policy,
        "profiles": str(ROOT / "profiles" / "cpu"),
        "adapt": {"enabled": False},
        "models": [
            {"name": n, "slo_ms": slo, "max_batch_size": b, "rate_rps": r * scale}
            for n, slo, b, r in MODELS
        ],
    })


@dataclass(slots=True)
class Row:
    source: str
    policy: str
    arrived: int
    goodput_rps: float
    attainment_pct: float
    p50_ms: float
    p99_ms: float
    refused: int
    late: int


async def replay(cfg, arrivals, duration_s: float) -> tuple[Row, float]:
    """Open-loop replay of `arrivals` against an in-process Runtime."""
    rt = Runtime(cfg)
    await rt.start()
    try:
        inputs = {}
        for name in arrivals.names:
            spec = rt.spec(name)
            t = spec.inputs[0]
            shape = tuple(1 if d == -1 else d for d in t.shape)
            inputs[name] = {t.name: np.random.default_rng(0).standard_normal(shape)
                            .astype(np.float32)}
        slo = {m.name: m.slo_ms / 1000 for m in cfg.models}
        lat: list[float] = []
        within = refused = late = 0

        async def one(name: str) -> None:
            nonlocal within, refused, late
            t0 = time.monotonic()
            try:
                await rt.infer(name, inputs[name])
            except (Overloaded, DeadlineRefused):
                refused += 1
                return
            dt = time.monotonic() - t0
            lat.append(dt)
            if dt <= slo[name]:
                within += 1
            else:
                late += 1

        loop = asyncio.get_running_loop()
        tasks = []
        start = loop.time()
        behind = 0.0
        for t, m in zip(arrivals.times.tolist(), arrivals.models.tolist(), strict=True):
            delay = start + t - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                behind = max(behind, -delay)
            tasks.append(asyncio.create_task(one(arrivals.names[m])))
        await asyncio.gather(*tasks)
    finally:
        await rt.stop()
    a = np.asarray(lat) * 1000 if lat else np.asarray([np.nan])
    n = len(arrivals.times)
    return Row("real", str(cfg.policy), n, within / duration_s, 100 * within / max(n, 1),
               float(np.percentile(a, 50)), float(np.percentile(a, 99)), refused, late), behind


def simulated(cfg, arrivals, duration_s: float) -> Row:
    profiles = served_profiles(cfg)
    r = simulate(cfg, profiles, arrivals, [cfg.policy], duration_s).reports[0]
    return Row("sim", r.policy, r.arrived, r.goodput_rps, r.slo_attainment_pct, r.p50_ms,
               r.p99_ms, r.refused, r.late)


def err(sim: float, real: float) -> str:
    if real == 0:
        return "-"
    return f"{100 * (sim - real) / real:+.0f}%"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--policies", default="dstack,shared")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--scale", type=float, default=1.0)
    args = ap.parse_args()
    rows: list[tuple[Row, Row, float]] = []
    for pol in args.policies.split(","):
        cfg = config(pol, args.scale)
        arrivals = generate("poisson", {m.name: m.rate_rps for m in cfg.models},
                            args.duration, args.seed)
        sim = simulated(cfg, arrivals, args.duration)
        real, behind = asyncio.run(replay(cfg, arrivals, args.duration))
        rows.append((real, sim, behind))
        print(f"{pol}: real {real}\n{pol}: sim  {sim}\n(generator at most {behind * 1000:.1f} ms "
              "behind schedule)", flush=True)
    rates = ", ".join(f"{m} {r * args.scale:g} rps (SLO {s:g} ms)" for m, s, _, r in MODELS)
    print(f"\n{args.duration:g} s Poisson, seed {args.seed}: {rates}")
    print("| policy | source | goodput rps | SLO attainment | p50 ms | p99 ms | refused | late |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for real, sim, _ in rows:
        for r in (real, sim):
            print(f"| {r.policy} | {r.source} | {r.goodput_rps:.1f} | {r.attainment_pct:.1f}% | "
                  f"{r.p50_ms:.1f} | {r.p99_ms:.1f} | {r.refused} | {r.late} |")
        print(f"| {real.policy} | error | {err(sim.goodput_rps, real.goodput_rps)} | "
              f"{sim.attainment_pct - real.attainment_pct:+.1f} pt | "
              f"{err(sim.p50_ms, real.p50_ms)} | {err(sim.p99_ms, real.p99_ms)} | "
              f"{sim.refused - real.refused:+d} | {sim.late - real.late:+d} |")


if __name__ == "__main__":
    main()
