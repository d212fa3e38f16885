"""`dstack` command line: serve, profile, plan, simulate, models.

A thin layer: each subcommand parses its flags and calls a library function. Heavy
imports happen inside the subcommand so that `dstack models` stays quick.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence


def _cmd_models(args: argparse.Namespace) -> int:
    import models

    for name in models.names():
        s = models.spec(name)
        shape = "x".join(str(d) for d in s.inputs[0].shape[1:])
        print(f"{name:28s} input {s.inputs[0].datatype.value} {shape}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from server.main import serve

    return serve(args.config, host=args.host, port=args.port, grpc_port=args.grpc_port,
                 allow_client_shm=args.allow_client_shm)


def _cmd_plan(args: argparse.Namespace) -> int:
    """Exit 0 when every model is placed (optimal or partial), 1 when some cannot be."""
    import json
    from pathlib import Path

    from dstack.common.slices import CpuSlices
    from dstack.common.types import SolverStatus
    from dstack.policies.planning import load_for_planning, plan_for
    from dstack.policies.schedule import build_schedule
    from optimizer.cli import draw_gantt, format_plan

    cfg, profiles = load_for_planning(args.config, args.profiles, say=print)
    plan = plan_for(cfg, profiles)
    print(format_plan(plan))
    if cfg.rate_headroom:
        print(f"(rates include rate_headroom {cfg.rate_headroom:g}: planned for "
              f"{1 + cfg.rate_headroom:g} x rate_rps)")
    if args.json:
        Path(args.json).write_text(json.dumps(plan.to_dict(), indent=1) + "\n")
    if args.plot and plan.models:
        dev = next(iter(profiles.values())).device
        backend = CpuSlices(tuple(range(dev.units))) if dev.kind == "cpu" else None
        draw_gantt(plan, args.plot, build_schedule(plan, backend))
        print(f"schedule drawn in {args.plot}")
    return 1 if plan.status is SolverStatus.INFEASIBLE else 0


def _cmd_profile(args: argparse.Namespace) -> int:
    """Measure this machine's profiles of the config's models into the `profiles: auto`
    cache (those missing or incomplete; all with --force); print where and a table."""
    import logging

    from dstack.common.config import load_config
    from dstack.policies import auto_profiles

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = load_config(args.config)
    if args.time_limit < 0:
        from dstack.common.config import ConfigError

        raise ConfigError(f"--time-limit {args.time_limit:g}: give seconds >= 0 (0: none)")
    directory, profiles = auto_profiles.resolve(cfg, config=args.config, force=args.force,
                                                time_limit_s=args.time_limit)
    print(f"profiles of this machine ({directory.name}) in {directory}")
    print(auto_profiles.format_table(profiles))
    if cfg.profiles not in (None, "auto"):
        print(f"note: {args.config} names `profiles: {cfg.profiles}`; the server uses these "
              "only with `profiles: auto` (or no `profiles:` under spatial and dstack)")
    return 0


def _cmd_mig_advise(args: argparse.Namespace) -> int:
    from dstack.mig_cli import mig_advise_command

    return mig_advise_command(args)


def _cmd_cluster(args: argparse.Namespace) -> int:
    from dstack.cluster.cli import cluster_command

    return cluster_command(args)


def _cmd_simulate(args: argparse.Namespace) -> int:
    if args.nodes is not None:  # a fleet (docs/cluster.md)
        from dstack.cluster.cli import simulate_nodes_command

        return simulate_nodes_command(args)
    from dstack.simulate.cli import simulate_command

    return simulate_command(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dstack", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="start the inference server")
    s.add_argument("--config", required=True, help="deployment YAML file")
    s.add_argument("--host", default=None, help="override server.host")
    s.add_argument("--port", type=int, default=None, help="override server.port")
    s.add_argument("--grpc-port", type=int, default=None,
                   help="override server.grpc_port (the gRPC endpoint; 0: off)")
    s.add_argument("--allow-client-shm", action="store_true", default=None,
                   help="turn server.allow_client_shm on (Triton's system and CUDA "
                        "shared-memory extensions, for clients on this host)")
    s.set_defaults(func=_cmd_serve)

    pr = sub.add_parser("profile", help="measure this machine's profiles of a config's models "
                        "(the `profiles: auto` cache) ahead of serving")
    pr.add_argument("--config", required=True, help="deployment YAML file")
    pr.add_argument("--force", action="store_true",
                    help="measure every model again, even those already in the cache")
    pr.add_argument("--time-limit", type=float, default=0.0,
                    help="stop measuring after this many seconds (default 0: no limit)")
    pr.set_defaults(func=_cmd_profile)

    m = sub.add_parser("models", help="list the model zoo")
    m.set_defaults(func=_cmd_models)

    pl = sub.add_parser("plan", help="solve batch sizes, slices and the cycle for a config")
    pl.add_argument("--config", required=True, help="deployment YAML file")
    pl.add_argument("--profiles", default=None, help="profile directory (default: config's)")
    pl.add_argument("--json", default=None, help="also write the plan as JSON here")
    pl.add_argument("--plot", default=None, help="draw the schedule as a Gantt chart (PNG)")
    pl.set_defaults(func=_cmd_plan)

    sim = sub.add_parser("simulate", help="replay a workload against policies on a virtual clock")
    sim.add_argument("--config", required=True, help="deployment YAML (models, SLOs, rate_rps)")
    sim.add_argument("--profiles", default=None,
                     help="profile directory (default: the config's `profiles:`)")
    sim.add_argument("--workload", default="poisson",
                     help="poisson | burst:x2@60s+30s[:model] | ramp:0.5..2 | trace:FILE.csv | "
                     "replay:TIMESTAMPS.csv[:compress=10][:superpose=2] | bursty[:compress=10] "
                     "(docs/simulator.md)")
    sim.add_argument("--policies", default="dstack,temporal,shared,spatial",
                     help="comma-separated policies to compare")
    sim.add_argument("--duration", default="600s", help="simulated time, e.g. 600s, 10m")
    sim.add_argument("--seed", type=int, default=1, help="random seed of the workload")
    sim.add_argument("--worker-start", default="5s",
                     help="how long a worker takes to start: a dstack re-plan that moves "
                     "workers must be worth that long (the server weighs its own, from its "
                     "log's 'worker ... ready in'); 0: re-plans are free")
    sim.add_argument("--plot", default=None, help="write a timeline + latency-CDF PNG here")
    sim.add_argument("--plot-window", default="300ms",
                     help="how much of the run's start the timeline shows")
    sim.add_argument("--nodes", type=int, default=None,
                     help="a fleet of N such devices: placement + every node's policy, against "
                     "the Ray Serve way (docs/cluster.md)")
    sim.add_argument("--node-memory-mb", type=float, default=None,
                     help="with --nodes: each device's memory (default: 81559 cuda, 16384 cpu)")
    sim.set_defaults(func=_cmd_simulate)

    from dstack.mig_cli import add_mig_parser

    add_mig_parser(sub, _cmd_mig_advise)

    from dstack.cluster.cli import add_cluster_parser

    add_cluster_parser(sub, _cmd_cluster)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from dstack.common.config import ConfigError
    from dstack.common.types import ProfileError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ConfigError, ProfileError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `dstack models | head`: the reader left; no traceback
        if args.func is _cmd_serve:
            raise  # a server's own broken pipe is a fault, not a reader leaving
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor one at exit's flush
        return 141  # as a shell reports a process killed by SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
