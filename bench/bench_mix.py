"""`make bench` (`python -m bench.bench_mix`): the four policies side by side on this
machine, against the model called in process on the same cores: the two-model mix under
open-loop Poisson load (goodput, attainment, p99, the maximum sustainable rate), resnet18
alone under 8 tritonclient clients in windows alternating with the in-process ones, the
server overhead on tiny_cnn, and peak RSS (docs/benchmarks.md says what each figure is).
Every config is fitted to this machine (bench/fitted.py).
Output: a table, `docs/benchmarks.png` and `out/bench/bench.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.chaos_load import open_loop, p99
from bench.fitted import fitted_config
from bench.servers import (
    ROOT,
    Server,
    cpu_s,
    get_json,
    model_stats,
    models_of,
    peak_rss_mb,
    rates_slos,
    serving,
)

POLICIES = ("temporal", "shared", "spatial", "dstack")

# ------------------------------------------------------------------ the in-process ceiling

_CEILING_CHILD = r"""
from dstack.common.heap import keep_heap
keep_heap()  # allocate as the server's workers do
import json, os, sys, time, torch, models
cores = json.loads(sys.argv[2])
os.sched_setaffinity(0, set(cores)); torch.set_num_threads(len(cores))
m = models.load_model(sys.argv[1]); spec = models.spec(sys.argv[1])
shape = spec.inputs[0].shape[1:]
print("ready", flush=True)
with torch.inference_mode():
    for line in sys.stdin:
        b, seconds, warmup = int(line.split()[0]), float(line.split()[1]), float(line.split()[2])
        x = torch.rand(b, *shape)
        t0 = time.perf_counter()
        m(x)
        while time.perf_counter() - t0 < warmup: m(x)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            m(x); n += b
        print(n / (time.perf_counter() - t0), flush=True)
"""


class InProcess:
    """The model called directly in a child process pinned to `cores`, as many torch
    threads as a worker gets; `items_s` measures on demand, beside each server window."""

    def __init__(self, model: str, cores: list[int]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CEILING_CHILD, model, json.dumps(cores)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            self.close()
            raise RuntimeError(f"in-process child for {model} failed to start")

    def items_s(self, batch: int, seconds: float, warmup_s: float = 0.25) -> float:
        """Items/s at `batch` over `seconds`, after one batch and `warmup_s` not counted."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{batch} {seconds} {warmup_s}\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def __enter__(self) -> InProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def ceiling_ratio(goodput: list[float], ceiling: list[float], batch: list[int], *,
                  resamples: int = 2000, seed: int = 0) -> dict[str, Any]:
    """The single-model figure: round i measured the server's goodput `goodput[i]` and,
    beside it, the in-process items/s `ceiling[i]` at batch `batch[i]`. The ceiling is the
    best batch size's mean, the ratio the mean goodput over it, `ci95` a bootstrap over the
    rounds (the best batch re-chosen in each resample)."""
    g, c, b = np.asarray(goodput, float), np.asarray(ceiling, float), np.asarray(batch)
    if not (len(g) == len(c) == len(b)) or not len(g):
        raise ValueError("goodput, ceiling and batch need one entry per round")
    sizes = sorted(set(b.tolist()))

    def best(idx: np.ndarray) -> tuple[int, float]:
        means = {s: c[idx][b[idx] == s].mean() for s in sizes if (b[idx] == s).any()}
        top = max(means, key=means.__getitem__)
        return top, float(means[top])

    all_rounds = np.arange(len(g))
    top, ceil = best(all_rounds)
    rng = np.random.default_rng(seed)
    ratios = []
    for _ in range(resamples):
        idx = rng.integers(0, len(g), len(g))
        ratios.append(g[idx].mean() / best(idx)[1])
    return {"per_batch": {int(s): float(c[b == s].mean()) for s in sizes},
            "best_batch": int(top), "ceiling_items_s": ceil,
            "ratio_to_ceiling": float(g.mean() / ceil),
            "ci95": [float(q) for q in np.percentile(ratios, [2.5, 97.5])]}


