"""The policy suite: a seeded set of random mixes, every policy in the simulator, and how
the `dstack` policy compares with the baselines and with the ideal bound (docs/simulator.md,
"The policy suite", says what a mix draws: a device, 2-6 models, SLOs, a load split among
them, and the shape of the arrivals).

Every mix runs every policy on the same arrivals, then again under `--bursty` arrivals (rows
with a `b`); a policy that cannot start or crashes counts as goodput 0. Then
configs/reference-v100.yaml and a summary against the targets. Results also go to
out/bench/bench_policies.json. The exit code is 0 whatever the figures.

    .venv/bin/python -m bench.bench_policies [--mixes 40] [--seed 1] [--duration 60] [--jobs 2]
    .venv/bin/python -m bench.bench_policies --config configs/reference-v100.yaml

Instead of the suite, speed: `--speed` one simulated hour of 10 models per policy
(docs/simulator.md), `--plan-time` and `--compare` the lane planner (docs/optimizer.md).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import statistics
import sys
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from dstack.common.config import DeployConfig, PolicyName, load_config, parse_config
from dstack.common.types import Profile, load_profiles, scaled
from dstack.policies.planning import served_profiles
from dstack.simulate import cost_per_request_s, format_table, generate, latency_ms, simulate

ROOT = Path(__file__).resolve().parent.parent
PROFILES = ROOT / "profiles"
DEVICES = ("nvidia-h100-80gb-hbm3", "reference-v100", "cpu")
DEVICE_SHORT = {"nvidia-h100-80gb-hbm3": "h100", "reference-v100": "v100", "cpu": "cpu"}
POLICIES = ("temporal", "shared", "spatial", "dstack")
BASELINES = ("temporal", "shared", "spatial")
REFERENCE = ROOT / "configs" / "reference-v100.yaml"
DEFAULT_OUT = ROOT / "out" / "bench" / "bench_policies.json"

MODELS_RANGE = (2, 6)
SLO_FACTOR_RANGE = (2.0, 15.0)
LOAD_RANGE = (0.3, 1.5)
MAX_BATCHES = (8, 16, 32)
DEFAULT_DURATION_S = 60.0
DEFAULT_MAX_REQUESTS = 150_000
MIN_DURATION_S = 10.0

# The targets of the dstack policy (the project's open issue).
TARGET_VS_BEST = 0.98
TARGET_MEDIAN_IDEAL = 0.90
TARGET_REFERENCE_IDEAL = 0.95
TARGET_BURSTY_MEDIAN_IDEAL = 0.60
DEFAULT_BURSTY = "bursty:compress=10"

SHORT = {"alexnet": "alex", "resnet50": "r50", "resnet18": "r18", "vgg19": "vgg19",
         "densenet121": "dn121", "efficientnet_b0": "effb0", "mobilenet_v3_large": "mnv3l",
         "mobilenet_v3_small": "mnv3s", "vit_b_16": "vitb16", "tiny_cnn": "tiny"}


@dataclass(frozen=True)
class MixModel:
    name: str  # served name; an alias of `zoo` for a second copy
    zoo: str
    slo_ms: float
    slo_factor: float  # slo_ms / batch-1 latency on the whole device
    max_batch: int
    share: float  # of the load
    cost_s: float  # c_m: cheapest device-seconds per request within the SLO
    rate_rps: float  # mean rate (the config's rate_rps)
    base_rate_rps: float  # the rate given to the workload generator (before its shape)


@dataclass(frozen=True)
class Mix:
    id: str
    device_dir: str  # a directory under profiles/ (or the config's, for --config)
    models: tuple[MixModel, ...]
    load: float  # sum of rate_rps x cost_s
    arrival_kind: str  # poisson | burst | burst1 | ramp
    workload: str  # the generator's SPEC
    duration_s: float
    seed: int  # the workload's seed
    config_file: str = ""  # --config mode and the reference row: run this file as is


@dataclass
class MixResult:
    mix: Mix
    ideal_rps: float
    requests: int
    goodput_rps: dict[str, float]
    ratio_ideal: dict[str, float]  # goodput / ideal bound
    errors: dict[str, str]  # policy -> why it could not run (goodput counted as 0)
    vs_best: float  # dstack / best baseline (1.0 when every baseline served nothing)
    best_baseline: str
    wall_s: float
    detail: dict[str, dict[str, float]] = field(default_factory=dict)


def duration_for(total_rate_rps: float, duration_s: float, max_requests: int) -> float:
    """The mix's virtual duration: `duration_s`, shortened so that about `max_requests`
    arrive (never below MIN_DURATION_S, nor above `duration_s`)."""
    if total_rate_rps <= 0:
        return duration_s
    return min(duration_s, max(MIN_DURATION_S, max_requests / total_rate_rps))


def _profiles(device_dir: str) -> dict[str, Profile]:
    return load_profiles(PROFILES / device_dir)


def draw_mix(seed: int, index: int, duration_s: float = DEFAULT_DURATION_S,
             max_requests: int = DEFAULT_MAX_REQUESTS,
             models_range: tuple[int, int] = MODELS_RANGE) -> Mix:
    """Mix `index` of the suite for `seed` (independent of how many mixes are drawn)."""
    order = np.random.default_rng([seed, 0x5EED]).permutation(len(DEVICES))
    device_dir = DEVICES[int(order[index % len(DEVICES)])]
    rng = np.random.default_rng([seed, index])
    profiles = _profiles(device_dir)
    names = sorted(profiles)
    k = int(rng.integers(models_range[0], models_range[1] + 1))
    distinct = [names[int(i)] for i in rng.permutation(len(names))[:k]]
    extra = [names[int(i)] for i in rng.integers(0, len(names), k - len(distinct))]
    zoos = distinct + extra
    shares = rng.dirichlet(np.ones(k))
    load = float(rng.uniform(*LOAD_RANGE))
    drafts = []
    copies: dict[str, int] = {}
    for zoo, share in zip(zoos, shares, strict=True):
        copies[zoo] = copies.get(zoo, 0) + 1
        name = zoo if copies[zoo] == 1 else f"{zoo}-{copies[zoo]}"
        prof = profiles[zoo]
        factor = float(rng.uniform(*SLO_FACTOR_RANGE))
        slo_ms = factor * latency_ms(prof, 1, max(prof.percentages))
        max_batch = int(rng.choice(MAX_BATCHES))
        cost = cost_per_request_s(prof, slo_ms, max_batch)
        rate = float(share) * load / cost
        drafts.append((name, zoo, slo_ms, factor, max_batch, float(share), cost, rate))
    total_rate = sum(d[-1] for d in drafts)
    dur = duration_for(total_rate, duration_s, max_requests)
    # The arrival shape; `mult[name]` is the mean of its rate multiplier over the run.
    u = rng.random()
    mult = {d[0]: 1.0 for d in drafts}
    if u < 0.5:
        kind, spec = "poisson", "poisson"
    else:
        v = int(rng.integers(0, 3))
        if v < 2:
            x = round(float(rng.uniform(2.0, 4.0)), 1)
            start = round(float(rng.uniform(0.2, 0.6)) * dur, 3)
            length = round(float(rng.uniform(0.1, 0.25)) * dur, 3)
            m = 1.0 + (x - 1.0) * length / dur
            if v == 0:
                kind, spec = "burst", f"burst:x{x}@{start}s+{length}s"
                mult = {n: m for n in mult}
            else:
                target = drafts[int(rng.integers(0, k))][0]
                kind, spec = "burst1", f"burst:x{x}@{start}s+{length}s:{target}"
                mult[target] = m
        else:
            lo = round(float(rng.uniform(0.3, 1.0)), 2)
            hi = round(float(rng.uniform(1.2, 2.5)), 2)
            a, b = (lo, hi) if rng.random() < 0.5 else (hi, lo)
            kind, spec = "ramp", f"ramp:{a}..{b}"
            mult = {n: (a + b) / 2 for n in mult}
    models = tuple(
        MixModel(name, zoo, slo_ms, factor, max_batch, share, cost, rate, rate / mult[name])
        for name, zoo, slo_ms, factor, max_batch, share, cost, rate in drafts
    )
    return Mix(f"m{index:02d}", device_dir, models, load, kind, spec, dur,
               int(rng.integers(0, 2**31 - 1)))


def bursty_twin(mix: Mix, spec: str) -> Mix:
    """The mix under the shaped workload `spec` (its shape's mean is each model's rate)."""
    return replace(mix, id=f"{mix.id}b", arrival_kind="bursty", workload=spec,
                   models=tuple(replace(m, base_rate_rps=m.rate_rps) for m in mix.models))


def draw_suite(seed: int, n: int, duration_s: float = DEFAULT_DURATION_S,
               max_requests: int = DEFAULT_MAX_REQUESTS) -> list[Mix]:
    return [draw_mix(seed, i, duration_s, max_requests) for i in range(n)]


def mix_config(mix: Mix) -> DeployConfig:
    profile_dir = PROFILES / mix.device_dir
    kind = next(iter(_profiles(mix.device_dir).values())).device.kind
    models: list[dict[str, Any]] = []
    for m in mix.models:
        entry: dict[str, Any] = {
            "name": m.name, "slo_ms": m.slo_ms, "max_batch_size": m.max_batch,
            "rate_rps": m.rate_rps,
            # The default batching window (2 ms) must stay below the SLO (some H100 SLOs
            # are ~1 ms).
            "max_queue_delay_ms": min(2.0, m.slo_ms / 4),
        }
        if m.zoo != m.name:
            entry["zoo_name"] = m.zoo
        models.append(entry)
    return parse_config({"device": "cpu" if kind == "cpu" else "cuda", "policy": "shared",
                         "profiles": str(profile_dir), "models": models})


def config_mix(path: str | Path, seed: int, duration_s: float, max_requests: int,
               workload: str = "poisson", mix_id: str = "config") -> Mix:
    """A Mix for a config file run as is (its own rates, SLOs and batch sizes)."""
    cfg = load_config(path)
    profiles = served_profiles(cfg, check_device=False)
    models = []
    load = 0.0
    for m in cfg.models:
        prof = profiles[m.name]
        cost = cost_per_request_s(prof, m.slo_ms, m.max_batch_size)
        load += m.rate_rps * cost
        models.append(MixModel(m.name, m.zoo, m.slo_ms,
                               m.slo_ms / latency_ms(prof, 1, max(prof.percentages)),
                               m.max_batch_size, 0.0, cost, m.rate_rps, m.rate_rps))
    total = sum(m.rate_rps for m in models)
    models = [replace(m, share=m.rate_rps * m.cost_s / load if load > 0 else 0.0)
              for m in models]
    device_dir = Path(cfg.profiles).name if cfg.profiles is not None else "?"
    kind = workload.split(":", 1)[0]
    return Mix(mix_id, device_dir, tuple(models), load, kind, workload,
               duration_for(total, duration_s, max_requests), seed, str(path))


#: The detail of a policy that could not run.
FAILED = {"goodput_rps": 0.0, "slo_attainment_pct": 0.0, "refused": 0, "late": 0,
          "utilisation_pct": 0.0}


def run_mix(mix: Mix, policies: tuple[str, ...] = POLICIES) -> MixResult:
    """Every policy on the mix's arrivals. A policy that cannot start or raises gets goodput
    0 and its reason in `errors`."""
    t0 = time.perf_counter()
    cfg = load_config(mix.config_file) if mix.config_file else mix_config(mix)
    profiles = served_profiles(cfg, check_device=False)
    arrivals = generate(mix.workload, {m.name: m.base_rate_rps for m in mix.models},
                        mix.duration_s, mix.seed)
    goodput: dict[str, float] = {}
    errors: dict[str, str] = {}
    detail: dict[str, dict[str, float]] = {}
    ideal = math.nan
    for pol in policies:
        try:
            sim = simulate(cfg, profiles, arrivals, [PolicyName(pol)], mix.duration_s)
        except Exception as e:  # a policy being rewritten may crash: count it, go on
            errors[pol] = f"crashed: {type(e).__name__}: {e}"
            traceback.print_exc(file=sys.stderr)
            goodput[pol], detail[pol] = 0.0, dict(FAILED)
            continue
        ideal = sim.ideal_rps
        r = sim.reports[0]
        goodput[pol] = r.goodput_rps
        if r.error:
            errors[pol], detail[pol] = r.error, dict(FAILED)
        else:
            detail[pol] = {"goodput_rps": r.goodput_rps,
                           "slo_attainment_pct": r.slo_attainment_pct,
                           "refused": r.refused, "late": r.late,
                           "utilisation_pct": r.utilisation_pct,
                           "per_model_goodput_rps": r.per_model_goodput_rps}  # type: ignore[dict-item]
    ratio = {p: (g / ideal if ideal > 0 else 0.0) for p, g in goodput.items()}
    base = {p: goodput[p] for p in BASELINES if p in goodput}
    best = max(base, key=lambda p: base[p]) if base else ""
    best_g = base.get(best, 0.0)
    vs_best = goodput.get("dstack", 0.0) / best_g if best_g > 0 else 1.0
    return MixResult(mix, ideal, int(arrivals.times.size), goodput, ratio, errors, vs_best,
                     best, time.perf_counter() - t0, detail)


def short_models(mix: Mix) -> str:
    counts = Counter(m.zoo for m in mix.models)
    return ",".join(SHORT.get(z, z[:6]) + (f"x{c}" if c > 1 else "") for z, c in counts.items())


HEADER = (f"{'id':5s} {'device':6s} {'models':30s} {'load':>5s} {'arrivals':8s} "
          f"{'temporal':>8s} {'shared':>8s} {'spatial':>8s} {'dstack':>8s} {'d/best':>7s} "
          f"{'reqs':>8s} {'wall':>6s}")


def format_row(r: MixResult) -> str:
    cols = [f"{'-':>8s}" if p not in r.goodput_rps else f"{'fail':>8s}" if p in r.errors
            else f"{r.ratio_ideal[p]:8.3f}" for p in POLICIES]
    flag = " <" if r.vs_best < TARGET_VS_BEST else ""
    return (f"{r.mix.id:5s} {DEVICE_SHORT.get(r.mix.device_dir, r.mix.device_dir[:6]):6s} "
            f"{short_models(r.mix)[:30]:30s} {r.mix.load:5.2f} {r.mix.arrival_kind:8s} "
            + " ".join(cols) + f" {r.vs_best:7.3f} {r.requests:8d} {r.wall_s:5.1f}s{flag}")


def served_nothing(r: MixResult) -> bool:
    """dstack served nothing while some baseline served something."""
    return r.goodput_rps.get("dstack", 0.0) <= 0 and any(
        r.goodput_rps.get(p, 0.0) > 0 for p in BASELINES)


def mark(met: bool) -> str:
    return "[met]   " if met else "[MISSED]"


def summarise(results: list[MixResult], reference: MixResult | None,
              wall_s: float) -> tuple[dict[str, Any], list[str]]:
    """The summary figures and the lines that print them (targets included)."""
    n = len(results)
    ok = [r for r in results if r.vs_best >= TARGET_VS_BEST]
    worst = min(results, key=lambda r: r.vs_best) if results else None
    med = {p: statistics.median(r.ratio_ideal.get(p, 0.0) for r in results) if results
           else math.nan for p in POLICIES}
    nothing = [r.mix.id for r in results if served_nothing(r)]
    all_zero = [r.mix.id for r in results if all(g <= 0 for g in r.goodput_rps.values())]
    failures = [f"{r.mix.id}/{p}: {e}" for r in results + ([reference] if reference else [])
                for p, e in r.errors.items()]
    ref_ideal = reference.ratio_ideal.get("dstack", 0.0) if reference else math.nan
    ref_best = reference.vs_best if reference else math.nan
    every = len(ok) == n and (reference is None or ref_best >= TARGET_VS_BEST)
    fig = {
        "mixes": n, "dstack_ge_target_vs_best": len(ok),
        "worst_vs_best": worst.vs_best if worst else math.nan,
        "worst_mix": worst.mix.id if worst else "",
        "median_ratio_ideal": med, "dstack_served_nothing": nothing,
        "every_policy_served_nothing": all_zero, "failures": failures,
        "reference_dstack_ideal": ref_ideal, "reference_vs_best": ref_best,
        "wall_s": wall_s,
    }
    lines = ["summary:"]
    lines.append(f"  dstack >= {TARGET_VS_BEST}x best baseline: {len(ok)}/{n} mixes"
                 + (f" (reference-v100: {ref_best:.3f})" if reference else ""))
    if worst:
        lines.append(f"  worst dstack/best baseline: {worst.vs_best:.3f} on {worst.mix.id} "
                     f"({DEVICE_SHORT.get(worst.mix.device_dir, worst.mix.device_dir)} "
                     f"{short_models(worst.mix)}, load {worst.mix.load:.2f}, "
                     f"{worst.mix.arrival_kind}; best baseline {worst.best_baseline})")
    lines.append("  median goodput/ideal: " + ", ".join(f"{p} {med[p]:.3f}" for p in
                                                         ("dstack",) + BASELINES))
    started = [r for r in results if "dstack" in r.goodput_rps and "dstack" not in r.errors]
    if started:
        lines.append(f"  where dstack started ({len(started)} mixes): median dstack/ideal "
                     f"{statistics.median(r.ratio_ideal['dstack'] for r in started):.3f}, "
                     f"median dstack/best baseline "
                     f"{statistics.median(r.vs_best for r in started):.3f}")
    lines.append(f"  dstack served nothing while a baseline served: {len(nothing)} mixes"
                 + (f" ({', '.join(nothing)})" if nothing else ""))
    lines.append(f"  every policy served nothing: {len(all_zero)} mixes"
                 + (f" ({', '.join(all_zero)})" if all_zero else ""))
    lines.append(f"  policies that could not run (goodput 0): {len(failures)}")
    lines.extend(f"    {f[:110]}{'...' if len(f) > 110 else ''}" for f in failures)
    if reference:
        lines.append(f"  reference-v100: dstack/ideal {ref_ideal:.3f}, "
                     f"dstack/best baseline {ref_best:.3f} ({reference.best_baseline})")
    lines.append(f"  wall time: {wall_s:.1f} s")

    lines.append("targets:")
    lines.append(f"  {mark(every)} dstack >= {TARGET_VS_BEST}x best baseline on every mix: "
                 f"{len(ok)}/{n}" + (f", reference {ref_best:.3f}" if reference else ""))
    lines.append(f"  {mark(med['dstack'] >= TARGET_MEDIAN_IDEAL)} median dstack/ideal >= "
                 f"{TARGET_MEDIAN_IDEAL:.2f}: {med['dstack']:.3f}")
    if reference:
        lines.append(f"  {mark(ref_ideal >= TARGET_REFERENCE_IDEAL)} dstack/ideal >= "
                     f"{TARGET_REFERENCE_IDEAL:.2f} on configs/reference-v100.yaml: "
                     f"{ref_ideal:.3f}")
    ref_nothing = reference is not None and served_nothing(reference)
    lines.append(f"  {mark(not nothing and not ref_nothing)} dstack never serves nothing "
                 f"while a baseline serves: {len(nothing) + int(ref_nothing)} mixes")
    fig["targets_met"] = {
        "vs_best_every_mix": every,
        "median_ideal": med["dstack"] >= TARGET_MEDIAN_IDEAL,
        "reference_ideal": (ref_ideal >= TARGET_REFERENCE_IDEAL) if reference else None,
        "never_nothing": not nothing and not ref_nothing,
    }
    return fig, lines


def summarise_bursty(results: list[MixResult]) -> tuple[dict[str, Any], list[str]]:
    """The bursty rows' figures and the lines that print them (targets included)."""
    n = len(results)
    ok = [r for r in results if r.vs_best >= TARGET_VS_BEST]
    worst = min(results, key=lambda r: r.vs_best)
    med = {p: statistics.median(r.ratio_ideal.get(p, 0.0) for r in results) for p in POLICIES}
    spec = results[0].mix.workload
    lines = [f"bursty arrivals ({spec}):",
             f"  dstack >= {TARGET_VS_BEST}x best baseline: {len(ok)}/{n} mixes; worst "
             f"{worst.vs_best:.3f} on {worst.mix.id} (best baseline {worst.best_baseline})",
             "  median goodput/ideal: " + ", ".join(f"{p} {med[p]:.3f}" for p in
                                                     ("dstack",) + BASELINES),
             "targets (bursty):",
             f"  {mark(len(ok) == n)} dstack >= {TARGET_VS_BEST}x best "
             f"baseline on every mix: {len(ok)}/{n}",
             f"  {mark(med['dstack'] >= TARGET_BURSTY_MEDIAN_IDEAL)} "
             f"median dstack/ideal >= {TARGET_BURSTY_MEDIAN_IDEAL:.2f}: {med['dstack']:.3f}"]
    fig = {"workload": spec, "mixes": n, "dstack_ge_target_vs_best": len(ok),
           "worst_vs_best": worst.vs_best, "worst_mix": worst.mix.id,
           "median_ratio_ideal": med}
    return fig, lines


