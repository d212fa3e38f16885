"""Set up each policy exactly as the server would (`dstack.policies.planning.setup_policy`) and run
it through the same arrivals; compute the ideal bound once for all of them."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dstack.common.config import ConfigError, DeployConfig, PolicyName
from dstack.common.slices import CpuSlices, MpsSlices, SliceBackend
from dstack.common.types import Profile
from dstack.policies.contract import Policy
from dstack.policies.latency import LinearLatency
from dstack.policies.planning import PolicySetup, replan, setup_policy
from dstack.runtime.adapt import tracker_for, trigger_for
from dstack.simulate.engine import RunResult, SimModel, run
from dstack.simulate.ideal import TraceModel, cost_per_request_s, fluid_bound, trace_bound_rps
from dstack.simulate.latency import latency_table_s
from dstack.simulate.report import PolicyReport, failed, summarise
from dstack.simulate.workload import Arrivals


@dataclass(frozen=True, slots=True)
class Simulation:
    reports: list[PolicyReport]
    results: dict[str, RunResult]  # policies that ran
    ideal_rps: float  # the bound for these arrivals (dstack.simulate.ideal)
    fluid_rps: float  # the bound for the nominal rates
    costs_s: dict[str, float]  # device-seconds per request at best, per model
    wall_s: dict[str, tuple[float, float]]  # policy -> (setup incl. solve, event loop)


class SimReplanner:
    """The server's re-planning (`dstack.runtime.replanner`) on the virtual clock: the same
    rate tracker, trigger and `replan`, with the workers (replicas) it started with.
    `start_s`: how long a worker takes to start, which a re-plan that moves workers must
    be worth (the server measures its own; the switch itself is instant here)."""

    def __init__(self, cfg: DeployConfig, backend: SliceBackend,
                 profiles: Mapping[str, Profile], setup: PolicySetup,
                 start_s: float = 0.0) -> None:
        self.cfg, self.backend, self.profiles, self.setup = cfg, backend, profiles, setup
        self.start_s = {w: start_s for w in setup.policy.slices()} if start_s else {}
        self.since = 0.0  # when the plan in force was put in force
        self.period_s = cfg.adapt.sample_s
        self.names = [m.name for m in cfg.models]
        self.rates = tracker_for(cfg)
        self.rates.sample(0.0)  # the first window starts at 0
        self.trigger = trigger_for(cfg)
        self.seen = [0] * len(self.names)

    def sample(self, now: float, arrived: list[int]) -> tuple[
            Policy, dict[str, tuple[float, list[float]]], dict[str, LinearLatency]] | None:
        for k, name in enumerate(self.names):
            self.rates.record(name, now, arrived[k] - self.seen[k])
        self.seen = list(arrived)
        rates = self.rates.sample(now)
        if not self.trigger.should_replan(now, rates, self.rates.noise()):
            return None
        rates = self.trigger.plan_rates(now, rates)
        decided = replan(self.cfg, self.backend, self.setup, origin=now, rates=rates,
                         profiles=dict(self.profiles),
                         horizon_s=(now - self.since if self.cfg.adapt.weigh_switch
                                    else float("inf")),
                         start_s=self.start_s)
        setup = decided.setup
        if setup is None:  # the plan in force is as good, or the switch not yet worth it
            if decided.pending:
                self.trigger.deferred(now)
            else:
                self.trigger.planned(now, rates)
            return None
        self.trigger.planned(now, rates)
        self.setup, self.since = setup, now
        slices = setup.policy.slices()
        workers = {m.name: (slices[m.name].percent,
                            latency_table_s(setup.profiles[m.name], slices[m.name].percent,
                                            m.max_batch_size))
                   for m in setup.run_cfg.models}
        return setup.policy, workers, setup.estimates


def backend_for(profiles: Mapping[str, Profile]) -> SliceBackend:
    """The slice backend of the simulated device: the profiles' device (all must agree).
    CPU profiles: one core per unit; anything else: MPS percentages over its SMs."""
    devices = {(p.device.kind, p.device.name, p.device.units) for p in profiles.values()}
    if len(devices) != 1:
        raise ConfigError(f"the profiles come from different devices: {sorted(devices)}")
    kind, _, units = devices.pop()
    if kind == "cpu":
        return CpuSlices(cores=tuple(range(units)))
    return MpsSlices(units)


def simulate(cfg: DeployConfig, profiles: Mapping[str, Profile], arrivals: Arrivals,
             policies: Sequence[PolicyName], duration_s: float, *,
             timeline_s: float = 0.0, start_s: float = 0.0) -> Simulation:
    """Run every policy in `policies` on `arrivals` over [0, duration_s) (then drained).
    `start_s`: how long a worker takes to start, for `dstack`'s re-plans (`SimReplanner`).

    `profiles` are keyed by served model name (`dstack.policies.planning.served_profiles`). A policy
    that cannot be set up (no feasible plan, say) gets a report row with the reason."""
    profiles = dict(profiles)
    costs = {m.name: cost_per_request_s(profiles[m.name], m.slo_ms, m.max_batch_size)
             for m in cfg.models}
    extra = set(arrivals.names) - {m.name for m in cfg.models}
    if extra:
        raise ConfigError(f"the workload names models the config does not serve: "
                          f"{', '.join(sorted(extra))}")
    ideal = trace_bound_rps([TraceModel(arrivals.times_of(m.name), m.slo_ms, profiles[m.name],
                                        m.max_batch_size) for m in cfg.models], duration_s)
    fluid = fluid_bound(costs, {m.name: m.rate_rps for m in cfg.models})
    order = {n: i for i, n in enumerate(arrivals.names)}
    remap = [order[m.name] for m in cfg.models]
    # Arrivals may name the models in another order than the config: re-index once.
    pos = {arr_i: cfg_i for cfg_i, arr_i in enumerate(remap)}
    times = arrivals.times.tolist()
    idx = [pos[i] for i in arrivals.models.tolist()] if remap != list(range(len(remap))) \
        else arrivals.models.tolist()
    backend = backend_for(profiles)
    reports: list[PolicyReport] = []
    results: dict[str, RunResult] = {}
    wall: dict[str, tuple[float, float]] = {}
    for name in policies:
        t0 = time.perf_counter()
        pcfg = cfg.model_copy(update={"policy": PolicyName(name)})
        try:
            setup = setup_policy(pcfg, backend, origin=0.0, profiles=profiles)
        except ConfigError as e:
            reports.append(failed(str(name), str(e), ideal))
            continue
        slices = setup.policy.slices()
        models = [
            SimModel(m.name, m.slo_ms / 1000, m.max_batch_size, m.max_queue,
                     slices[m.name].percent,
                     latency_table_s(setup.profiles[m.name], slices[m.name].percent,
                                     m.max_batch_size))
            for m in setup.run_cfg.models
        ]
        replanner = None
        if pcfg.policy is PolicyName.DSTACK and pcfg.adapt.enabled:
            replanner = SimReplanner(pcfg, backend, profiles, setup, start_s)
        t1 = time.perf_counter()
        r = run(setup.policy, models, times, idx, duration_s, estimates=setup.estimates,
                timeline_s=timeline_s, served=[m.name for m in cfg.models],
                groups=setup.groups(), replanner=replanner)
        wall[str(name)] = (t1 - t0, time.perf_counter() - t1)
        results[str(name)] = r
        reports.append(summarise(str(name), r, ideal))
    return Simulation(reports, results, ideal, fluid, costs, wall)
