"""`dstack simulate`: flags (defined in `dstack.cli`) -> `simulate()` -> the report
table (and a plot)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from dstack.common.config import ConfigError, PolicyName, load_config
from dstack.policies.planning import planning_profiles
from dstack.simulate.engine import COMPILED
from dstack.simulate.report import format_per_model, format_table
from dstack.simulate.simulation import simulate
from dstack.simulate.workload import WorkloadError, generate, parse_duration


def simulate_command(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    if args.profiles is not None:
        cfg = cfg.model_copy(update={"profiles": Path(args.profiles).resolve()})
    try:
        policies = [PolicyName(p.strip()) for p in args.policies.split(",") if p.strip()]
    except ValueError:
        raise ConfigError(
            f"--policies {args.policies!r}: choose from {', '.join(p.value for p in PolicyName)}"
        ) from None
    try:
        duration = parse_duration(args.duration)
        window = parse_duration(args.plot_window)
        arrivals = generate(args.workload, {m.name: m.rate_rps for m in cfg.models}, duration,
                            args.seed)
    except WorkloadError as e:
        raise ConfigError(str(e)) from None
    try:
        start_s = parse_duration(args.worker_start)
    except WorkloadError as e:
        raise ConfigError(f"--worker-start: {e}") from None
    cfg, profiles = planning_profiles(cfg, args.config, say=print)
    started = time.perf_counter()
    sim = simulate(cfg, profiles, arrivals, policies, duration,
                   timeline_s=window if args.plot else 0.0, start_s=start_s)
    wall = time.perf_counter() - started
    print(f"workload {args.workload}, {duration:g} s, seed {args.seed}: "
          f"{arrivals.times.size} requests; ideal bound {sim.ideal_rps:.1f} rps "
          f"(fluid bound at the nominal rates {sim.fluid_rps:.1f} rps)")
    print(format_table(sim.reports))
    if "dstack" in sim.results:
        n = sim.results["dstack"].replans
        print(f"\ndstack: {n} re-plan{'' if n == 1 else 's'} (each weighed against a worker "
              f"start of {start_s:g} s, --worker-start)")
    print()
    print("goodput per model (rps within SLO):")
    print(format_per_model(sim.reports))
    print(f"\nsimulated in {wall:.1f} s")
    if not COMPILED:
        print("(the event loop ran as Python, several times slower: the install found no C "
              "compiler; install gcc and run `pip install -e .` again to compile it)")
    if args.plot:
        from dstack.simulate.plot import plot

        plot(sim.results, {m.name: m.slo_ms for m in cfg.models}, args.plot, window)
        print(f"plot written to {args.plot}")
    return 0