# ------------------------------------------------------------------ speed


def simulator_speed(policies: list[str], duration_s: float, seed: int) -> None:
    """`duration_s` simulated (an hour: 3.6 M requests) of 10 models at 100 rps each, the
    reference V100 profiles scaled x0.5-x1.4, per policy: the wall time of its event loop,
    the CPU time of its whole run (on a shared machine the wall time counts the other
    processes' turns too), its decisions."""
    from dstack.simulate.engine import COMPILED

    base = _profiles("reference-v100")
    kinds = ["alexnet", "resnet50", "alexnet", "vgg19", "alexnet",
             "resnet50", "alexnet", "alexnet", "resnet50", "alexnet"]
    factors = [0.5, 0.6, 0.7, 0.5, 0.9, 0.7, 1.0, 1.2, 0.8, 1.4]
    slos = {"alexnet": 60.0, "resnet50": 120.0, "vgg19": 200.0}
    profiles, models = {}, []
    for i, (k, f) in enumerate(zip(kinds, factors, strict=True)):
        name = f"m{i}-{k}"
        profiles[name] = replace(scaled(base[k], f), model=name)
        models.append({"name": name, "slo_ms": slos[k], "max_batch_size": 32, "rate_rps": 100})
    cfg = parse_config({"device": "cuda", "policy": "shared", "models": models})
    t0 = time.perf_counter()
    arrivals = generate("poisson", {m["name"]: 100.0 for m in models}, duration_s, seed)
    print(f"workload: {arrivals.times.size} requests in {time.perf_counter() - t0:.1f} s; "
          f"event loop {'compiled' if COMPILED else 'uncompiled (Python)'}")
    reports = []
    for pol in policies:
        cpu0 = time.process_time()
        sim = simulate(cfg, profiles, arrivals, [PolicyName(pol)], duration_s)
        cpu = time.process_time() - cpu0
        setup_s, wall = sim.wall_s[pol]
        r = sim.reports[0]
        reports.append(r)
        print(f"{pol:9s} event loop {wall:6.1f} s wall, run {cpu:6.1f} s CPU, for "
              f"{duration_s:g} simulated s ({duration_s / wall:5.0f}x real time; "
              f"{r.decisions} policy decisions, "
              f"{wall / max(r.decisions, 1) * 1e6:.0f} us per decision incl. its events); "
              f"setup + solve {setup_s:.1f} s", flush=True)
    print(format_table(reports))


