"""`make bench`: the four policies side by side on this machine, against the limit.

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
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from server import codec

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("temporal", "shared", "spatial", "dstack")
DSTACK = Path(sys.executable).with_name("dstack")


# --------------------------------------------------------------------------- ceiling

_CEILING_CHILD = r"""
from dstack.heap import keep_heap
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
    """The model called directly in one child process, pinned to `cores` with as many
    torch threads as the server's worker gets: `items_s(b, seconds)` measures items/s at
    batch b on demand, so the ceiling can be taken right beside each server window."""

    def __init__(self, model: str, cores: list[int]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CEILING_CHILD, model, json.dumps(cores)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            self.close()
            raise RuntimeError(f"in-process child for {model} failed to start")

    def items_s(self, batch: int, seconds: float, warmup_s: float = 0.25) -> float:
        """Items/s at `batch` over `seconds`, after at least one batch and `warmup_s` of
        batches not counted (the same warm-up the server's windows get)."""
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


# --------------------------------------------------------------------------- server


@dataclass
class Server:
    host: str
    pid: int
    log: Path
    worker_pids: dict[str, int] = field(default_factory=dict)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serving(config: Path, log: Path, ready_timeout_s: float = 180) -> Iterator[Server]:
    """A `dstack serve` subprocess on 127.0.0.1, ready; stopped by PID on every path."""
    port = _free_port()
    host = f"http://127.0.0.1:{port}"
    with log.open("w") as lf:
        proc = subprocess.Popen(
            [str(DSTACK), "serve", "--config", str(config), "--host", "127.0.0.1",
             "--port", str(port)], stdout=lf, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited ({proc.returncode}):\n{log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready in {ready_timeout_s:g} s")
            try:
                with urllib.request.urlopen(host + "/v2/health/ready", timeout=2):
                    break
            except OSError:
                time.sleep(0.3)
        srv = Server(host, proc.pid, log)
        for m, pid in re.findall(r"worker (\S+) ready \(pid (\d+)", log.read_text()):
            srv.worker_pids[m] = int(pid)
        yield srv
    finally:
        interrupt(proc, 20)


def interrupt(proc: subprocess.Popen[Any], grace_s: float) -> None:
    """Ctrl-C for a server we started (it stops its own children), killed by PID if it
    has not exited after `grace_s`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def peak_rss_mb(srv: Server) -> dict[str, float]:
    """Peak RSS (MB) of the server and each worker since they started: the kernel's
    high-water mark, read once while they still run. (Sampling the process tree on a
    thread instead cost the measuring process ~0.2 ms of CPU per request, on the very
    cores being measured.) NaN where /proc is not there (not Linux)."""
    out = {"server": _peak_rss_mb(srv.pid)}
    for m, pid in srv.worker_pids.items():
        out[f"worker {m}"] = _peak_rss_mb(pid)
    return out


def _peak_rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return float("nan")


# --------------------------------------------------------------------------- load


def one_item_body(model_meta: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    t = model_meta["inputs"][0]
    x = np.random.default_rng(0).random([1, *t["shape"][1:]], dtype=np.float32)
    body, hlen = codec.encode_request({t["name"]: x})
    return body, {"Content-Type": "application/octet-stream", codec.HEADER_LENGTH: str(hlen)}


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


@dataclass
class Outcome:
    latencies_ms: list[float] = field(default_factory=list)  # answered (200)
    ok: int = 0  # answered within the SLO
    late: int = 0
    refused: int = 0
    error: int = 0
    lag_ms: float = 0.0  # worst generator lag behind the Poisson schedule

    @property
    def sent(self) -> int:
        return self.ok + self.late + self.refused + self.error


async def open_loop(host: str, rates: dict[str, float], slos_ms: dict[str, float],
                    duration_s: float, seed: int = 1, max_inflight: int = 512
                    ) -> dict[str, Outcome]:
    """Poisson arrivals per model at `rates` for `duration_s`, bounded in count and in
    flight; latency from the send to the full response."""
    import aiohttp

    rng = np.random.default_rng(seed)
    metas = {m: _get_json(f"{host}/v2/models/{m}") for m in rates}
    bodies = {m: one_item_body(metas[m]) for m in rates}
    out = {m: Outcome() for m in rates}
    sem = asyncio.Semaphore(max_inflight)
    conn = aiohttp.TCPConnector(limit=max_inflight, force_close=False)
    timeout = aiohttp.ClientTimeout(total=max(10.0, 5 * max(slos_ms.values()) / 1000))
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as http:

        async def one(m: str, at: float, t_start: float) -> None:
            o = out[m]
            async with sem:
                t0 = time.perf_counter()
                o.lag_ms = max(o.lag_ms, (t0 - t_start - at) * 1000)
                try:
                    body, headers = bodies[m]
                    async with http.post(f"{host}/v2/models/{m}/infer", data=body,
                                         headers=headers) as r:
                        await r.read()
                        status = r.status
                except (aiohttp.ClientError, TimeoutError):
                    o.error += 1
                    return
                ms = (time.perf_counter() - t0) * 1000
                if status in (429, 503):
                    o.refused += 1
                elif status != 200:
                    o.error += 1
                else:
                    o.latencies_ms.append(ms)
                    if ms <= slos_ms[m]:
                        o.ok += 1
                    else:
                        o.late += 1

        arrivals = []
        for m, rate in rates.items():
            n = int(rate * duration_s * 2) + 10
            times = np.cumsum(rng.exponential(1 / rate, n))
            arrivals += [(float(t), m) for t in times[times < duration_s]]
        arrivals.sort()
        t_start = time.perf_counter()
        tasks = []
        for at, m in arrivals:
            delay = t_start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(m, at, t_start)))
        await asyncio.gather(*tasks)
    return out


class TritonClients:
    """`n` tritonclient aio clients (one each) for `model`, kept connected across windows;
    `window()` runs them in a closed loop."""

    def __init__(self, host: str, model: str, n: int) -> None:
        import tritonclient.http.aio as aio
        from tritonclient.http import InferInput

        meta = _get_json(f"{host}/v2/models/{model}")
        t = meta["inputs"][0]
        x = np.random.default_rng(0).random([1, *t["shape"][1:]], dtype=np.float32)
        self.model = model
        self.clients = [aio.InferenceServerClient(host.removeprefix("http://"))
                        for _ in range(n)]
        self.inp = InferInput(t["name"], list(x.shape), "FP32")
        self.inp.set_data_from_numpy(x, binary_data=True)

    async def window(self, duration_s: float, slo_ms: float, warmup_s: float = 0.0
                     ) -> tuple[float, float, float, int]:
        """(req/s, goodput within the SLO, p99 ms, requests refused) in steady state:
        each client's requests started after the first `warmup_s` (the first batches
        forming after a pause; perf_analyzer likewise measures steady state) and answered
        within the next `duration_s`, over the time from the first one's start to the last
        one's answer. A closed-loop client's rate is one request per cycle, so this is
        exact; counting the answers inside a fixed window instead is off by up to a whole
        batch (the answers come in batches, in a phase that repeats from window to
        window)."""
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


# --------------------------------------------------------------------------- bench


def _stats(host: str, model: str) -> dict[str, int]:
    s = _get_json(f"{host}/v2/models/{model}/stats")["model_stats"][0]
    return {"inference_count": s["inference_count"], "execution_count": s["execution_count"],
            "compute_ns": s["inference_stats"]["compute_infer"]["ns"]}


def _cpu(p: Any) -> float:
    t = p.cpu_times()
    return float(t.user + t.system)


def _p99(o: Outcome) -> float:
    return float(np.percentile(o.latencies_ms, 99)) if o.latencies_ms else float("nan")


def _models_of(config: Path) -> list[dict[str, Any]]:
    return yaml.safe_load(config.read_text())["models"]


def bench_mix(policy: str, scales: list[float], seconds: float, outdir: Path) -> dict[str, Any]:
    config = ROOT / f"configs/bench-mix-{policy}.yaml"
    models = _models_of(config)
    base = {m["name"]: float(m["rate_rps"]) for m in models}
    slos = {m["name"]: float(m["slo_ms"]) for m in models}
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
                                  "p99_ms": _p99(o), "lag_ms": o.lag_ms}
                              for m, o in res.items()},
            })
            print(f"  {policy:8s} x{s:<4g} offered {sum(rates.values()):6.1f} rps  goodput "
                  f"{ok / seconds:6.1f}  attainment {100 * points[-1]['attainment']:5.1f}%  "
                  + "  ".join(f"{m} p99 {_p99(o):.0f} ms" for m, o in res.items()), flush=True)
        rss = peak_rss_mb(srv)
    sustainable = max((p["offered_rps"] for p in points
                       if all(v["attainment"] >= 0.99 for v in p["per_model"].values())),
                      default=0.0)
    return {"points": points, "max_sustainable_rps": sustainable, "rss_mb": rss,
            "seconds": seconds}


def ceiling_ratio(goodput: list[float], ceiling: list[float], batch: list[int], *,
                  resamples: int = 2000, seed: int = 0) -> dict[str, Any]:
    """The single-model figure from alternating windows: round i measured the server's
    goodput `goodput[i]` and, beside it, the in-process items/s `ceiling[i]` at batch
    `batch[i]`. The ceiling is the best batch size's mean; the ratio is the mean goodput
    over it. `ci95` is a bootstrap over the rounds (the best batch re-chosen in each
    resample). Taking the best of several noisy means reads the ceiling a little high when
    batch sizes are alike: the error is against the server, never for it."""
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


def bench_single(config: Path, model: str, outdir: Path, *, cores: list[int],
                 batches: list[int], clients: int = 8, rounds: int = 36,
                 window_s: float = 1.0, warmup_s: float = 0.25) -> dict[str, Any]:
    """`clients` tritonclient clients against the server, in `rounds` windows that
    alternate with windows of the model in process (while the server idles), whose batch
    size goes round `batches`: this machine's speed drifts from second to second by more
    than the gap being measured, and which batch size is best in process is itself within
    that noise, so both are measured beside the server's windows all through the run (see
    `ceiling_ratio`)."""
    slo = float(_models_of(config)[0]["slo_ms"])

    async def measure(srv: Server, direct: InProcess) -> list[dict[str, float]]:
        import psutil

        server, me = psutil.Process(srv.pid), psutil.Process()
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
                s0, c0, m0, t0 = _stats(srv.host, model), _cpu(server), _cpu(me), time.time()
                rps, good, p99, refused = await tc.window(window_s, slo, warmup_s)
                s1, c1, m1, t1 = _stats(srv.host, model), _cpu(server), _cpu(me), time.time()
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

    # All windows have the same length, so means of the rates are rates over all windows.
    def mean(key: str) -> float:
        return float(np.mean([r[key] for r in per_round]))

    def col(key: str) -> list[float]:
        return [r[key] for r in per_round]

    fig = ceiling_ratio(col("goodput_rps"), col("ceiling_items_s"), col("batch"))
    return {"rps": mean("rps"), "goodput_rps": mean("goodput_rps"),
            # A window can answer nothing: when the machine slows down so far that no
            # request both starts after the warm-up and ends inside it (seen with other work
            # running). It counts as zero goodput; `refused` tells a refusal from that.
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
    ap = argparse.ArgumentParser(prog="loadtests.bench", description=__doc__,
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
                         outdir, cores=cores, batches=_contenders(ceil["resnet18"]),
                         rounds=args.single_rounds, window_s=args.single_window)
        results["single"][pol] = r
        print(f"  resnet18 {pol:8s} {r['rps']:6.1f} req/s  goodput {r['goodput_rps']:6.1f}  "
              f"= {_figure(r)}  p99 {r['p99_ms']:.0f} ms; worker busy "
              f"{100 * r['worker_busy']:.1f}%, avg batch {r['avg_batch']:.1f}, CPU per "
              f"request: server {r['server_cpu_ms']:.2f} ms, clients "
              f"{r['client_cpu_ms']:.2f} ms", flush=True)
    # Not a target, only the per-request overhead: a third of the rounds will do.
    tiny = bench_single(ROOT / "configs/bench-single-tiny_cnn-shared.yaml", "tiny_cnn",
                        outdir, cores=cores, batches=_contenders(ceil["tiny_cnn"]),
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


def _contenders(ceil: dict[str, Any]) -> list[int]:
    """The batch sizes worth measuring beside the server: within 20% of the best in the
    opening bursts (a window's noise here is ~8%; b1 of resnet18 is ~25% behind)."""
    per_b = ceil["per_batch"]
    return [b for b, v in per_b.items() if v >= 0.8 * ceil["items_s"]]


def _figure(s: dict[str, Any]) -> str:
    lo, hi = s["ci95"]
    per_b = ", ".join(f"b{b} {v:.1f}" for b, v in s["per_batch"].items())
    return (f"{100 * s['ratio_to_ceiling']:5.1f}% of the ceiling beside it (95% CI "
            f"{100 * lo:.1f}-{100 * hi:.1f}%; in process: {per_b} items/s)")


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
                     f"{_figure(s)} (target 95%), p99 {s['p99_ms']:.0f} ms; "
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