def contenders(ceil: dict[str, Any]) -> list[int]:
    """The batch sizes worth measuring beside the server: within 20% of the best in the
    opening bursts (a window's noise here is ~8%)."""
    per_b = ceil["per_batch"]
    return [b for b, v in per_b.items() if v >= 0.8 * ceil["items_s"]]


def figure(s: dict[str, Any]) -> str:
    """One line for a `ceiling_ratio` result: the ratio, its interval, the ceiling."""
    lo, hi = s["ci95"]
    per_b = ", ".join(f"b{b} {v:.1f}" for b, v in s["per_batch"].items())
    return (f"{100 * s['ratio_to_ceiling']:5.1f}% of the ceiling beside it (95% CI "
            f"{100 * lo:.1f}-{100 * hi:.1f}%; in process: {per_b} items/s)")


# ------------------------------------------------------------------ the servers


class TritonClients:
    """`n` tritonclient aio clients (one each) for `model`, kept connected across windows;
    `window()` runs them in a closed loop."""

    def __init__(self, host: str, model: str, n: int) -> None:
        import tritonclient.http.aio as aio
        from tritonclient.http import InferInput

        meta = get_json(f"{host}/v2/models/{model}")
        t = meta["inputs"][0]
        x = np.random.default_rng(0).random([1, *t["shape"][1:]], dtype=np.float32)
        self.model = model
        self.clients = [aio.InferenceServerClient(host.removeprefix("http://"))
                        for _ in range(n)]
        self.inp = InferInput(t["name"], list(x.shape), "FP32")
        self.inp.set_data_from_numpy(x, binary_data=True)

    async def window(self, duration_s: float, slo_ms: float, warmup_s: float = 0.0
                     ) -> tuple[float, float, float, int]:
        """(req/s, goodput within the SLO, p99 ms, requests refused) in steady state: each
        client's requests started after the first `warmup_s` and answered within the next
        `duration_s`, over the time from the first one's start to the last one's answer
        (answers counted in a fixed window are off by up to a whole batch)."""
        from tritonclient.utils import InferenceServerException

        lat: list[float] = []
        rps = good_rps = 0.0
        refused = 0
        begin = time.perf_counter() + warmup_s
        end = begin + duration_s

        async def loop(c: Any) -> None:
            nonlocal rps, good_rps, refused
            first = last = 0.0
            answered = ok = 0
            while True:
                t0 = time.perf_counter()
                if t0 >= end:
                    break
                try:
                    await c.infer(self.model, [self.inp])
                    done = True
                except InferenceServerException:
                    done = False  # refused (429/503): counts against goodput, not a crash
                t1 = time.perf_counter()
                if t0 < begin or t1 > end:
                    continue
                if not first:
                    first = t0
                last = t1
                refused += not done
                if done:
                    answered += 1
                    lat.append((t1 - t0) * 1000)
                    ok += lat[-1] <= slo_ms
            if last > first:
                rps += answered / (last - first)
                good_rps += ok / (last - first)

        await asyncio.gather(*(loop(c) for c in self.clients))
        p99 = float(np.percentile(lat, 99)) if lat else float("nan")
        return rps, good_rps, p99, refused

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients))


def bench_mix(policy: str, scales: list[float], seconds: float, outdir: Path) -> dict[str, Any]:
    config, factor = fitted_config(ROOT / f"configs/bench-mix-{policy}.yaml", outdir)
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
                                  "refused": o.refused.total(), "error": o.errors,
                                  "attainment": o.ok / o.sent if o.sent else 0.0,
                                  "p99_ms": p99(o)}
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
            "seconds": seconds, "machine_factor": factor, "slos_ms": slos, "rates_rps": base}