H100 = "nvidia-h100-80gb-hbm3"
#: Up to this many models `compare` also solves the MILP over every lane (the optimum).
EXACT_UP_TO = 8


def sized_mix(n: int, seed: int, device: str | None = None, start: int = 0) -> Mix:
    """The first suite mix (from index `start`) of `n` models, on `device` if given."""
    while (mix := draw_mix(seed, start, models_range=(n, n))).device_dir != (device
                                                                            or mix.device_dir):
        start += 1
    return mix


def plan_time(sizes: list[int], seeds: int = 3, repeat: int = 3) -> None:
    """The time `plan_lanes` (what `dstack plan`, the server and the simulator run) takes
    on H100 mixes of each size, each mix's median of `repeat`, with how its search ended."""
    from dstack.policies import lane_planning

    print(f"plan time: plan_lanes on H100 mixes (each mix's median of {repeat} run(s))")
    for n in sizes:
        times = []
        for seed in range(seeds):
            cfg = mix_config(sized_mix(n, seed, H100))
            profiles = served_profiles(cfg, check_device=False)
            runs = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                plan, _, _ = lane_planning.plan_lanes(cfg, profiles, None)
                runs.append(time.perf_counter() - t0)
            times.append(statistics.median(runs))
            print(f"  {n:3d} models seed {seed}: {times[-1]:7.3f} s  G {plan.objective:9.1f}  "
                  f"{len(plan.lanes):2d} lanes  {plan.status.value:10s} {plan.search}")
        print(f"  {n:3d} models: median {statistics.median(times):.3f} s, "
              f"max {max(times):.3f} s")


