"""`dstack cluster plan|simulate|serve` and `dstack simulate --nodes N` (docs/cluster.md)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from dstack.cluster.config import ClusterConfig, load_cluster, parse_cluster
from dstack.common.config import ConfigError, PolicyName, load_config
from dstack.policies.planning import planning_profiles

#: Device memory of a node made by `dstack simulate --nodes N` from a deployment file.
DEFAULT_MEMORY_MB = {"cuda": 81559.0, "cpu": 16384.0}


def add_cluster_parser(sub: argparse._SubParsersAction,
                       func: Callable[[argparse.Namespace], int]) -> None:
    cl = sub.add_parser("cluster", help="many devices: placement, simulated fleets, Ray serving "
                        "(docs/cluster.md)")
    csub = cl.add_subparsers(dest="cluster_command", required=True)
    pl = csub.add_parser("plan", help="place the models on the nodes; print the placement")
    pl.add_argument("--config", required=True, help="cluster YAML (nodes, models)")
    pl.add_argument("--nodes", default=None,
                    help="N: that many nodes of the first kind instead of the file's; auto: "
                    "the fewest of that kind that serve every model within its SLO")
    pl.add_argument("--plans", action="store_true", help="also print every node's lane plan")
    pl.add_argument("--time-limit", type=float, default=8.0,
                    help="seconds the greedy search may take on large instances")
    sm = csub.add_parser("simulate", help="the placement and every node's policy on the "
                         "virtual clock")
    sm.add_argument("--config", required=True, help="cluster YAML (nodes, models)")
    _sim_flags(sm)
    sv = csub.add_parser("serve", help="serve the cluster on Ray: one KServe v2 endpoint")
    sv.add_argument("--config", required=True, help="cluster YAML (nodes, models, ray)")
    sv.add_argument("--host", default=None, help="override server.host of the ingress")
    sv.add_argument("--port", type=int, default=None, help="override server.port")
    cl.set_defaults(func=func)


def _sim_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", default="20s", help="simulated time, e.g. 20s, 1m")
    p.add_argument("--seed", type=int, default=1, help="random seed of the workload")
    p.add_argument("--baselines", default="round_robin,first_fit",
                   help="the Ray Serve way's placements to compare (round_robin, first_fit; "
                   "empty: none)")


def cluster_command(args: argparse.Namespace) -> int:
    cfg = load_cluster(args.config)
    if args.cluster_command == "plan":
        return plan_command(cfg, args.nodes, plans=args.plans, time_limit_s=args.time_limit)
    if args.cluster_command == "simulate":
        return fleet_command(cfg, None, args)
    from server.cluster import serve_cluster  # the HTTP ingress lives above dstack/

    return serve_cluster(cfg, host=args.host, port=args.port)


def plan_command(cfg: ClusterConfig, nodes: str | None, *, plans: bool = False,
                 time_limit_s: float = 8.0) -> int:
    """Exit 0 when every model is served at its rate (predicted), 1 otherwise."""
    from dstack.cluster.planning import ClusterPlanner, format_placement
    from optimizer.cli import format_plan

    planner = ClusterPlanner(cfg)
    kind = cfg.nodes[0].name
    if nodes == "auto":
        got = planner.fewest_nodes(kind)
        alone = planner.one_model_per_device(kind)
        if got is None:
            print(f"no number of {kind} nodes serves every model within its SLO")
            return 1
        n, placement = got
        specs = planner.with_nodes(kind, n)
        print(format_placement(planner, placement, specs))
        print(f"\nfewest {kind} devices that serve every model within its SLO: {n} "
              f"(one model per device: {alone if alone is not None else 'impossible'})")
        return 0
    specs = planner.nodes() if nodes is None else planner.with_nodes(kind, _count(nodes))
    placement = planner.place(nodes=specs, time_limit_s=time_limit_s)
    print(format_placement(planner, placement, specs))
    if plans:
        for s in specs:
            node_cfg = planner.node_config(s, placement)
            if node_cfg is None:
                continue
            workers = tuple(sorted((m.name, m.max_replicas, m.rate_rps / m.max_replicas)
                                   for m in node_cfg.models))
            print(f"\n{s.name}:")
            print(format_plan(planner.node_plan(s.kind, workers)))
    return 1 if planner.served_whole(placement) else 0


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise ConfigError(f"--nodes {text!r}: a number of nodes or `auto`") from None
    if n < 1:
        raise ConfigError(f"--nodes {n}: at least 1")
    return n


def cluster_from_deploy(config: str | Path, nodes: int, memory_mb: float | None,
                        profiles: str | None = None) -> ClusterConfig:
    """`dstack simulate --config deploy.yaml --nodes N`: N nodes of the deployment's
    device, each with its profiles."""
    dep = load_config(config)
    if profiles:
        dep = dep.model_copy(update={"profiles": Path(profiles).resolve()})
    # `profiles: auto` (or none): this machine's cache, as `dstack simulate` reads it
    prof_dir = planning_profiles(dep, config, say=print)[0].profiles
    mem = memory_mb or DEFAULT_MEMORY_MB[dep.device.value]
    return parse_cluster({
        "policy": PolicyName.DSTACK.value, "rate_headroom": dep.rate_headroom,
        "reuse_idle": dep.reuse_idle,
        "nodes": [{"name": "node", "device": dep.device.value, "profiles": str(prof_dir),
                   "memory_mb": mem, "count": nodes}],
        "models": [m.model_dump() for m in dep.models],
    }, source=str(config))


def fleet_command(cfg: ClusterConfig, _unused: object, args: argparse.Namespace) -> int:
    """Simulate the dstack placement and the Ray Serve baselines; print the fleet table."""
    import time

    from dstack.cluster.fleet import format_fleet, ray_serve_copies, simulate_fleet
    from dstack.cluster.planning import ClusterPlanner
    from dstack.simulate.workload import WorkloadError, generate, parse_duration

    try:
        duration = parse_duration(args.duration)
        arrivals = generate("poisson", {m.name: m.rate_rps for m in cfg.models}, duration,
                            args.seed)
    except WorkloadError as e:
        raise ConfigError(str(e)) from None
    planner = ClusterPlanner(cfg)
    nodes = planner.nodes()
    t0 = time.perf_counter()
    placement = planner.place(nodes=nodes)
    placed_s = time.perf_counter() - t0
    reports = [simulate_fleet("dstack", planner, placement.copies, cfg.policy, arrivals,
                              duration, seed=args.seed)]
    kinds = {n.kind for n in nodes}
    baselines = [b.strip() for b in args.baselines.split(",") if b.strip()]
    for b in baselines:
        if b not in ("round_robin", "first_fit"):
            raise ConfigError(f"--baselines: {b!r} is not round_robin or first_fit")
        if len(kinds) != 1:
            print(f"(baseline {b} skipped: it needs nodes of one kind)")
            continue
        copies = ray_serve_copies(planner, kinds.pop() if len(kinds) == 1 else "", len(nodes), b)
        kinds = {n.kind for n in nodes}
        reports.append(simulate_fleet(f"ray serve, {b.replace('_', ' ')}", planner, copies,
                                      PolicyName.SHARED, arrivals, duration, seed=args.seed))
    print(f"{len(cfg.models)} models on {len(nodes)} nodes, Poisson at the configured rates, "
          f"{duration:g} virtual s, seed {args.seed}; placement in {placed_s:.1f} s "
          f"({placement.method}); simulated, not measured")
    print(format_fleet(reports, duration))
    return 0


def simulate_nodes_command(args: argparse.Namespace) -> int:
    """`dstack simulate --config deploy.yaml --nodes N` (the hook in `dstack.cli`)."""
    cfg = cluster_from_deploy(args.config, args.nodes, args.node_memory_mb, args.profiles)
    if not hasattr(args, "baselines"):
        args.baselines = "round_robin,first_fit"
    return fleet_command(cfg, None, args)
