"""The cluster's plan: `optimizer.placement` with the `dstack` lane planner scoring each node.

A node's score is `plan_lanes` (`dstack.policies.lane_planning`) on the copies placed
there: copy i of model m is the worker `m#i` with rate r_m / k_m, exactly as the node's
own replicas are planned, so a node's predicted goodput is the objective its `dstack`
policy would start with. `node_config` is the deployment a node then runs: its models,
each at the rate its copies carry, `max_replicas` = its copies there (the node's planner
may still run fewer where more do not pay).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dstack.cluster.config import ClusterConfig, NodeConfig
from dstack.common.config import DeployConfig, ModelConfig, PolicyName
from dstack.common.slices import SliceBackend
from dstack.common.types import Plan, Profile, load_profiles
from dstack.policies.lane_planning import backend_of, plan_lanes
from dstack.policies.replicas import expand, public_name
from optimizer.placement import ModelDemand, NodeScore, NodeSpec, Placement, place

#: Served within this fraction of its rate counts as served whole (`fewest_nodes`).
SERVED_TOL = 1e-3
#: A measured rate below this is placed as this (a placement needs rates > 0).
MIN_RATE_RPS = 0.1


@dataclass(frozen=True, slots=True)
class Kind:
    """The nodes of one entry of the cluster file: one device, one set of profiles."""

    entry: NodeConfig
    profiles: dict[str, Profile]  # by served model name (models it has a profile for)
    backend: SliceBackend


def profile_for_cores(prof: Profile, cores: int) -> Profile:
    """A CPU profile measured on `units` cores read as one of a `cores`-core device: the
    cells at p% of the measured device (p * units / 100 cores) become p * units / cores %
    of the smaller one; cells that need more cores than it has are dropped."""
    units = prof.device.units
    if prof.device.kind != "cpu" or cores >= units:
        return prof
    scale = units / cores

    def pct(p: float) -> float:
        return round(p * scale, 6)

    cells = tuple(replace(c, percent=pct(c.percent),
                          requested_percent=None if c.requested_percent is None
                          else pct(c.requested_percent))
                  for c in prof.cells if pct(c.percent) <= 100.0 + 1e-6)
    if not cells:
        raise ValueError(f"{prof.model}: no profiled slice fits in {cores} core(s)")
    percentages = tuple(sorted({c.percent for c in cells}))
    return replace(prof, device=replace(prof.device, units=cores), cells=cells,
                   percentages=percentages,
                   knee={b: min(100.0, pct(k)) for b, k in prof.knee.items()},
                   batch_sizes=tuple(b for b in prof.batch_sizes
                                     if any(c.batch == b for c in cells)),
                   provenance=f"{prof.provenance} (read as {cores} of {units} cores)".strip())


def worker_memory_mb(prof: Profile, max_batch: int) -> float:
    """Peak memory of one worker at its largest batch: the profile's `memory_mb` at the
    smallest profiled batch >= `max_batch` (the most at any batch up to it), extrapolated
    linearly beyond the profiled ones; 0 when the profile has no memory figures."""
    pts = sorted(prof.memory_mb.items())
    if not pts:
        return 0.0
    peak = 0.0
    for b, v in pts:
        peak = max(peak, v)
        if b >= max_batch:
            return peak
    if len(pts) < 2:
        return peak
    (b0, v0), (b1, v1) = pts[-2], pts[-1]
    return max(peak, v1 + max(0.0, v1 - v0) / (b1 - b0) * (max_batch - b1))


def cheapest_share(prof: Profile, m: ModelConfig) -> tuple[float, float] | None:
    """(device-seconds a request at the cheapest configuration with 2 L(b, p) <= SLO,
    that configuration's throughput in rps), or None if no batch meets the SLO alone."""
    best: tuple[float, float] | None = None
    fallback: tuple[float, float] | None = None
    for p in prof.percentages:
        for b in prof.batch_sizes:
            if b > m.max_batch_size:
                continue
            lat = prof.latency_ms(b, p)
            cost = p / 100 * lat / 1000 / b
            if 2 * lat <= m.slo_ms and (best is None or cost < best[0]):
                best = (cost, 1000.0 * b / lat)
            if lat < m.slo_ms and (fallback is None or cost < fallback[0]):
                fallback = (cost, 1000.0 * b / lat)
    return best or fallback


def whole_device_rps(prof: Profile, m: ModelConfig) -> float:
    """The most one worker serves on the whole device with 2 L(b, 100%) <= SLO (a request
    may wait out the batch ahead); with L <= SLO where no batch allows that."""
    full = max(prof.percentages)
    best = fallback = 0.0
    for b in prof.batch_sizes:
        lat = prof.latency_ms(b, full)
        if b <= m.max_batch_size and 2 * lat <= m.slo_ms:
            best = max(best, 1000.0 * b / lat)
        if b <= m.max_batch_size and lat < m.slo_ms:
            fallback = max(fallback, 1000.0 * b / lat)
    return best or fallback or math.inf


class ClusterPlanner:
    """Placement inputs from a cluster file, the node scorer, and the nodes' configs."""

    def __init__(self, cfg: ClusterConfig) -> None:
        self.cfg = cfg
        self.kinds: dict[str, Kind] = {}
        for entry in cfg.nodes:
            by_model = load_profiles(entry.profiles)
            profs = {m.name: by_model.get(m.name) or by_model.get(m.zoo) for m in cfg.models}
            have = {k: v for k, v in profs.items() if v is not None}
            if entry.device.value == "cpu" and entry.cores:
                have = {k: profile_for_cores(v, len(entry.cores)) for k, v in have.items()}
            if not have:
                from dstack.common.config import ConfigError

                raise ConfigError(f"node {entry.name}: {entry.profiles} has no profile of any "
                                  f"model ({', '.join(m.name for m in cfg.models)})")
            self.kinds[entry.name] = Kind(entry, have, backend_of(have))
        self.models = {m.name: m for m in cfg.models}

    # -- the inputs of optimizer.placement ------------------------------------------------

    def nodes(self) -> list[NodeSpec]:
        return [NodeSpec(name, e.name, e.memory_mb, frozenset(e.resident))
                for e in self.cfg.nodes for name in e.names()]

    def rate(self, model: str, rates: Mapping[str, float] | None = None) -> float:
        """The rate a placement is sized for: `rates[model]` (measured) where given, never
        below `MIN_RATE_RPS`; else the configured one."""
        if rates is not None and model in rates:
            return max(MIN_RATE_RPS, float(rates[model]))
        return self.models[model].rate_rps

    def demands(self, rates: Mapping[str, float] | None = None) -> list[ModelDemand]:
        grow = 1.0 + self.cfg.rate_headroom
        out = []
        for m0 in self.cfg.models:
            m = m0.model_copy(update={"rate_rps": self.rate(m0.name, rates)})
            mem: dict[str, float] = {}
            share: dict[str, float] = {}
            need = 1
            for kname, kind in self.kinds.items():
                prof = kind.profiles.get(m.name)
                if prof is None:
                    continue
                cheap = cheapest_share(prof, m)
                if cheap is None:
                    continue  # cannot meet its SLO on this kind of device
                mem[kname] = worker_memory_mb(prof, m.max_batch_size) + \
                    kind.entry.worker_overhead_mb
                share[kname] = grow * m.rate_rps * cheap[0]
                need = max(need, math.ceil(grow * m.rate_rps / whole_device_rps(prof, m)
                                           - 1e-9))
            need = min(need, m.max_replicas)
            # One copy more than a whole device each would need, at most: beyond that
            # copies only cost memory and start-ups (and the search grows).
            out.append(ModelDemand(m.name, m.rate_rps, m.priority.weight, mem, share,
                                   max_copies=min(m.max_replicas, need + 1), min_copies=need))
        return out

    def _workers_config(self, kind: Kind, workers: tuple[tuple[str, int, float], ...]
                        ) -> tuple[DeployConfig, dict[str, Profile]]:
        models = [self.models[m].model_copy(update={"rate_rps": rate * c, "max_replicas": c})
                  for m, c, rate in workers]
        cfg = DeployConfig.model_construct(
            device=kind.entry.device, policy=PolicyName.DSTACK, profiles=kind.entry.profiles,
            rate_headroom=self.cfg.rate_headroom, reuse_idle=self.cfg.reuse_idle,
            adapt=self.cfg.adapt, models=models, cores=None)
        run = expand(cfg, {m: c for m, c, _ in workers})
        return run, {w.name: kind.profiles[public_name(w.name)] for w in run.models}

    def node_plan(self, kind_name: str, workers: tuple[tuple[str, int, float], ...], *,
                  drop: bool = True) -> Plan:
        """The lane plan of these copies on one node of this kind. `drop`: the planner
        may leave a model out under overload (False: one exact search instead of two)."""
        kind = self.kinds[kind_name]
        run, profs = self._workers_config(kind, workers)
        # Rates given explicitly are the planner's "measured rates": it then never leaves
        # a model out (lane_planning.plan_lanes), and searches once.
        rates = None if drop else {w.name: w.rate_rps for w in run.models}
        return plan_lanes(run, profs, kind.backend, rates)[0]

    def score(self, kind_name: str, workers: tuple[tuple[str, int, float], ...]) -> NodeScore:
        """The node scorer of `optimizer.placement`: the lane plan's objective, every
        copy placed (no leaving out under overload: a lower bound of what the node's own
        planner predicts, and half the search)."""
        plan = self.node_plan(kind_name, workers, drop=False)
        served: dict[str, float] = {}
        for mp in plan.models:
            name = public_name(mp.model)
            served[name] = served.get(name, 0.0) + mp.served_rps
        return NodeScore(plan.objective, served)

    # -- results ---------------------------------------------------------------------------

    def place(self, *, time_limit_s: float = 8.0, nodes: list[NodeSpec] | None = None,
              rates: Mapping[str, float] | None = None) -> Placement:
        """Place at the configured rates, or at `rates` (measured) where given."""
        return place(nodes if nodes is not None else self.nodes(), self.demands(rates),
                     self.score, time_limit_s=time_limit_s)

    def node_config(self, node: NodeSpec, placement: Placement, *,
                    rates: Mapping[str, float] | None = None,
                    keep: Mapping[str, int] | None = None) -> DeployConfig | None:
        """The deployment node `node` runs (None: nothing placed there). `keep`: copies
        it also keeps for now (a model moving away, until its new node is ready)."""
        copies = dict(placement.copies.get(node.name, {}))
        for m, c in (keep or {}).items():
            copies.setdefault(m, c)
        if not copies:
            return None
        kind = self.kinds[node.kind]
        models = []
        for m, c in copies.items():
            k = max(1, placement.total_copies(m))
            models.append(self.models[m].model_copy(update={
                "rate_rps": self.rate(m, rates) * c / k, "max_replicas": c}))
        return DeployConfig(device=kind.entry.device, policy=self.cfg.policy,
                            profiles=kind.entry.profiles, rate_headroom=self.cfg.rate_headroom,
                            reuse_idle=self.cfg.reuse_idle, adapt=self.cfg.adapt,
                            cores=kind.entry.cores if kind.entry.device.value == "cpu" else None,
                            models=models)

    def node_profiles(self, kind_name: str, models: list[str]) -> dict[str, dict[str, Any]]:
        """The profiles (as the node's planner reads them: a CPU node's cores applied) of
        `models` on this kind, as JSON to ship with a node's deployment (a node on another
        machine need not have the files)."""
        profs = self.kinds[kind_name].profiles
        out = {}
        for m in models:
            prof = profs[m]
            out[prof.model] = prof.to_dict()
        return out

    def served_whole(self, placement: Placement) -> list[str]:
        """Models predicted below their rate (empty: every model within its SLO)."""
        return [m for m, mc in self.models.items()
                if placement.served.get(m, 0.0) < mc.rate_rps * (1 - SERVED_TOL)]

    def with_nodes(self, kind_name: str, count: int) -> list[NodeSpec]:
        """`count` nodes of one kind (the `--nodes N` / `auto` question), none resident."""
        e = self.kinds[kind_name].entry
        names = e.model_copy(update={"count": count}).names()
        return [NodeSpec(n, kind_name, e.memory_mb) for n in names]

    def fewest_nodes(self, kind_name: str, *, limit: int = 4096, time_limit_s: float = 2.0
                     ) -> tuple[int, Placement] | None:
        """The fewest nodes of this kind whose placement serves every model within its
        SLO at its rate (predicted), from a lower bound up; None if `limit` do not."""
        demands = self.demands()
        kind = self.kinds[kind_name]
        if any(kind_name not in d.memory_mb for d in demands):
            return None
        load = sum(d.demand[kind_name] / (1 + self.cfg.rate_headroom) for d in demands)
        mem = sum(d.memory_mb[kind_name] for d in demands)
        n = max(1, math.ceil(load - 1e-9), math.ceil(mem / kind.entry.memory_mb - 1e-9))
        while n <= limit:
            p = place(self.with_nodes(kind_name, n), demands, self.score,
                      time_limit_s=time_limit_s)
            if not self.served_whole(p):
                return n, p
            n += 1
        return None

    def one_model_per_device(self, kind_name: str, *, limit: int = 64) -> int | None:
        """Devices of this kind when every copy of a model has a device to itself: per
        model the fewest copies, each alone on a whole device, that serve its rate."""
        total = 0
        for m in self.cfg.models:
            if m.name not in self.kinds[kind_name].profiles:
                return None
            for k in range(1, limit + 1):
                s = self.score(kind_name, ((m.name, 1, m.rate_rps / k),))
                if s.served.get(m.name, 0.0) >= m.rate_rps / k * (1 - SERVED_TOL):
                    total += k
                    break
            else:
                return None
        return total


def format_placement(planner: ClusterPlanner, placement: Placement,
                     nodes: list[NodeSpec]) -> str:
    """Per node its copies, memory and predicted goodput; per model its copies and rate."""
    demands = {d.name: d for d in planner.demands()}
    rows = [f"{'node':14s} {'memory MB':>19s} {'goodput':>10s}  models (copies; * resident)",
            "-" * 78]
    for n in nodes:
        copies = placement.copies.get(n.name, {})
        used = sum(c * demands[m].memory_mb[n.kind] for m, c in copies.items())
        names = ", ".join(f"{m}{'*' if m in n.resident else ''}" + (f" x{c}" if c > 1 else "")
                          for m, c in copies.items()) or "(empty)"
        rows.append(f"{n.name:14s} {used:9.0f} / {n.memory_mb:7.0f} "
                    f"{placement.node_values.get(n.name, 0.0):10.1f}  {names}")
    rows += ["", f"{'model':22s} {'SLO ms':>7s} {'copies':>6s} {'served/expected rps':>22s}",
             "-" * 60]
    for m in planner.cfg.models:
        rows.append(f"{m.name:22s} {m.slo_ms:7g} {placement.total_copies(m.name):6d} "
                    f"{placement.served.get(m.name, 0.0):10.1f} / {m.rate_rps:<10.1f}")
    short = planner.served_whole(placement)
    rows.append("")
    rows.append(f"weighted goodput {placement.value:.1f} rps (predicted); "
                f"{placement.starts} start(s) on non-resident nodes; {placement.method}"
                f"{' (exact for the node planner)' if placement.proven_optimal else ''}; "
                f"{placement.evaluations} node plans scored in {placement.solve_s:.2f} s")
    if short:
        rows.append(f"short of their rate: {', '.join(short)}")
    return "\n".join(rows)


def profiles_dir(cfg: ClusterConfig, kind: str) -> Path:
    return next(e.profiles for e in cfg.nodes if e.name == kind)