def compare(lo: int, hi: int, seed: int) -> None:
    """On mixes of `lo`-`hi` models (one per device and size), the predicted goodput G of
    the greedy merge search's plan and of the MILP's, every model placed; up to
    EXACT_UP_TO models also the optimum (the MILP over every subset at every width)."""
    from dstack.policies import lane_planning
    from optimizer import lane_milp
    from optimizer.lanes import Lanes

    print(f"MILP against greedy, mixes of {lo}-{hi} models (seed {seed}), every model placed")
    print(f"  {'mix':12s} {'n':>3s} {'greedy G':>10s} {'MILP G':>10s} {'MILP/greedy':>11s} "
          f"{'greedy s':>8s} {'MILP s':>7s}  status")
    wins = {"milp": 0, "tie": 0, "greedy": 0}
    for n in range(lo, hi + 1):
        for k in range(len(DEVICES)):
            mix = sized_mix(n, seed, start=k)
            cfg = mix_config(mix)
            profiles = served_profiles(cfg, check_device=False)
            backend = lane_planning.backend_of(profiles)
            inst = lane_planning._instance(cfg, profiles, backend, None,
                                           lane_planning.LATENCY_MARGIN)[0]
            t0 = time.perf_counter()
            greedy = Lanes(inst).greedy()
            t1 = time.perf_counter()
            best = lane_milp.search(Lanes(inst), drop=False)
            t2 = time.perf_counter()
            exact = ""
            if n <= EXACT_UP_TO:  # every lane a candidate: the optimum, for reference
                full = lane_milp.search(Lanes(inst), drop=False, exact_max=n,
                                        time_limit_s=60.0)
                exact = f"; optimum {full.value:.1f} ({full.value / best.value:.4f}x MILP)"
            ratio = best.value / greedy.value if greedy.value > 0 else 1.0
            who = "milp" if ratio > 1 + 1e-6 else "greedy" if ratio < 1 - 1e-6 else "tie"
            wins[who] += 1
            dev = DEVICE_SHORT.get(mix.device_dir, mix.device_dir)
            print(f"  {mix.id + ' ' + dev:12s} {n:3d} {greedy.value:10.1f} {best.value:10.1f} "
                  f"{ratio:11.4f} {t1 - t0:8.2f} {t2 - t1:7.2f}  "
                  f"{best.status.describe() if best.status else ''}{exact}")
    print(f"  MILP higher on {wins['milp']}, equal on {wins['tie']}, greedy higher on "
          f"{wins['greedy']}")


