"""Overload of a server whose front end is the bottleneck: `python -m
bench.bench_frontend_overload [--config FILE] [--rate 300] [--levels 1,2,4,8] [--seconds 6]
[--reps 3]`.

`configs/bench-frontend.yaml` (pool_linear: 600 KB inputs, next to no compute, a 20 ms
SLO; or `--config configs/bench-frontend-two.yaml`: two such models with the H100 mix's
SLOs and rates, 20 and 50 ms, 4:1) served by `dstack serve` on the first of this process's
cores, the open-loop load (`bench.chaos_load.open_loop_sharded`) on the others, as on a GPU
host where the workers need little CPU and one Python process reads, refuses and answers
every request. Each round runs every level (a multiple of `--rate` requests a second, split
over the models by their `rate_rps`) in turn; printed per level: goodput within SLO (median
over the rounds) and against level 1, each model's against its level 1, the share of
accepted requests answered within SLO, the p99 time to a refusal, and the server's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import yaml

from bench import chaos_load as cl
from bench.servers import (
    ROOT,
    frontend_refusals,
    loop_late,
    refusal_summary,
    refusal_times,
    refusals_since,
    serving,
)
from dstack.common.slices import available_cores, pin_threads

CONFIG = ROOT / "configs/bench-frontend.yaml"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=CONFIG)
    p.add_argument("--rate", type=float, default=300.0, help="level 1, requests a second")
    p.add_argument("--levels", type=lambda v: [float(x) for x in v.split(",")],
                   default=[1.0, 2.0, 4.0, 8.0])
    p.add_argument("--seconds", type=float, default=6.0, help="per window")
    p.add_argument("--reps", type=int, default=3, help="rounds of every level")
    p.add_argument("--load-procs", type=int, default=1)
    args = p.parse_args(argv)
    cores = available_cores()
    if len(cores) < 2:
        p.error("needs two cores: one for the server, the rest for the load")
    (ROOT / "out").mkdir(exist_ok=True)
    models = yaml.safe_load(args.config.read_text())["models"]
    slos = {m["name"]: float(m["slo_ms"]) for m in models}
    weight = {m["name"]: float(m.get("rate_rps") or 1.0) for m in models}
    share = {m: w / sum(weight.values()) for m, w in weight.items()}
    good: dict[float, list[float]] = {x: [] for x in args.levels}
    per_model: dict[float, dict[str, float]] = {x: dict.fromkeys(slos, 0.0) for x in args.levels}
    total = {x: cl.Tally() for x in args.levels}
    used = {x: 0.0 for x in args.levels}
    pin_threads(cores[:1])  # the server and its worker start there
    try:
        with serving(args.config, ROOT / "out/frontend-overload.log") as srv:
            pin_threads(cores[1:])
            asyncio.run(cl.open_loop(srv.host, {m: 50.0 * f for m, f in share.items()}, slos,
                                     2.0))  # warm
            for rep in range(args.reps):
                for x in args.levels:
                    cpu0, t0 = cl.cpu_s(srv.pid), time.monotonic()
                    late0, refused0 = loop_late(srv.host), refusal_times(srv.host)
                    fe0 = frontend_refusals(srv.host)
                    load = cl.open_loop_sharded(
                        srv.host, {m: args.rate * x * f for m, f in share.items()}, slos,
                        args.seconds, seed=100 * rep + int(x), procs=args.load_procs)
                    (res, _, client_late), terms = asyncio.run(
                        cl.with_admission_terms(srv.host, load, 0.75 * args.seconds))
                    used[x] += (cl.cpu_s(srv.pid) - cpu0) / (time.monotonic() - t0) / args.reps
                    server_late = loop_late(srv.host).since(late0)
                    refused = refusals_since(refusal_times(srv.host), refused0)
                    fe = {k: v - fe0[k] for k, v in frontend_refusals(srv.host).items()}
                    for m, tm in res.items():
                        per_model[x][m] += tm.ok / args.seconds / args.reps
                    t = cl.total(res)
                    total[x].add(t)
                    good[x].append(t.ok / args.seconds)
                    print(f"  round {rep + 1} x{x:g}: goodput {good[x][-1]:.1f}/s, sent {t.sent}, "
                          f"refused {dict(t.refused)}, hung {t.hung}; admission besides "
                          f"compute (ms): {cl.format_terms(terms)}; server's loop "
                          f"{server_late.summary()}; load generator's "
                          f"{client_late.summary()}; server's refusals "
                          f"{refusal_summary(refused)}; answered by a front end without a "
                          f"decision: {fe['standing']} standing, {fe['undecided']} undecided",
                          flush=True)
    finally:
        pin_threads(cores)
    one = good[args.levels[0]]
    print(f"\nlevel  offered  goodput/s  vs {args.levels[0]:g}x (rounds)        accepted in SLO  "
          "refusal p99  server cores  each model's goodput vs level 1")
    for x in args.levels:
        t = total[x]
        ratios = [g / o if o else float("nan") for g, o in zip(good[x], one, strict=True)]
        print(f"x{x:<5g}{args.rate * x:8.0f}  {statistics.median(good[x]):9.1f}  "
              f"{statistics.median(ratios):5.2f} {[round(r, 2) for r in ratios]!s:17}  "
              f"{100 * t.ok / t.accepted if t.accepted else float('nan'):14.1f}%  "
              f"{cl.pct(t.refusal_ms, 99):8.1f} ms  {used[x]:12.2f}  " + ", ".join(
                  f"{m} {g / per_model[args.levels[0]][m]:.2f}" if per_model[args.levels[0]][m]
                  else f"{m} -" for m, g in per_model[x].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
