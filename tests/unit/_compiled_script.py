"""Run by tests/unit/test_compiled.py, once against the compiled modules and once against
their Python source: prints every decision of random dstack histories and a digest of
every policy's simulation, so the two outputs must be equal line for line."""

from __future__ import annotations

import hashlib
import random
import sys
from dataclasses import replace
from pathlib import Path

import dstack.policies.dstack_policy as dstack_policy
from dstack.common.config import PolicyName, parse_config
from dstack.common.slices import MpsSlices
from dstack.common.types import ModelPlan, Plan, Schedule, Slot, SolverStatus, load_profiles
from dstack.policies.contract import ModelParams, QueueView
from dstack.policies.dstack_policy import DStackPolicy
from dstack.policies.latency import LinearLatency
from dstack.policies.registry import make_policy
from dstack.simulate import generate, simulate


def random_policy(rng: random.Random) -> DStackPolicy:
    """Slots that straddle cycle boundaries, share units, and sum near 100%; or (roomy)
    all fit beside each other, so reuse batches may run over many cycles."""
    names = [f"m{i}" for i in range(rng.randint(2, 6))]
    roomy = rng.random() < 0.4
    cycle = rng.choice([10.0, 25.0, 36.1, 100.0 / 3])
    slots = []
    for i, m in enumerate(names):
        for _ in range(rng.choice([1, 1, 2])):
            start = rng.choice([0.0, cycle / 3, rng.uniform(0, cycle * 0.99)])
            dur = rng.uniform(0.05, 0.7) * cycle
            pct = rng.choice([10.0, 20.0, 100.0 / 3, 40.0, 50.0, 60.0, 100.0])
            units = tuple(sorted(rng.sample(range(8), rng.randint(0, 3)))) if i % 2 else ()
            if roomy:
                pct, units = rng.choice([5.0, 8.0]), ()
            slots.append(Slot(m, start, dur, pct, units))
    plan = Plan(tuple(ModelPlan(m, rng.randint(1, 8), 50.0, 5.0, 100.0, 100.0, 100.0, 200.0)
                      for m in names), cycle, 100.0, SolverStatus.OPTIMAL)
    params = {m: ModelParams(m, 8, 0.002, 0.2) for m in names}
    pol = make_policy(PolicyName.DSTACK, params, MpsSlices(), plan=plan,
                      schedule=Schedule(cycle, tuple(slots)), origin=rng.uniform(-1, 5))
    assert isinstance(pol, DStackPolicy)
    for m in names:
        pol.latency[m] = LinearLatency(rng.uniform(0.0005, 0.004), rng.uniform(0, 0.002))
    return pol


def histories(seeds: int) -> None:
    for seed in range(seeds):
        rng = random.Random(seed)
        pol = random_policy(rng)
        names = list(pol.models)
        now = pol.origin + rng.uniform(0, 3)
        running: dict[str, float] = {}
        items = dict.fromkeys(names, 0)
        for step in range(300):
            # Steps of every size, a few of them many cycles long (the occupancy ring).
            now += rng.choice([0.0, 1e-9, 0.0004, 0.001, 0.004, pol.cycle_s, 7 * pol.cycle_s])
            for m in [m for m, end in running.items() if end <= now]:
                del running[m]
                pol.on_batch_done(m, 1, 0.001, now)
            for m in names:
                if rng.random() < 0.3:
                    items[m] += rng.randint(1, 4)
            if rng.random() < 0.05:  # a slow estimate: reuse batches over many cycles
                pol.latency[rng.choice(names)] = LinearLatency(rng.uniform(0.05, 0.4), 0.0)
            views = {m: QueueView(m, items[m], now if items[m] else None,
                                  now + 0.2 if items[m] else None, m in running)
                     for m in names}
            d = pol.decide(now, views)
            print(seed, step, repr(now), [(x.model, x.max_items, x.reuse) for x in d.launches],
                  repr(d.wake_at))
            for x in d.launches:
                running[x.model] = now + rng.uniform(0.0005, 0.005)
                items[x.model] = max(0, items[x.model] - x.max_items)
        print(seed, "ring of", pol.clock.rows, "cycles")


def simulations(root: Path) -> None:
    """The bench's ten models (scaled reference profiles) for a few simulated seconds."""
    base = load_profiles(root / "profiles" / "reference-v100")
    kinds = ["alexnet", "resnet50", "vgg19", "alexnet", "resnet50", "alexnet"]
    factors = [0.5, 0.6, 0.5, 0.9, 0.8, 1.4]
    slos = {"alexnet": 60.0, "resnet50": 120.0, "vgg19": 200.0}
    profiles, models = {}, []
    for i, (k, f) in enumerate(zip(kinds, factors, strict=True)):
        name = f"m{i}-{k}"
        cells = tuple(replace(c, p50_ms=c.p50_ms * f, p95_ms=c.p95_ms * f)
                      for c in base[k].cells)
        profiles[name] = replace(base[k], model=name, cells=cells)
        models.append({"name": name, "slo_ms": slos[k], "max_batch_size": 32,
                       "rate_rps": 150, "max_queue": 64})
    cfg = parse_config({"device": "cuda", "policy": "shared", "models": models})
    arrivals = generate("burst:x3@2s+1s", {m["name"]: 150.0 for m in models}, 6.0, 3)
    sim = simulate(cfg, profiles, arrivals, list(PolicyName), 6.0, timeline_s=2.0)
    for name, r in sim.results.items():
        print(name, r.decisions, repr(r.end_s), repr(r.busy_integral),
              hashlib.sha256(bytes(r.latencies_s)).hexdigest(), r.counts, r.timeline[:50])


if __name__ == "__main__":
    print("compiled" if dstack_policy.__file__.endswith((".so", ".pyd")) else "source",
          file=sys.stderr)
    histories(int(sys.argv[2]))
    simulations(Path(sys.argv[1]))
