"""Simulated fleets: a placement, and every node's policy on the virtual clock.

The fleet's arrivals (one Poisson stream per model) are split over the model's copies in
proportion to the copies each node holds (a seeded draw per request: the ingress's
least-queued routing spreads a model's requests evenly over equal copies); each node then
runs `dstack.simulate.simulate` on its share, exactly as one device would.

Two placements are compared (docs/cluster.md):

- `dstack`: `ClusterPlanner.place` and the `dstack` policy on every node;
- the Ray Serve way: each model its own deployment of k_m replicas (the fewest that a
  whole device each can carry its rate), each replica a fractional GPU share, placed
  round robin or first fit by that share, and the models sharing a device unpartitioned
  (the `shared` policy: every model on the whole device, batches as work arrives).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from dstack.cluster.planning import ClusterPlanner, whole_device_rps
from dstack.common.config import DeployConfig, PolicyName
from dstack.common.types import Profile
from dstack.simulate.report import PolicyReport
from dstack.simulate.simulation import simulate
from dstack.simulate.workload import Arrivals

Copies = dict[str, dict[str, int]]  # node -> model -> copies


@dataclass(frozen=True, slots=True)
class FleetReport:
    name: str
    policy: str
    copies: Copies
    arrived: int
    goodput_rps: float  # answered within SLO, per second, over the fleet
    weighted_goodput_rps: float
    per_model_goodput_rps: dict[str, float]
    nodes: dict[str, PolicyReport]
    devices_used: int
    errors: tuple[str, ...] = ()

    duration_s: float = 1.0

    @property
    def attainment_pct(self) -> float:
        """Requests answered within SLO / arrived (the same for every model's count)."""
        return 100.0 * self.goodput_rps * self.duration_s / self.arrived if self.arrived \
            else 100.0


def split_arrivals(arrivals: Arrivals, copies: Copies, seed: int) -> dict[str, Arrivals]:
    """Each request of model m goes to node n with probability copies[n][m] / k_m."""
    rng = np.random.default_rng(seed)
    node_names = list(copies)
    pick = np.full(arrivals.times.size, -1, dtype=np.int64)  # node index per request
    for mi, m in enumerate(arrivals.names):
        where = [(i, copies[n].get(m, 0)) for i, n in enumerate(node_names)]
        where = [(i, c) for i, c in where if c > 0]
        sel = np.flatnonzero(arrivals.models == mi)
        if not where or sel.size == 0:
            continue
        idx = np.array([i for i, _ in where])
        p = np.array([c for _, c in where], dtype=float)
        pick[sel] = idx[rng.choice(len(where), size=sel.size, p=p / p.sum())]
    out: dict[str, Arrivals] = {}
    for i, n in enumerate(node_names):
        names = tuple(m for m in arrivals.names if copies[n].get(m, 0) > 0)
        if not names:
            continue
        mask = pick == i
        local = {arrivals.names.index(m): j for j, m in enumerate(names)}
        remap = np.full(len(arrivals.names), -1, dtype=np.int32)
        for g, j in local.items():
            remap[g] = j
        out[n] = Arrivals(names, arrivals.times[mask], remap[arrivals.models[mask]])
    return out


def ray_serve_copies(planner: ClusterPlanner, kind: str, n_nodes: int,
                     strategy: str = "round_robin") -> Copies:
    """The Ray Serve way (module docstring): k_m replicas of each model, `round_robin`
    over the nodes, or `first_fit` by each replica's fractional share (its demand on the
    device, rounded up to 0.05, as a user would set `num_gpus`)."""
    nodes = [s.name for s in planner.with_nodes(kind, n_nodes)]
    copies: Copies = {n: {} for n in nodes}
    grow = 1.0 + planner.cfg.rate_headroom
    free = dict.fromkeys(nodes, 1.0)
    turn = 0
    for m in planner.cfg.models:
        prof = planner.kinds[kind].profiles[m.name]
        k = max(1, math.ceil(grow * m.rate_rps / whole_device_rps(prof, m) - 1e-9))
        demand = next(d for d in planner.demands() if d.name == m.name).demand.get(kind, 1.0)
        share = min(1.0, math.ceil(demand / k / 0.05 - 1e-9) * 0.05) if math.isfinite(
            demand) else 1.0
        for _ in range(k):
            if strategy == "round_robin":
                n = nodes[turn % len(nodes)]
                turn += 1
            else:
                fits = [n for n in nodes if free[n] >= share - 1e-9]
                # Ray queues a replica no node has room for; here it goes where most is left.
                n = fits[0] if fits else max(nodes, key=lambda x: free[x])
            free[n] -= share
            copies[n][m.name] = copies[n].get(m.name, 0) + 1
    return copies


def node_configs(planner: ClusterPlanner, copies: Copies, policy: PolicyName
                 ) -> dict[str, DeployConfig]:
    """Each node's deployment for these copies under `policy`."""
    total = {m.name: sum(c.get(m.name, 0) for c in copies.values()) for m in planner.cfg.models}
    kind_of = {s.name: s.kind for s in planner.nodes()}
    out = {}
    for n, held in copies.items():
        if not held:
            continue
        kind = planner.kinds[kind_of.get(n, next(iter(planner.kinds)))]
        models = [planner.models[m].model_copy(update={
            "rate_rps": planner.models[m].rate_rps * c / total[m], "max_replicas": c})
            for m, c in held.items()]
        out[n] = DeployConfig(device=kind.entry.device, policy=policy,
                              profiles=kind.entry.profiles,
                              rate_headroom=planner.cfg.rate_headroom,
                              reuse_idle=planner.cfg.reuse_idle, models=models)
    return out


def simulate_fleet(name: str, planner: ClusterPlanner, copies: Copies, policy: PolicyName,
                   arrivals: Arrivals, duration_s: float, *, seed: int = 1,
                   kind_of: Mapping[str, str] | None = None) -> FleetReport:
    """Run every node of `copies` under `policy` on its share of `arrivals`."""
    kinds = dict(kind_of or {s.name: s.kind for s in planner.nodes()})
    fallback = next(iter(planner.kinds))
    cfgs = node_configs(planner, copies, policy)
    parts = split_arrivals(arrivals, copies, seed)
    reports: dict[str, PolicyReport] = {}
    errors = []
    per_model = {m.name: 0.0 for m in planner.cfg.models}
    for n, cfg in cfgs.items():
        kind = planner.kinds[kinds.get(n, fallback)]
        profiles: dict[str, Profile] = {m.name: kind.profiles[m.name] for m in cfg.models}
        if n not in parts:
            continue
        sim = simulate(cfg, profiles, parts[n], [policy], duration_s)
        rep = sim.reports[0]
        if rep.error:
            errors.append(f"{n}: {rep.error}")
        reports[n] = rep
        for m, g in rep.per_model_goodput_rps.items():
            per_model[m] = per_model.get(m, 0.0) + g
    weights = {m.name: m.priority.weight for m in planner.cfg.models}
    return FleetReport(
        name=name, policy=str(policy), copies=copies, arrived=int(arrivals.times.size),
        goodput_rps=sum(per_model.values()),
        weighted_goodput_rps=sum(weights[m] * g for m, g in per_model.items()),
        per_model_goodput_rps=per_model, nodes=reports,
        devices_used=sum(1 for c in copies.values() if c), errors=tuple(errors),
        duration_s=duration_s)


def format_fleet(reports: list[FleetReport], duration_s: float) -> str:
    base = reports[0].goodput_rps if reports else 0.0
    rows = ["| placement | node policy | devices | arrived rps | goodput rps | attainment "
            "| first / this |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in reports:
        ratio = base / r.goodput_rps if r.goodput_rps > 0 else math.inf
        rows.append(f"| {r.name} | {r.policy} | {r.devices_used} | {r.arrived / duration_s:.0f} "
                    f"| {r.goodput_rps:.0f} | {r.attainment_pct:.1f}% | {ratio:.2f}x |")
    for r in reports:
        rows += [f"\n{r.name}: {e}" for e in r.errors]
    return "\n".join(rows)
