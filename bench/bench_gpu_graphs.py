"""CUDA graphs against eager forwards, side by side on one GPU: `python -m
bench.bench_gpu_graphs [--scales 2,4,8] [--seconds 6]`.

Two `dstack serve` processes with the H100 mix (`configs/bench-mix-h100-dstack.yaml`), one
with `cuda_graphs: true` (the default), one with `cuda_graphs: false`, started one after
the other and up together; at each load (multiples of the mix's `rate_rps`), each gets an
open-loop Poisson window in turn, the same seed for both. Printed per server and load:
goodput within SLO, the worst model's share answered within SLO, p99 latency, and the
batches the workers ran (count, mean size, mean compute per batch, from the servers' own
stats); then graphs / eager per load. Needs CUDA and MPS (`bench/bench_gpu_session.sh`
step graphs starts the daemon both servers attach to).
"""

from __future__ import annotations

import argparse
import asyncio
from contextlib import ExitStack

from bench import chaos_load as cl
from bench.servers import ROOT, model_stats, rates_slos, serving, write_config

MIX = ROOT / "configs/bench-mix-h100-dstack.yaml"
OUT = ROOT / "out/gpu-graphs"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scales", type=lambda v: [float(x) for x in v.split(",")],
                   default=[2.0, 4.0, 8.0], help="loads, as multiples of the mix's rate_rps")
    p.add_argument("--seconds", type=float, default=6.0, help="per window")
    args = p.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    base, slos = rates_slos(MIX)
    good: dict[tuple[bool, float], float] = {}
    with ExitStack() as stack:
        servers = {g: stack.enter_context(serving(
            write_config(MIX, OUT / f"graphs-{str(g).lower()}.yaml", cuda_graphs=g),
            OUT / f"graphs-{g}.log")) for g in (True, False)}
        for srv in servers.values():  # warm: connections, the first batches
            asyncio.run(cl.open_loop(srv.host, {m: 5.0 for m in base}, slos, 2.0))
        for x in args.scales:
            for g, srv in servers.items():
                before = {m: model_stats(srv.host, m) for m in base}
                res = asyncio.run(cl.open_loop(srv.host, {m: r * x for m, r in base.items()},
                                               slos, args.seconds, seed=int(10 * x)))
                after = {m: model_stats(srv.host, m) for m in base}
                t = cl.total(res)
                good[g, x] = t.ok / args.seconds
                worst = min(r.ok / r.sent if r.sent else 1.0 for r in res.values())
                runs = ", ".join(
                    f"{m} {n} batches of {items / max(n, 1):.1f}, "
                    f"{ns / max(n, 1) / 1e6:.2f} ms each"
                    for m in base
                    for n, items, ns in [[after[m][k] - before[m][k] for k in
                                          ("execution_count", "inference_count", "compute_ns")]])
                print(f"x{x:g} {'graphs' if g else 'eager '}: offered "
                      f"{sum(base.values()) * x:.0f} rps, goodput {good[g, x]:.1f}/s, worst "
                      f"model in SLO {100 * worst:.1f}%, p99 {cl.pct(t.latencies_ms, 99):.1f} "
                      f"ms, refused {dict(t.refused)}; {runs}", flush=True)
    for x in args.scales:
        eager = good[False, x]
        ratio = good[True, x] / eager if eager else float("nan")
        print(f"x{x:g}: goodput graphs / eager = {ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
