"""`make bench-priority` (`python -m bench.bench_priority`): a low-priority model flooding
beside planned ones (issue 18, FIKIT), three runs on the same arrivals of the planned
models: **alone** (`dstack`), **dstack + low flood** (a `priority: low` model at `--flood`
times its whole-device capacity) and **shared + flood**. Printed: the planned models' SLO
attainment, the low model's rps within its SLO, and (simulator) the device-seconds it used
against those the planned models left idle. Targets: attainment within 1 point of alone;
>= 70% of the idle capacity used. The simulator always (reference V100: resnet50 + alexnet,
vgg19 flooding); `--real` adds real servers on this CPU (mobilenet_v3_small + tiny_cnn,
resnet18 flooding; open-loop Poisson over HTTP).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path
from typing import Any

import yaml

from bench.chaos_load import open_loop
from bench.servers import ROOT, serving
from dstack.common.config import PolicyName, parse_config
from dstack.policies.planning import served_profiles
from dstack.simulate import cost_per_request_s, generate, simulate

SIM_PLANNED = [
    {"name": "resnet50", "slo_ms": 50, "max_batch_size": 16, "rate_rps": 150},
    {"name": "alexnet", "slo_ms": 20, "max_batch_size": 16, "rate_rps": 300},
]
SIM_LOW = {"name": "vgg19", "slo_ms": 500, "max_batch_size": 32, "priority": "low"}
CPU_PLANNED = [
    {"name": "mobilenet_v3_small", "slo_ms": 150, "max_batch_size": 8,
     "max_queue_delay_ms": 5, "rate_rps": 20},
    {"name": "tiny_cnn", "slo_ms": 100, "max_batch_size": 8, "max_queue_delay_ms": 5,
     "rate_rps": 50},
]
# A heavy low model: 3x its capacity is a rate the HTTP load generator can send.
CPU_LOW = {"name": "resnet18", "slo_ms": 2000, "max_batch_size": 8, "priority": "low"}


def config(device: str, profiles: str, models: list[dict[str, Any]], policy: str
           ) -> dict[str, Any]:
    return {"device": device, "policy": policy, "profiles": profiles, "models": models}


def runs(planned: list[dict[str, Any]], low: dict[str, Any]
         ) -> list[tuple[str, list[dict[str, Any]], str]]:
    """(label, models, policy) of the three runs."""
    return [("alone", planned, "dstack"), ("dstack + low flood", [*planned, low], "dstack"),
            ("shared + flood", [*planned, low], "shared")]


def flood(device: str, profiles: str, low: dict[str, Any], times: float) -> dict[str, Any]:
    """`low` at `times` x what its cheapest configuration serves on the whole device."""
    cfg = parse_config(config(device, profiles, [low], "dstack"))
    prof = served_profiles(cfg, check_device=False)[low["name"]]
    cost = cost_per_request_s(prof, low["slo_ms"], low["max_batch_size"])
    return {**low, "rate_rps": times / cost}


def run_sim(duration_s: float, times: float, seed: int) -> None:
    profiles = str(ROOT / "profiles" / "reference-v100")
    low = flood("cuda", profiles, SIM_LOW, times)
    planned = [m["name"] for m in SIM_PLANNED]
    rows = []
    for label, models, policy in runs(SIM_PLANNED, low):
        # the planned models' arrivals are the same in every run (a stream per model)
        arrivals = generate("poisson", {m["name"]: m["rate_rps"] for m in models},
                            duration_s, seed)
        cfg = parse_config(config("cuda", profiles, models, policy))
        sim = simulate(cfg, served_profiles(cfg, check_device=False), arrivals,
                       [PolicyName(policy)], duration_s)
        rep, res = sim.reports[0], sim.results[policy]
        att = {m: 100.0 * res.counts[m].within_slo / max(1, res.counts[m].arrived)
               for m in planned}
        c = res.counts.get(low["name"])
        rows.append((label, att, c.within_slo / duration_s if c else 0.0, res.busy_integral,
                     rep.error))
    idle = duration_s - rows[0][3]
    print(f"simulator, reference V100: planned {', '.join(planned)}; {low['name']} "
          f"(priority low) at {low['rate_rps']:.0f} rps = {times:g}x its whole-device "
          f"capacity; Poisson, {duration_s:g} s, seed {seed}")
    print(f"{'run':22s} " + " ".join(f"{m + ' SLO %':>16s}" for m in planned)
          + f" {'low in SLO rps':>15s} {'device-s used':>14s}")
    for label, att, low_rps, busy, err in rows:
        print(f"{label:22s} " + " ".join(f"{att[m]:16.2f}" for m in planned)
              + f" {low_rps:15.1f} {busy:14.2f}" + (f"  ({err})" if err else ""))
    alone, fill, shared = rows
    worst = max(alone[1][m] - fill[1][m] for m in planned)
    used = (fill[3] - alone[3]) / idle if idle > 0 else 0.0
    worst_shared = max(alone[1][m] - shared[1][m] for m in planned)
    print(f"planned models' attainment lost to the flood: dstack {worst:.2f} points "
          f"(target <= 1), shared {worst_shared:.2f} points")
    print(f"idle device-seconds without the flood: {idle:.2f}; the low model used "
          f"{fill[3] - alone[3]:.2f} of them = {100 * used:.0f}% (target >= 70%)")


def run_real(duration_s: float, times: float, seed: int) -> None:
    profiles = str(ROOT / "profiles" / "cpu")
    low = flood("cpu", profiles, CPU_LOW, times)
    planned = [m["name"] for m in CPU_PLANNED]
    print(f"\nreal server, this CPU: planned {', '.join(planned)}; {low['name']} (priority "
          f"low) at {low['rate_rps']:.0f} rps = {times:g}x its capacity; open-loop Poisson "
          f"over HTTP, {duration_s:g} s, seed {seed}")
    print(f"{'run':22s} " + " ".join(f"{m + ' SLO %':>24s}" for m in planned)
          + f" {'low in SLO rps':>15s}")
    with tempfile.TemporaryDirectory() as tmp:
        for label, models, policy in runs(CPU_PLANNED, low):
            path = Path(tmp) / f"{policy}-{len(models)}.yaml"
            path.write_text(yaml.safe_dump(config("cpu", profiles, models, policy)))
            rates = {m["name"]: float(m["rate_rps"]) for m in models}
            slos = {m["name"]: float(m["slo_ms"]) for m in models}
            with serving(path, Path(tmp) / f"{path.stem}.log") as srv:
                out = asyncio.run(open_loop(srv.host, rates, slos, duration_s, seed=seed))
            att = {m: 100.0 * out[m].ok / max(1, out[m].sent) for m in planned}
            low_rps = out[low["name"]].ok / duration_s if low["name"] in out else 0.0
            print(f"{label:22s} " + " ".join(f"{att[m]:24.2f}" for m in planned)
                  + f" {low_rps:15.1f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=30.0, help="seconds per run")
    ap.add_argument("--flood", type=float, default=3.0,
                    help="the low model's rate over its whole-device capacity (default 3)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--real", action="store_true",
                    help="also real servers on this CPU (~2 min at the default duration)")
    args = ap.parse_args(argv)
    run_sim(args.duration, args.flood, args.seed)
    if args.real:
        run_real(args.duration, args.flood, args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
