"""`make soak` (`python -m bench.soak`): a real `dstack serve` on configs/bench-mix-dstack.yaml
under open-loop Poisson load at `--load` of capacity (`--capacity-scale` x the mix's
`rate_rps`) for `--minutes`, a minute at a time; prints each minute's attainment and the
RSS of the server, workers and front ends (`--frontends`), and memory at the end against
minute 1 (targets: attainment >= 99%, memory within 5%).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from bench import chaos_load as cl
from bench.bench_chaos import OUT, config, run
from bench.servers import ROOT, front_ends, rates_slos, rss_mb, serving

MIX = ROOT / "configs/bench-mix-dstack.yaml"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--load", type=float, default=0.7, help="fraction of capacity")
    p.add_argument("--capacity-scale", type=float, default=1.0,
                   help="capacity as a multiple of the mix's rate_rps")
    p.add_argument("--frontends", type=int, default=1,
                   help="server.frontends: front-end processes (1: the server alone)")
    args = p.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    base, slos = rates_slos(MIX)
    rates = {m: r * args.capacity_scale * args.load for m, r in base.items()}
    windows = max(1, round(args.minutes))
    print(f"soak: {windows} x 60 s at {args.load:g} of capacity ("
          + ", ".join(f"{m} {r:.1f} rps" for m, r in rates.items())
          + f"); {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}", flush=True)
    per_window = []
    total = cl.Tally()
    with serving(config("dstack", "soak", {"frontends": args.frontends}),
                 OUT / "soak.log") as srv:
        pids = {"server": srv.pid, **{f"worker {m}": srv.worker_pid(m) for m in rates},
                **{f"front end {i}": pid for i, pid in enumerate(front_ends(srv.pid), 1)}}
        t0 = time.monotonic()
        for w in range(windows):
            res = run(cl.open_loop(srv.host, rates, slos, 60.0, seed=w + 1))
            t = cl.total(res)
            total.add(t)
            rss = {k: rss_mb(pid) for k, pid in pids.items()}
            att = t.ok / t.sent if t.sent else float("nan")
            per_window.append({"minute": w + 1, "sent": t.sent, "attainment": att,
                               "refused": dict(t.refused), "5xx": t.err_5xx, "hung": t.hung,
                               "rss_mb": rss, "load_average": os.getloadavg()[0]})
            print(f"  {(time.monotonic() - t0) / 60:5.1f} min: sent {t.sent}, attainment "
                  f"{100 * att:5.1f}%, refused {dict(t.refused)}, 5xx {t.err_5xx}, hung "
                  f"{t.hung}, RSS " + ", ".join(f"{k} {v:.0f}" for k, v in rss.items())
                  + f" MB, load average {os.getloadavg()[0]:.2f}", flush=True)
    start, end = per_window[0]["rss_mb"], per_window[-1]["rss_mb"]
    print(f"\nattainment {100 * total.ok / max(1, total.sent):.2f}% of {total.sent} "
          f"(target >= 99%); 5xx {total.err_5xx}, hung {total.hung}")
    for k in start:
        print(f"memory {k}: {start[k]:.0f} MB after minute 1 -> {end[k]:.0f} MB at the end "
              f"({100 * (end[k] / start[k] - 1):+.1f}%)")
    (OUT / "soak.json").write_text(json.dumps({"windows": per_window, "rates": rates}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
