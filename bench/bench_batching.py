"""`make bench-batching` (`python -m bench.bench_batching`): issue 18 part 3 on this machine.

In one run, on one model (mobilenet_v3_small, policy shared, SLO 100 ms, max batch 8):

1. **Capacity**: the model called directly in process at its largest batch, on the same
   cores (best of three 0.8 s bursts): items/s no server can beat.
2. **`batching: rate` against the window** (`max_queue_delay_ms: 5`): a real server for
   each (`dstack serve` subprocess on 127.0.0.1, stopped by PID on every path), the same
   seeded open-loop Poisson load whose rate steps 0.3x -> 1.2x -> 0.3x of capacity: p50 and
   p99 latency of the answered requests and goodput within the SLO, per phase and over
   the run, and the ratios rate / window.
3. **The gap between batches with and without double buffering** (`double_buffer`): a
   real server for each, 16 closed-loop tritonclient clients (twice the max batch, so the
   next batch is always queued when one ends); from the server's statistics the time per
   batch the worker is not computing: (wall time - compute time) / batches.

Output: tables on stdout and every number in `out/bench/batching.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from bench.ceiling import InProcess
from bench.loads import TritonClients, one_item_body
from bench.servers import ROOT, get_json, model_stats, serving

MODEL = "mobilenet_v3_small"
SLO_MS = 100.0
MAX_BATCH = 8
STEPS = (0.3, 1.2, 0.3)  # multiples of capacity, one phase each


def write_config(outdir: Path, name: str, *, batching: str, double_buffer: bool) -> Path:
    cfg = {"device": "cpu", "policy": "shared", "double_buffer": double_buffer,
           "models": [{"name": MODEL, "slo_ms": SLO_MS, "max_batch_size": MAX_BATCH,
                       "max_queue_delay_ms": 5, "batching": batching}]}
    path = outdir / f"batching-{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@dataclass
class Sent:
    at_s: float  # scheduled send time from the start of the load
    latency_ms: float | None = None  # None: not answered with 200
    status: int = 0


@dataclass
class Stepped:
    phases: list[tuple[float, float]]  # (rate rps, seconds)
    sent: list[Sent] = field(default_factory=list)
    lag_ms: float = 0.0


async def stepped_open_loop(host: str, phases: list[tuple[float, float]], seed: int,
                            max_inflight: int = 512) -> Stepped:
    """Poisson arrivals whose rate is constant within each phase; every request's send
    time and outcome kept (latency from the send to the full response)."""
    import aiohttp

    rng = np.random.default_rng(seed)
    body, headers = one_item_body(get_json(f"{host}/v2/models/{MODEL}"))
    times: list[float] = []
    t0 = 0.0
    for rate, seconds in phases:
        ts = t0 + np.cumsum(rng.exponential(1 / rate, int(rate * seconds * 2) + 10))
        times += ts[ts < t0 + seconds].tolist()
        t0 += seconds
    out = Stepped(phases, [Sent(t) for t in times])
    sem = asyncio.Semaphore(max_inflight)
    conn = aiohttp.TCPConnector(limit=max_inflight)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=30)) as http:

        async def one(s: Sent, start: float) -> None:
            async with sem:
                t = time.perf_counter()
                out.lag_ms = max(out.lag_ms, (t - start - s.at_s) * 1000)
                try:
                    async with http.post(f"{host}/v2/models/{MODEL}/infer", data=body,
                                         headers=headers) as r:
                        await r.read()
                        s.status = r.status
                except (aiohttp.ClientError, TimeoutError):
                    s.status = -1
                    return
                if s.status == 200:
                    s.latency_ms = (time.perf_counter() - t) * 1000

        start = time.perf_counter()
        tasks = []
        for s in out.sent:
            delay = start + s.at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(s, start)))
        await asyncio.gather(*tasks)
    return out


def summarize(sent: list[Sent], seconds: float) -> dict[str, Any]:
    lat = np.array([s.latency_ms for s in sent if s.latency_ms is not None])
    ok = int((lat <= SLO_MS).sum()) if lat.size else 0
    return {"sent": len(sent), "answered": int(lat.size), "within_slo": ok,
            "refused": sum(s.status in (429, 503) for s in sent),
            "errors": sum(s.status not in (200, 429, 503) for s in sent),
            "goodput_rps": ok / seconds,
            "p50_ms": float(np.percentile(lat, 50)) if lat.size else float("nan"),
            "p99_ms": float(np.percentile(lat, 99)) if lat.size else float("nan")}


def run_stepped(config: Path, log: Path, capacity: float, phase_s: float,
                seed: int) -> dict[str, Any]:
    phases = [(x * capacity, phase_s) for x in STEPS]
    with serving(config, log) as srv:
        # warm the HTTP path and the worker; the rate estimate then decays for 3 s
        asyncio.run(stepped_open_loop(srv.host, [(0.3 * capacity, 1.0)], seed + 1000))
        time.sleep(3.0)
        res = asyncio.run(stepped_open_loop(srv.host, phases, seed))
        stats = model_stats(srv.host, MODEL)
    out: dict[str, Any] = {"all": summarize(res.sent, phase_s * len(STEPS)),
                           "lag_ms": res.lag_ms, "stats": stats, "phases": []}
    for i, (rate, seconds) in enumerate(phases):
        part = [s for s in res.sent if i * seconds <= s.at_s < (i + 1) * seconds]
        out["phases"].append({"x": STEPS[i], "rate_rps": rate, **summarize(part, seconds)})
    return out


def run_gap(config: Path, log: Path, seconds: float, clients: int) -> dict[str, Any]:
    async def measure(host: str) -> dict[str, Any]:
        tc = TritonClients(host, MODEL, clients)
        try:
            await tc.window(1.0, SLO_MS)  # connect, warm up
            s0, t0 = model_stats(host, MODEL), time.perf_counter()
            rps, good, p99, refused = await tc.window(seconds, SLO_MS)
            s1, t1 = model_stats(host, MODEL), time.perf_counter()
        finally:
            await tc.close()
        batches = max(1, s1["execution_count"] - s0["execution_count"])
        compute = (s1["compute_ns"] - s0["compute_ns"]) / 1e9
        wall = t1 - t0
        return {"rps": rps, "goodput_rps": good, "p99_ms": p99, "refused": refused,
                "batches": batches,
                "avg_batch": (s1["inference_count"] - s0["inference_count"]) / batches,
                "compute_ms_per_batch": 1000 * compute / batches,
                "gap_ms_per_batch": 1000 * (wall - compute) / batches,
                "worker_busy": compute / wall}

    with serving(config, log) as srv:
        return asyncio.run(measure(srv.host))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.bench_batching", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase-seconds", type=float, default=10.0,
                    help="length of each load phase (0.3x, 1.2x, 0.3x)")
    ap.add_argument("--gap-seconds", type=float, default=10.0,
                    help="closed-loop time per double-buffering setting")
    ap.add_argument("--clients", type=int, default=2 * MAX_BATCH)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="out/bench")
    args = ap.parse_args(argv)
    outdir = ROOT / args.out
    outdir.mkdir(parents=True, exist_ok=True)
    cores = sorted(os.sched_getaffinity(0))
    t_all = time.monotonic()
    print(f"load average at start: {os.getloadavg()}", flush=True)
    with InProcess(MODEL, cores) as direct:
        capacity = max(direct.items_s(MAX_BATCH, 0.8) for _ in range(3))
    print(f"capacity: {MODEL} in process at batch {MAX_BATCH}: {capacity:.1f} items/s "
          f"on cores {cores}", flush=True)
    results: dict[str, Any] = {"model": MODEL, "slo_ms": SLO_MS, "cores": cores,
                               "capacity_items_s": capacity, "steps": STEPS,
                               "phase_s": args.phase_seconds, "seed": args.seed,
                               "clients": args.clients,
                               "batching": {}, "gap": {}}
    for batching in ("window", "rate"):
        cfg = write_config(outdir, batching, batching=batching, double_buffer=True)
        r = run_stepped(cfg, outdir / f"server-batching-{batching}.log", capacity,
                        args.phase_seconds, args.seed)
        results["batching"][batching] = r
        a = r["all"]
        print(f"  batching {batching:6s}: p50 {a['p50_ms']:6.1f} ms  p99 {a['p99_ms']:6.1f} ms"
              f"  goodput {a['goodput_rps']:6.1f} rps  ({a['within_slo']}/{a['sent']} within "
              f"SLO, {a['refused']} refused); worst send lag {r['lag_ms']:.1f} ms", flush=True)
    for double in (True, False):
        name = "on" if double else "off"
        cfg = write_config(outdir, f"double-{name}", batching="window", double_buffer=double)
        g = run_gap(cfg, outdir / f"server-double-{name}.log", args.gap_seconds, args.clients)
        results["gap"][name] = g
        print(f"  double buffering {name:3s}: gap {g['gap_ms_per_batch']:.2f} ms per batch "
              f"(compute {g['compute_ms_per_batch']:.1f} ms, avg batch {g['avg_batch']:.1f}), "
              f"{g['rps']:.1f} req/s, worker busy {100 * g['worker_busy']:.1f}%", flush=True)
    results["elapsed_s"] = time.monotonic() - t_all
    results["load_average_end"] = os.getloadavg()
    print(report(results))
    (outdir / "batching.json").write_text(json.dumps(results, indent=1, default=float))
    print(f"\nwrote {outdir / 'batching.json'}; {results['elapsed_s']:.0f} s; load average "
          f"at end {results['load_average_end']}")
    return 0


def report(r: dict[str, Any]) -> str:
    w, x = r["batching"]["window"], r["batching"]["rate"]
    lines = [f"\n{r['model']}, SLO {r['slo_ms']:g} ms, capacity {r['capacity_items_s']:.1f} "
             f"items/s; open-loop Poisson {' -> '.join(f'{s:g}x' for s in r['steps'])} "
             f"({r['phase_s']:g} s each), seed {r['seed']}:"]
    head = (f"{'phase':>10s} {'offered':>8s} | {'window p50/p99 ms':>18s} {'goodput':>8s} | "
            f"{'rate p50/p99 ms':>16s} {'goodput':>8s} | {'ratio p50/p99/goodput':>22s}")
    lines += [head, "-" * len(head)]
    rows = [(f"{p['x']:g}x", p["rate_rps"], p, q)
            for p, q in zip(w["phases"], x["phases"], strict=True)]
    rows.append(("all", sum(p["sent"] for p in w["phases"]) / (r["phase_s"] * len(r["steps"])),
                 w["all"], x["all"]))
    for name, offered, p, q in rows:
        lines.append(
            f"{name:>10s} {offered:8.1f} | {p['p50_ms']:8.1f} /{p['p99_ms']:7.1f} "
            f"{p['goodput_rps']:8.1f} | {q['p50_ms']:7.1f} /{q['p99_ms']:7.1f} "
            f"{q['goodput_rps']:8.1f} | {_ratio(q['p50_ms'], p['p50_ms']):6.2f} "
            f"{_ratio(q['p99_ms'], p['p99_ms']):6.2f} "
            f"{_ratio(q['goodput_rps'], p['goodput_rps']):8.2f}")
    on, off = r["gap"]["on"], r["gap"]["off"]
    lines.append(f"\nGap between batches, {r['clients']} closed-loop clients (window "
                 f"batching): double buffering on {on['gap_ms_per_batch']:.2f} ms per batch, "
                 f"off {off['gap_ms_per_batch']:.2f} ms (ratio on/off "
                 f"{_ratio(on['gap_ms_per_batch'], off['gap_ms_per_batch']):.2f}); "
                 f"throughput {on['rps']:.1f} vs {off['rps']:.1f} req/s "
                 f"({_ratio(on['rps'], off['rps']):.2f}x)")
    return "\n".join(lines)


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


if __name__ == "__main__":
    sys.exit(main())
