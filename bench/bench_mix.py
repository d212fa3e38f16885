"""`make bench` (`python -m bench.bench_mix`): the four policies side by side on this
machine, against the limit.

In one run:
1. **In-process ceiling** per model: the model called directly in a fresh process with the
   same cores and threads the server's workers get, at batch 1, 2, 4 and 8 (best of three
   0.8 s bursts each); the best items/s is what no server can beat.
2. **Two-model mix** (`configs/bench-mix-<policy>.yaml`): for each policy a real server
   (`dstack serve` subprocess on 127.0.0.1, free port, polled on `/v2/health/ready`,
   stopped by PID on every path) under the same open-loop Poisson load at several rates
   (a multiple of the configured `rate_rps`, ascending): goodput within SLO, attainment,
   p99 per rate; the **maximum sustainable rate** is the highest multiple with >= 99%
   attainment on every model.
3. **Single model** (`configs/bench-single-resnet18-<policy>.yaml`): 8 concurrent
   tritonclient (aio) clients, closed loop: goodput against the ceiling at the best batch,
   in windows alternating with the ceiling's own (over all windows). The `shared` row
   is issue 2's figure. On tiny_cnn (`shared`) the same gives the **server overhead** per
   request next to the ceiling.
4. **Peak RSS** of each server and its workers (the kernel's high-water mark, VmHWM).

Output: a table on stdout, `docs/benchmarks.png` (goodput vs offered load per policy),
and `out/bench/bench.json` with every number.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench.ceiling import InProcess, contenders, figure
from bench.loads import open_loop, p99
from bench.servers import ROOT, peak_rss_mb, rates_slos, serving
from bench.single import bench_single

POLICIES = ("temporal", "shared", "spatial", "dstack")


def bench_mix(policy: str, scales: list[float], seconds: float, outdir: Path) -> dict[str, Any]:
    config = ROOT / f"configs/bench-mix-{policy}.yaml"
    base, slos = rates_slos(config)
    points = []
    with serving(config, outdir / f"server-mix-{policy}.log") as srv:
        # Warm the HTTP path and the workers before measuring.
        asyncio.run(open_loop(srv.host, {m: min(r, 5.0) for m, r in base.items()}, slos, 1.0))
        for s in scales:
            rates = {m: r * s for m, r in base.items()}
            res = asyncio.run(open_loop(srv.host, rates, slos, seconds, seed=int(s * 100)))
            sent = sum(o.sent for o in res.values())
            ok = sum(o.ok for o in res.values())
            points.append({
                "scale": s, "offered_rps": sum(rates.values()),
                "goodput_rps": ok / seconds,
                "attainment": ok / sent if sent else 0.0,
                "per_model": {m: {"sent": o.sent, "ok": o.ok, "late": o.late,
                                  "refused": o.refused, "error": o.error,
                                  "attainment": o.ok / o.sent if o.sent else 0.0,
                                  "p99_ms": p99(o), "lag_ms": o.lag_ms}
                              for m, o in res.items()},
            })
            print(f"  {policy:8s} x{s:<4g} offered {sum(rates.values()):6.1f} rps  goodput "
                  f"{ok / seconds:6.1f}  attainment {100 * points[-1]['attainment']:5.1f}%  "
                  + "  ".join(f"{m} p99 {p99(o):.0f} ms" for m, o in res.items()), flush=True)
        rss = peak_rss_mb(srv)
    sustainable = max((p["offered_rps"] for p in points
                       if all(v["attainment"] >= 0.99 for v in p["per_model"].values())),
                      default=0.0)
    return {"points": points, "max_sustainable_rps": sustainable, "rss_mb": rss,
            "seconds": seconds}


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    top = 0.0
    for pol, r in results["mix"].items():
        xs = [p["offered_rps"] for p in r["points"]]
        ys = [p["goodput_rps"] for p in r["points"]]
        top = max(top, *xs)
        ax.plot(xs, ys, marker="o", label=pol)
    ax.plot([0, top], [0, top], ls=":", c="gray", label="offered (all within SLO)")
    ax.set_xlabel("offered load (requests/s, Poisson, both models)")
    ax.set_ylabel("goodput (requests/s within SLO)")
    ax.set_title("mobilenet_v3_small + resnet18 on 2 CPU cores")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.bench_mix", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scales", default="0.5,1,1.5,2",
                    help="offered load as multiples of the configs' rate_rps")
    ap.add_argument("--seconds", type=float, default=6.0, help="length of each load point")
    ap.add_argument("--single-rounds", type=int, default=36,
                    help="single-model runs: server windows, each beside an in-process one")
    ap.add_argument("--single-window", type=float, default=1.0,
                    help="single-model runs: seconds measured per window")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--out", default="out/bench")
    ap.add_argument("--plot", default="docs/benchmarks.png")
    args = ap.parse_args(argv)
    outdir = ROOT / args.out
    outdir.mkdir(parents=True, exist_ok=True)
    policies = [p for p in args.policies.split(",") if p]
    scales = [float(s) for s in args.scales.split(",")]
    cores = sorted(os.sched_getaffinity(0))
    t_all = time.monotonic()
    print(f"load average at start: {os.getloadavg()}", flush=True)

    print("in-process ceiling (best batch, same cores):", flush=True)
    ceil: dict[str, Any] = {}
    for m in ("tiny_cnn", "mobilenet_v3_small", "resnet18"):
        # Best of three rounds per batch size: on a shared machine noise only slows a run.
        with InProcess(m, cores) as direct:
            per_b = {b: max(direct.items_s(b, 0.8) for _ in range(3)) for b in (1, 2, 4, 8)}
        best = max(per_b, key=per_b.__getitem__)
        ceil[m] = {"per_batch": per_b, "best_batch": best, "items_s": per_b[best]}
        print(f"  {m:20s} best batch {best}: {per_b[best]:8.1f} items/s  "
              + " ".join(f"b{b}={v:.0f}" for b, v in per_b.items()), flush=True)

    results: dict[str, Any] = {"cores": cores, "ceiling": ceil, "mix": {}, "single": {}}
    print("two-model mix, open-loop Poisson:", flush=True)
    for pol in policies:
        results["mix"][pol] = bench_mix(pol, scales, args.seconds, outdir)

    print("single model, 8 tritonclient aio clients (closed loop):", flush=True)
    for pol in policies:
        r = bench_single(ROOT / f"configs/bench-single-resnet18-{pol}.yaml", "resnet18",
                         outdir, cores=cores, batches=contenders(ceil["resnet18"]),
                         rounds=args.single_rounds, window_s=args.single_window)
        results["single"][pol] = r
        print(f"  resnet18 {pol:8s} {r['rps']:6.1f} req/s  goodput {r['goodput_rps']:6.1f}  "
              f"= {figure(r)}  p99 {r['p99_ms']:.0f} ms; worker busy "
              f"{100 * r['worker_busy']:.1f}%, avg batch {r['avg_batch']:.1f}, CPU per "
              f"request: server {r['server_cpu_ms']:.2f} ms, clients "
              f"{r['client_cpu_ms']:.2f} ms", flush=True)
    # Not a target, only the per-request overhead: a third of the rounds will do.
    tiny = bench_single(ROOT / "configs/bench-single-tiny_cnn-shared.yaml", "tiny_cnn",
                        outdir, cores=cores, batches=contenders(ceil["tiny_cnn"]),
                        rounds=max(3, args.single_rounds // 3), window_s=args.single_window)
    tiny["ratio_to_ceiling"] = tiny["rps_ratio_to_ceiling"]
    tiny["server_us_per_request"] = 1e6 / tiny["rps"] - 1e6 / tiny["ceiling_items_s"]
    results["overhead_tiny_cnn"] = tiny
    results["elapsed_s"] = time.monotonic() - t_all
    results["load_average_end"] = os.getloadavg()

    print(report(results))
    (outdir / "bench.json").write_text(json.dumps(results, indent=1, default=float))
    plot(results, ROOT / args.plot)
    print(f"\nwrote {outdir / 'bench.json'} and {args.plot}; "
          f"{results['elapsed_s']:.0f} s; load average at end {results['load_average_end']}")
    return 0



def report(r: dict[str, Any]) -> str:
    lines = []
    mix = r["mix"]
    base = mix.get("temporal")
    ref_scale = 1.0
    lines.append("\nTwo-model mix (mobilenet_v3_small SLO 60 ms + resnet18 SLO 250 ms), "
                 f"at x{ref_scale:g} the configured rates:")
    head = (f"{'policy':9s} {'offered':>8s} {'goodput':>8s} {'attain':>7s} {'p99 mnv3':>9s} "
            f"{'p99 r18':>8s} {'vs temporal':>11s} {'vs ceiling':>10s} {'max rate@99%':>12s} "
            f"{'RSS server/workers MB':>22s}")
    lines += [head, "-" * len(head)]
    ceil = r["ceiling"]
    for pol, res in mix.items():
        p = next((q for q in res["points"] if q["scale"] == ref_scale), res["points"][0])
        # The mix's ceiling: the fluid share of the device each model needs at its best
        # batch; goodput can't exceed offered, nor the rate that fills the whole device.
        need = sum(v["sent"] / res["seconds"] / ceil[m]["items_s"]
                   for m, v in p["per_model"].items())
        ceiling_rps = p["offered_rps"] / max(1.0, need)
        tb = next((q for q in base["points"] if q["scale"] == p["scale"]), None) if base else None
        vs_t = p["goodput_rps"] / tb["goodput_rps"] if tb and tb["goodput_rps"] else float("nan")
        pm = p["per_model"]
        rss = res["rss_mb"]
        workers = "/".join(f"{v:.0f}" for k, v in rss.items() if k != "server")
        lines.append(
            f"{pol:9s} {p['offered_rps']:8.1f} {p['goodput_rps']:8.1f} "
            f"{100 * p['attainment']:6.1f}% {pm['mobilenet_v3_small']['p99_ms']:7.0f}ms "
            f"{pm['resnet18']['p99_ms']:6.0f}ms {vs_t:11.2f} "
            f"{p['goodput_rps'] / ceiling_rps:10.2f} {res['max_sustainable_rps']:10.1f}/s "
            f"{rss['server']:>10.0f}/{workers}")
    lines.append("\nSingle model resnet18, 8 tritonclient clients, against the in-process "
                 "ceiling (its best batch size) in alternating windows (means over the "
                 "windows):")
    for pol, s in r["single"].items():
        lines.append(f"  {pol:9s} {s['goodput_rps']:6.1f} rps within SLO, ceiling "
                     f"{s['ceiling_items_s']:.1f} (b{s['best_batch']}); ratio "
                     f"{figure(s)} (target 95%), p99 {s['p99_ms']:.0f} ms; "
                     f"worker busy {100 * s['worker_busy']:.1f}%, CPU per request: server "
                     f"{s['server_cpu_ms']:.2f} ms, clients {s['client_cpu_ms']:.2f} ms")
    t = r["overhead_tiny_cnn"]
    lines.append(f"\nServer overhead, tiny_cnn (shared, 8 clients): {t['rps']:.0f} req/s vs "
                 f"in-process {t['ceiling_items_s']:.0f} items/s "
                 f"({100 * t['ratio_to_ceiling']:.1f}%): about "
                 f"{t['server_us_per_request']:.0f} us of HTTP + decode + dispatch per request")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
