"""`make bench-closed-loop` (`python -m bench.bench_closed_loop`): the four policies under
closed-loop clients (issue 15).

For each policy a real server (`configs/bench-mix-<policy>.yaml`: mobilenet_v3_small SLO
60 ms + resnet18 SLO 250 ms on CPU; a `dstack serve` subprocess on a free 127.0.0.1
port, polled on `/v2/health/ready`, stopped by PID on every path) and, once it is ready,
`--clients` tritonclient.http clients per model, one process each, in a closed loop (each
sends its next one-item request, random float32 of the model's input shape, as soon as
the last one is answered, or `--refusal-pause` after a 429) for `--duration` seconds.
Per model: answered within the SLO (latency measured by the client), answered late,
refused with 429 by the `reason` in the server's body, other 4xx, 5xx, hangs (no answer
within the `--timeout` of the client), connection and client errors. A table per policy,
a summary (goodput within SLO, refused %, 5xx, hangs), and every number in
`out/bench/closed_loop.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench.closed_loop import REFUSAL_PAUSE_S, TIMEOUT_S, Counts, Target, closed_loop
from bench.servers import ROOT, models_of, peak_rss_mb, serving

POLICIES = ("temporal", "shared", "spatial", "dstack")


def run_policy(policy: str, outdir: Path, *, clients: int, duration_s: float,
               timeout_s: float = TIMEOUT_S, refusal_pause_s: float = REFUSAL_PAUSE_S
               ) -> tuple[dict[str, Counts], dict[str, float]]:
    """Serve `configs/bench-mix-<policy>.yaml` and run the closed loop against it: the
    outcomes per model, and the peak RSS (MB) of the server and its workers."""
    config = ROOT / f"configs/bench-mix-{policy}.yaml"
    slos = {m["name"]: float(m["slo_ms"]) for m in models_of(config)}
    with serving(config, outdir / f"server-closed-loop-{policy}.log") as srv:
        targets = [Target.from_server(srv.host, m, slo) for m, slo in slos.items()]
        counts = closed_loop(srv.host, targets, clients, duration_s, timeout_s=timeout_s,
                             refusal_pause_s=refusal_pause_s)
        rss = peak_rss_mb(srv)
    return counts, rss


def goodput_rps(c: Counts) -> float:
    return c.within_slo / c.elapsed_s if c.elapsed_s else 0.0


def table(policy: str, counts: dict[str, Counts], slos: dict[str, float], clients: int,
          duration_s: float) -> str:
    head = (f"{'model':20s} {'SLO ms':>6s} {'sent':>6s} {'in SLO':>6s} {'late':>5s} "
            f"{'429':>5s} {'4xx':>4s} {'5xx':>4s} {'hangs':>5s} {'conn':>4s} "
            f"{'goodput/s':>9s} {'p50 ms':>7s} {'p99 ms':>7s}  429 by reason")
    lines = [f"\n{policy}: {clients} clients per model, closed loop, {duration_s:g} s "
             f"(configs/bench-mix-{policy}.yaml)", head, "-" * len(head)]
    for m, c in counts.items():
        j = c.to_json()
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(c.refused.items())) or "-"
        p50 = f"{j['p50_ms']:7.0f}" if j["p50_ms"] is not None else f"{'-':>7s}"
        p99 = f"{j['p99_ms']:7.0f}" if j["p99_ms"] is not None else f"{'-':>7s}"
        lines.append(
            f"{m:20s} {slos[m]:6.0f} {c.sent:6d} {c.within_slo:6d} {c.late:5d} "
            f"{sum(c.refused.values()):5d} {sum(c.other_4xx.values()):4d} "
            f"{sum(c.server_5xx.values()):4d} {c.timeouts:5d} "
            f"{c.connection_errors + c.client_errors:4d} {goodput_rps(c):9.1f} {p50} {p99}"
            f"  {reasons}")
    return "\n".join(lines)


def summary(results: dict[str, Any]) -> str:
    head = (f"{'policy':9s} {'goodput within SLO rps':>22s} {'refused %':>9s} {'5xx':>4s} "
            f"{'hangs':>5s} {'other errors':>12s}  per model goodput rps")
    lines = ["\nSummary (closed loop, goodput = answers within the model's SLO per second):",
             head, "-" * len(head)]
    for pol, r in results["policies"].items():
        if "error" in r:
            lines.append(f"{pol:9s} did not run: {r['error']}")
            continue
        models = r["models"]
        sent = sum(v["sent"] for v in models.values())
        refused = sum(v["refused_429"] for v in models.values())
        per_model = ", ".join(f"{m} {v['goodput_rps']:.1f}" for m, v in models.items())
        other = sum(sum(v["other_4xx"].values()) + v["connection_errors"] + v["client_errors"]
                    for v in models.values())
        lines.append(
            f"{pol:9s} {sum(v['goodput_rps'] for v in models.values()):22.1f} "
            f"{100 * refused / sent if sent else 0.0:9.1f} "
            f"{sum(sum(v['5xx'].values()) for v in models.values()):4d} "
            f"{sum(v['timeouts'] for v in models.values()):5d} "
            f"{other:12d}"
            f"  {per_model}")
    return "\n".join(lines)


def _seconds(text: str) -> float:
    return float(text.removesuffix("s"))


def _milliseconds(text: str) -> float:
    """Seconds from "5ms" or "5" (milliseconds, not negative)."""
    ms = float(text.removesuffix("ms"))
    if ms < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return ms / 1000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.bench_closed_loop", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=_seconds, default=10.0,
                    help="seconds of closed loop per policy (10 or 10s)")
    ap.add_argument("--clients", type=int, default=2, help="clients per model")
    ap.add_argument("--timeout", type=_seconds, default=TIMEOUT_S,
                    help="a request not answered in this many seconds is a hang")
    ap.add_argument("--refusal-pause", type=_milliseconds, default=REFUSAL_PAUSE_S,
                    help="how long a refused client waits before it sends again "
                         f"(default {1000 * REFUSAL_PAUSE_S:g}ms; 0 sends again at once)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--out", default="out/bench")
    args = ap.parse_args(argv)
    outdir = ROOT / args.out
    outdir.mkdir(parents=True, exist_ok=True)
    policies = [p for p in args.policies.split(",") if p]
    t_all = time.monotonic()
    results: dict[str, Any] = {
        "duration_s": args.duration, "clients_per_model": args.clients,
        "timeout_s": args.timeout, "refusal_pause_s": args.refusal_pause,
        "cores": sorted(os.sched_getaffinity(0)),
        "load_average_start": os.getloadavg(), "policies": {}}
    failed = False
    for pol in policies:
        slos = {m["name"]: float(m["slo_ms"])
                for m in models_of(ROOT / f"configs/bench-mix-{pol}.yaml")}
        try:
            counts, rss = run_policy(pol, outdir, clients=args.clients, duration_s=args.duration,
                                     timeout_s=args.timeout,
                                     refusal_pause_s=args.refusal_pause)
        except RuntimeError as e:
            failed = True
            results["policies"][pol] = {"error": str(e)[-2000:]}
            print(f"\n{pol}: did not run: {str(e)[-2000:]}", flush=True)
            continue
        print(table(pol, counts, slos, args.clients, args.duration), flush=True)
        results["policies"][pol] = {
            "config": f"configs/bench-mix-{pol}.yaml",
            "rss_mb": rss,
            "models": {m: {"slo_ms": slos[m], "goodput_rps": goodput_rps(c), **c.to_json()}
                       for m, c in counts.items()}}
    results["elapsed_s"] = time.monotonic() - t_all
    results["load_average_end"] = os.getloadavg()
    print(summary(results))
    path = outdir / "closed_loop.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {os.path.relpath(path)}; {results['elapsed_s']:.0f} s; load average "
          f"at start {results['load_average_start']}, at end {results['load_average_end']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