def _run_all(mixes: list[Mix], jobs: int):  # noqa: ANN202 (an iterator of MixResult)
    if jobs <= 1 or len(mixes) <= 1:
        return map(run_mix, mixes)
    pool = multiprocessing.get_context().Pool(min(jobs, len(mixes)))
    return pool.imap(run_mix, mixes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mixes", type=int, default=40, help="random mixes (default 40)")
    ap.add_argument("--seed", type=int, default=1, help="suite seed (default 1)")
    ap.add_argument("--duration", type=float, default=None,
                    help=f"virtual seconds per mix at most (default {DEFAULT_DURATION_S:g}; "
                         "--speed: 3600)")
    ap.add_argument("--max-requests", type=int, default=DEFAULT_MAX_REQUESTS,
                    help="shorten a mix's run so about this many requests arrive (never "
                         f"below {MIN_DURATION_S:g} s; default %(default)d)")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    ap.add_argument("--config", help="run this one config instead of the suite")
    ap.add_argument("--workload", default="poisson", help="with --config: the workload SPEC")
    ap.add_argument("--bursty", default=DEFAULT_BURSTY,
                    help="the workload SPEC each mix runs again under (default %(default)s; "
                         "`none`: Poisson and the drawn shapes only)")
    ap.add_argument("--no-reference", action="store_true",
                    help="skip the configs/reference-v100.yaml row")
    ap.add_argument("--out", help=f"JSON results (default {DEFAULT_OUT.relative_to(ROOT)} "
                                  "for the suite, none for --config)")
    ap.add_argument("--speed", nargs="?", const=",".join(POLICIES), metavar="POLICIES",
                    help="instead: the simulator's speed on an hour of 10 models, per policy")
    ap.add_argument("--plan-time", type=int, nargs="+", metavar="N",
                    help="instead: plan_lanes's time on H100 mixes of N models")
    ap.add_argument("--compare", type=int, nargs=2, metavar=("LO", "HI"),
                    help="instead: the lane MILP against the greedy on mixes of LO-HI models")
    args = ap.parse_args(argv)
    if args.speed or args.plan_time or args.compare:
        if args.speed:
            simulator_speed(args.speed.split(","), args.duration or 3600.0, args.seed)
        if args.plan_time:
            plan_time(args.plan_time)
        if args.compare:
            compare(*args.compare, args.seed)
        return 0
    args.duration = args.duration or DEFAULT_DURATION_S
    t0 = time.perf_counter()
    if args.config:
        mix = config_mix(args.config, args.seed, args.duration, args.max_requests,
                         args.workload, "cfg")
        print(f"{args.config}: {args.workload}, {mix.duration_s:g} s, seed {args.seed}, "
              f"load {mix.load:.2f}")
        print(HEADER)
        r = run_mix(mix)
        print(format_row(r))
        for p, e in r.errors.items():
            print(f"  {p}: could not run: {e}")
        if args.out:
            _write(Path(args.out), {"config": asdict(r)})
        return 0
    mixes = draw_suite(args.seed, args.mixes, args.duration, args.max_requests)
    jobs_in = list(mixes)
    if args.bursty != "none":
        generate(args.bursty, {"check": 1.0}, 1.0, 0)  # a bad SPEC fails here, at once
        jobs_in += [bursty_twin(m, args.bursty) for m in mixes]
    if not args.no_reference:
        jobs_in.append(config_mix(REFERENCE, args.seed, args.duration, args.max_requests,
                                  "poisson", "ref"))
    print(f"policy suite: {args.mixes} mixes, seed {args.seed}, <= {args.duration:g} virtual s "
          f"each (~{args.max_requests} requests, >= {MIN_DURATION_S:g} s), {args.jobs} jobs; "
          f"columns: goodput / ideal bound per policy, dstack / best baseline")
    print(HEADER)
    results: list[MixResult] = []
    bursty: list[MixResult] = []
    reference: MixResult | None = None
    for r in _run_all(jobs_in, args.jobs):
        if r.mix.config_file:
            reference = r
            print(f"reference: {Path(r.mix.config_file).name} (its own rates, Poisson)")
        elif r.mix.arrival_kind == "bursty":
            bursty.append(r)
        else:
            results.append(r)
        print(format_row(r), flush=True)
    wall = time.perf_counter() - t0
    fig, lines = summarise(results, reference, wall)
    print()
    print("\n".join(lines))
    bursty_fig = None
    if bursty:
        bursty_fig, blines = summarise_bursty(bursty)
        print("\n".join(blines))
    out = Path(args.out) if args.out else DEFAULT_OUT
    _write(out, {"seed": args.seed, "mixes": [asdict(r) for r in results],
                 "bursty": [asdict(r) for r in bursty],
                 "reference": asdict(reference) if reference else None,
                 "summary": fig, "bursty_summary": bursty_fig, "args": vars(args)})
    print(f"written to {out}")
    return 0


def _write(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")


if __name__ == "__main__":
    sys.exit(main())
