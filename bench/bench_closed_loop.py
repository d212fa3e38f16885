"""`make bench-closed-loop` (`python -m bench.bench_closed_loop`): the four policies under
closed-loop clients (issue 15): a real server per policy (the bench mix fitted to this
machine) and `--clients` tritonclient.http clients per model, one process each
(`bench.closed_loop`), for `--duration` seconds. A table of outcomes per policy, a summary,
and every number in `out/bench/closed_loop.json` (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from bench.bench_triton import triton_serving
from bench.closed_loop import REFUSAL_PAUSE_S, TIMEOUT_S, Counts, Target, closed_loop
from bench.fitted import fitted_config, one_core_capacity
from bench.servers import ROOT, models_of, peak_rss_mb, serving

POLICIES = ("temporal", "shared", "spatial", "dstack")


#: The reference that is no policy of ours: `shared` with no SLO at the server (it queues
#: whatever comes and refuses nothing, as Triton's dynamic batching does); its answers are
#: judged against the mix's SLOs all the same.
QUEUEING = "queueing"
#: The SLO the queueing server is given: none that a request could reach.
NO_SLO_MS = 600_000.0
#: Triton itself (`--triton-python`): PyTriton serving the mix's models with its batch
#: limits and queue delays (`bench.bench_triton`), judged by the same SLOs.
TRITON = "triton"


def mix_config(policy: str, outdir: Path, settings: Sequence[str] = ()
               ) -> tuple[Path, dict[str, float]]:
    """`configs/bench-mix-<policy>.yaml` fitted to this machine (`bench.fitted`), with
    `settings` (`key.sub=YAML value`) applied, and the SLOs (ms) its answers are judged by."""
    reference = policy in (QUEUEING, TRITON)
    base = ROOT / f"configs/bench-mix-{'shared' if reference else policy}.yaml"
    config, _ = fitted_config(base, outdir)
    slos = {m["name"]: float(m["slo_ms"]) for m in models_of(config)}
    if not reference and not settings:
        return config, slos
    raw = yaml.safe_load(config.read_text())
    if reference:
        for m in raw["models"]:
            m["slo_ms"] = NO_SLO_MS
    for setting in settings:
        key, _, value = setting.partition("=")
        *parents, leaf = key.split(".")
        node = raw
        for k in parents:
            node = node.setdefault(k, {})
        node[leaf] = yaml.safe_load(value)
    config = outdir / f"bench-mix-{policy}-fitted-set.yaml"
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    return config, slos


def run_policy(policy: str, outdir: Path, *, clients: int, duration_s: float,
               timeout_s: float = TIMEOUT_S, refusal_pause_s: float = REFUSAL_PAUSE_S,
               settings: Sequence[str] = (), triton_python: str = ""
               ) -> tuple[dict[str, Counts], dict[str, float]]:
    """Serve the bench mix under `policy` (`mix_config`; `TRITON`: PyTriton under
    `triton_python`) and run the closed loop against it: the outcomes per model, and the
    peak RSS (MB) of the server and its workers (none for Triton)."""
    config, slos = mix_config(policy, outdir, settings)
    log = outdir / f"server-closed-loop-{policy}.log"
    if policy == TRITON:
        with triton_serving(triton_python, config, log) as triton:
            targets = [Target.from_server(triton.host, m, slo) for m, slo in slos.items()]
            return closed_loop(triton.host, targets, clients, duration_s, timeout_s=timeout_s,
                               refusal_pause_s=refusal_pause_s), {}
    with serving(config, log) as srv:
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
             "(the bench mix, fitted to this machine)", head, "-" * len(head)]
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
    lines = []
    for clients, runs in results["runs"].items():
        lines += [f"\nSummary, {clients} clients per model (closed loop, goodput = answers "
                  "within the model's SLO per second):", head, "-" * len(head)]
        goodput: dict[str, float] = {}
        for pol, r in runs.items():
            if "error" in r:
                lines.append(f"{pol:9s} did not run: {r['error']}")
                continue
            models = r["models"]
            sent = sum(v["sent"] for v in models.values())
            refused = sum(v["refused_429"] for v in models.values())
            per_model = ", ".join(f"{m} {v['goodput_rps']:.1f}" for m, v in models.items())
            other = sum(sum(v["other_4xx"].values()) + v["connection_errors"]
                        + v["client_errors"] for v in models.values())
            goodput[pol] = sum(v["goodput_rps"] for v in models.values())
            lines.append(
                f"{pol:9s} {goodput[pol]:22.1f} "
                f"{100 * refused / sent if sent else 0.0:9.1f} "
                f"{sum(sum(v['5xx'].values()) for v in models.values()):4d} "
                f"{sum(v['timeouts'] for v in models.values()):5d} "
                f"{other:12d}"
                f"  {per_model}")
        lines += ratios(goodput, results.get("capacity_rps"))
        reach = results.get("capacity_by_clients_rps", {}).get(str(clients))
        if reach and "dstack" in goodput:
            lines.append(f"dstack / in-process capacity within SLO in batches of at most "
                         f"{clients}, all {clients} clients can fill ({reach:.1f} rps): "
                         f"{goodput['dstack'] / reach:.2f}")
    return "\n".join(lines)


def ratios(goodput: dict[str, float], capacity: float | None) -> list[str]:
    """dstack's goodput against the best other policy, the queueing reference and the
    machine's in-process capacity, where they ran."""
    if "dstack" not in goodput:
        return []
    d = goodput["dstack"]
    others = {p: g for p, g in goodput.items() if p not in ("dstack", QUEUEING, TRITON)}
    out = []
    if others:
        best = max(others, key=others.__getitem__)
        out.append(f"dstack / best other policy ({best}): "
                   f"{d / others[best] if others[best] else float('inf'):.2f}")
    if goodput.get(QUEUEING) is not None:
        q = goodput[QUEUEING]
        out.append(f"dstack / queueing (no SLO at the server): {d / q if q else float('inf'):.2f}")
    if goodput.get(TRITON) is not None:
        t = goodput[TRITON]
        out.append(f"dstack / triton (PyTriton's tritonserver): {d / t if t else float('inf'):.2f}")
    if capacity:
        out.append(f"dstack / in-process capacity within SLO ({capacity:.1f} rps): "
                   f"{d / capacity:.2f}")
    return out


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
    ap.add_argument("--clients", type=lambda v: [int(x) for x in v.split(",")], default=[2],
                    help="clients per model; several (2,8) run one after another")
    ap.add_argument("--refusal-pause", type=_milliseconds, default=REFUSAL_PAUSE_S,
                    help="how long a refused client waits before it sends again "
                         f"(default {1000 * REFUSAL_PAUSE_S:g}ms; 0 sends again at once)")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help=f"comma-separated; `{QUEUEING}` is shared with no SLO at the server "
                         "(Triton's behaviour), judged by the same SLOs")
    ap.add_argument("--capacity", action="store_true",
                    help="measure each model's in-process capacity within its SLO on one core "
                         "and print dstack's goodput against their sum")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config setting for every server, e.g. server.hold_refusals=false "
                         "or profile_margin=null (repeatable)")
    ap.add_argument("--triton-python", default="", metavar="PYTHON",
                    help=f"add `{TRITON}`: Triton serving the mix (PyTriton under this Python, "
                         "as set up by `make bench-triton`), judged by the same SLOs")
    ap.add_argument("--out", default="out/bench")
    args = ap.parse_args(argv)
    outdir = ROOT / args.out
    outdir.mkdir(parents=True, exist_ok=True)
    policies = [p for p in args.policies.split(",") if p]
    if args.triton_python and TRITON not in policies:
        policies.append(TRITON)
    t_all = time.monotonic()
    results: dict[str, Any] = {
        "duration_s": args.duration, "clients_per_model": args.clients,
        "timeout_s": TIMEOUT_S, "refusal_pause_s": args.refusal_pause,
        "settings": args.set, "cores": sorted(os.sched_getaffinity(0)),
        "load_average_start": os.getloadavg(), "runs": {}}
    if args.capacity:
        _, slos = mix_config("dstack", outdir)
        cap = one_core_capacity(slos)
        results["capacity_by_model_rps"] = cap
        results["capacity_rps"] = sum(cap.values())
        print("in-process capacity within SLO, one core each (items/s): "
              + ", ".join(f"{m} {c:.1f}" for m, c in cap.items()), flush=True)
        # c closed-loop clients of a model never have more than c requests out: batches
        # of at most c, whatever the server does
        results["capacity_by_clients_rps"] = {
            str(c): sum(one_core_capacity(slos, max_batch=c).values())
            for c in args.clients if c < 8}
    failed = False
    for clients in args.clients:
        runs = results["runs"][clients] = {}
        for pol in policies:
            try:
                counts, rss = run_policy(pol, outdir, clients=clients,
                                         duration_s=args.duration,
                                         refusal_pause_s=args.refusal_pause,
                                         settings=args.set,
                                         triton_python=args.triton_python)
            except RuntimeError as e:
                failed = True
                runs[pol] = {"error": str(e)[-2000:]}
                print(f"\n{pol}: did not run: {str(e)[-2000:]}", flush=True)
                continue
            _, slos = mix_config(pol, outdir)
            print(table(pol, counts, slos, clients, args.duration), flush=True)
            runs[pol] = {
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
