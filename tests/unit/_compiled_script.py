"""Run by tests/unit/test_compiled.py, once against the compiled modules and once against
their Python source: prints every decision of random baseline histories and a digest of
every policy's simulation, so the two outputs must be equal line for line."""

from __future__ import annotations

import hashlib
import random
import sys
from dataclasses import replace
from pathlib import Path

import dstack.policies.baselines as baselines
from dstack.common.config import Batching, PolicyName, parse_config
from dstack.common.slices import MpsSlices
from dstack.common.types import load_profiles
from dstack.policies.contract import ModelParams, Policy, QueueView
from dstack.policies.latency import LinearLatency
from dstack.policies.registry import make_policy
from dstack.simulate import generate, simulate


def random_policy(rng: random.Random) -> Policy:
    """A compiled baseline (the dstack lane policy is plain Python) over 2-6 models."""
    names = [f"m{i}" for i in range(rng.randint(2, 6))]
    params = {m: ModelParams(m, 8, rng.choice([0.0, 0.002]), 0.2,
                             rng.choice([Batching.WINDOW, Batching.RATE])) for m in names}
    kind = rng.choice([PolicyName.SHARED, PolicyName.SPATIAL, PolicyName.TEMPORAL])
    pol = make_policy(kind, params, MpsSlices(),
                      knees={m: rng.choice([10.0, 30.0, 50.0]) for m in names},
                      temporal_batch={m: rng.randint(1, 8) for m in names})
    pol.use_estimates({m: LinearLatency(rng.uniform(0.0005, 0.004), rng.uniform(0, 0.002))
                       for m in names})
    return pol


def histories(seeds: int) -> None:
    for seed in range(seeds):
        rng = random.Random(seed)
        pol = random_policy(rng)
        names = list(pol.models)
        now = rng.uniform(0, 3)
        running: dict[str, float] = {}
        items = dict.fromkeys(names, 0)
        arrived = dict.fromkeys(names, now)
        total = dict.fromkeys(names, 0)  # items ever queued (QueueView.arrived)
        for step in range(300):
            now += rng.choice([0.0, 1e-9, 0.0004, 0.001, 0.004, 0.02])
            for m in [m for m, end in running.items() if end <= now]:
                del running[m]
                pol.on_batch_done(m, rng.randint(1, 8), rng.uniform(0.0005, 0.05), now)
            for m in names:
                if rng.random() < 0.3:
                    if items[m] == 0:
                        arrived[m] = now
                    k = rng.randint(1, 4)
                    items[m] += k
                    total[m] += k
            views = {m: QueueView(m, items[m], arrived[m] if items[m] else None,
                                  arrived[m] + 0.2 if items[m] else None, m in running,
                                  total[m])
                     for m in names}
            d = pol.decide(now, views)
            print(seed, step, repr(now), [(x.model, x.max_items, x.reuse) for x in d.launches],
                  repr(d.wake_at), [pol.batch_cap(m) for m in names])
            for x in d.launches:
                running[x.model] = now + rng.uniform(0.0005, 0.005)
                items[x.model] = max(0, items[x.model] - x.max_items)


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
    print("compiled" if baselines.__file__.endswith((".so", ".pyd")) else "source",
          file=sys.stderr)
    histories(int(sys.argv[2]))
    simulations(Path(sys.argv[1]))