def bench_single(config: Path, model: str, outdir: Path, *, cores: list[int],
                 batches: list[int], clients: int = 8, rounds: int = 36,
                 window_s: float = 1.0, warmup_s: float = 0.25) -> dict[str, Any]:
    """`clients` tritonclient clients against the server, in `rounds` windows that
    alternate with in-process windows (the server idle) whose batch size goes round
    `batches`: the machine's speed drifts by more than the gap being measured."""
    slo = float(models_of(config)[0]["slo_ms"])

    async def measure(srv: Server, direct: InProcess) -> list[dict[str, float]]:
        pids = (srv.pid, os.getpid())  # the server, these clients
        tc = TritonClients(srv.host, model, clients)
        try:
            await tc.window(1.0, slo)  # connect and warm the HTTP path and the worker
            out = []
            for i in range(rounds):
                b = batches[i % len(batches)]
                ceil = direct.items_s(b, window_s, warmup_s)  # blocks; clients idle
                # Where the time goes, over the whole server window (warm-up included):
                # the worker's busy share (its batches' compute time from the stats) and
                # the CPU the server and the clients spend per answered request.
                s0, (c0, m0), t0 = model_stats(srv.host, model), [*map(cpu_s, pids)], time.time()
                rps, good, p99, refused = await tc.window(window_s, slo, warmup_s)
                s1, (c1, m1), t1 = model_stats(srv.host, model), [*map(cpu_s, pids)], time.time()
                n = max(1, s1["inference_count"] - s0["inference_count"])
                out.append({"batch": b, "ceiling_items_s": ceil, "rps": rps,
                            "goodput_rps": good, "p99_ms": p99, "refused": refused,
                            "worker_busy": (s1["compute_ns"] - s0["compute_ns"]) / 1e9 / (t1 - t0),
                            "avg_batch": n / max(1, s1["execution_count"] - s0["execution_count"]),
                            "server_cpu_ms": 1000 * (c1 - c0) / n,
                            "client_cpu_ms": 1000 * (m1 - m0) / n})
            return out
        finally:
            await tc.close()

    with serving(config, outdir / f"server-{config.stem}.log") as srv, \
            InProcess(model, cores) as direct:
        per_round = asyncio.run(measure(srv, direct))
        rss = peak_rss_mb(srv)

    def mean(key: str) -> float:
        return float(np.mean([r[key] for r in per_round]))

    def col(key: str) -> list[float]:
        return [r[key] for r in per_round]

    fig = ceiling_ratio(col("goodput_rps"), col("ceiling_items_s"), col("batch"))
    return {"rps": mean("rps"), "goodput_rps": mean("goodput_rps"),
            # a window that answered nothing (a slowed machine) counts as zero goodput
            "p99_ms": float(np.nanmedian(col("p99_ms"))), **fig,
            "refused": int(sum(col("refused"))),
            "windows_answering_nothing": sum(r["rps"] == 0 for r in per_round),
            "rps_ratio_to_ceiling": mean("rps") / fig["ceiling_items_s"],
            **{k: mean(k) for k in ("worker_busy", "avg_batch", "server_cpu_ms",
                                    "client_cpu_ms")},
            "rounds": per_round, "window_s": window_s, "warmup_s": warmup_s,
            "rss_mb": rss}


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
        r = bench_single(fitted_config(ROOT / f"configs/bench-single-resnet18-{pol}.yaml",
                                       outdir)[0], "resnet18",
                         outdir, cores=cores, batches=contenders(ceil["resnet18"]),
                         rounds=args.single_rounds)
        results["single"][pol] = r
        print(f"  resnet18 {pol:8s} {r['rps']:6.1f} req/s  goodput {r['goodput_rps']:6.1f}  "
              f"= {figure(r)}  p99 {r['p99_ms']:.0f} ms; worker busy "
              f"{100 * r['worker_busy']:.1f}%, avg batch {r['avg_batch']:.1f}, CPU per "
              f"request: server {r['server_cpu_ms']:.2f} ms, clients "
              f"{r['client_cpu_ms']:.2f} ms", flush=True)
    # Not a target, only the per-request overhead: a third of the rounds will do.
    tiny = bench_single(fitted_config(ROOT / "configs/bench-single-tiny_cnn-shared.yaml",
                                      outdir)[0], "tiny_cnn",
                        outdir, cores=cores, batches=contenders(ceil["tiny_cnn"]),
                        rounds=max(3, args.single_rounds // 3))
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
    first = next(iter(mix.values()))
    lines.append("\nTwo-model mix (" + " + ".join(
        f"{m} SLO {slo:g} ms at {first['rates_rps'][m]:g} rps" for m, slo in
        first["slos_ms"].items()) + f"; configs/bench-mix-*.yaml fitted to this machine, "
        f"x{first['machine_factor']:.2f}), at x{ref_scale:g} those rates:")
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
