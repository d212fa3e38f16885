"""Turn a deployment config (+ profiles, + measured rates) into a ready policy object.

Used by the runtime at start-up and on every re-plan, and by the simulator, so both run
exactly the same policy for the same inputs.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from dstack.common.config import ConfigError, DeployConfig, PolicyName, load_config
from dstack.common.slices import SliceBackend
from dstack.common.types import Plan, Priority, Profile, Schedule, load_profiles, scaled
from dstack.policies import auto_profiles
from dstack.policies.baseline_params import knee_percent, temporal_batch
from dstack.policies.contract import ModelParams, Policy
from dstack.policies.lane_planning import backend_of, gap_lanes, plan_lanes, predicted_goodput
from dstack.policies.lane_policy import LanePlan
from dstack.policies.latency import LinearLatency
from dstack.policies.registry import make_policy
from dstack.policies.replicas import (
    SEP,
    choose,
    expand,
    public_name,
    replica_groups,
    split_rates,
    wanted,
)


@dataclass(frozen=True, slots=True)
class PolicySetup:
    policy: Policy
    plan: Plan | None
    schedule: Schedule | None
    profiles: dict[str, Profile]  # keyed by worker name (a replica: `dstack.policies.replicas`)
    estimates: dict[str, LinearLatency]  # seeded from the profiles, at each worker's slice
    run_cfg: DeployConfig  # the config the workers run: `cfg` with its replicas and guests
    replicas: dict[str, int]  # served model -> its number of workers
    # guest worker -> the worker whose queue it serves on another lane (`dstack` only)
    guests: dict[str, str] = field(default_factory=dict)

    def groups(self) -> dict[str, tuple[str, ...]]:
        """Served model -> its workers (replicas, then guests), where more than one."""
        out = {m: list(ws) for m, ws in replica_groups(self.replicas).items()}
        for g, h in self.guests.items():
            m = public_name(h)
            out.setdefault(m, [m]).append(g)
        return {m: tuple(ws) for m, ws in out.items() if len(ws) > 1}


def model_params(cfg: DeployConfig) -> dict[str, ModelParams]:
    return {
        m.name: ModelParams(m.name, m.max_batch_size, m.max_queue_delay_ms / 1000, m.slo_ms / 1000,
                            m.batching)
        for m in cfg.models
    }


def served_profiles(cfg: DeployConfig, *, check_device: bool = True, measure: bool = True,
                    backend: SliceBackend | None = None) -> dict[str, Profile]:
    """Profiles keyed by served name (a served alias uses its zoo model's profile).

    `profiles: auto` (and no `profiles:` under spatial or dstack): this machine's cached
    profiles, a missing one measured first (`measure`; else MissingProfiles,
    `dstack.policies.auto_profiles`). A directory: its profiles; with `check_device`, one
    of another device kind is an error and one of another device name a warning (once).
    `backend`: the slices the workers get (its cores name the CPU device)."""
    if auto_profiles.wants_auto(cfg):
        _, by_zoo = auto_profiles.resolve(cfg, backend=backend, measure=measure)
        return {m.name: by_zoo[m.zoo] for m in cfg.models}
    if cfg.profiles is None or cfg.profiles == "auto":
        return {}
    by_model = load_profiles(cfg.profiles)
    out: dict[str, Profile] = {}
    for m in cfg.models:
        prof = by_model.get(m.name) or by_model.get(m.zoo)
        if prof is None:
            raise ConfigError(
                f"models.{m.name}: no profile in {cfg.profiles} "
                f"(have {', '.join(sorted(by_model))}); make one with: "
                f"knee-profiler profile {m.zoo} --device {cfg.device.value} --out {cfg.profiles}"
                " (or use `profiles: auto`)"
            )
        if check_device and prof.device.kind != cfg.device.value:
            raise ConfigError(
                f"models.{m.name}: profile was measured on {prof.device.kind} "
                f"({prof.device.name}) but this server runs on {cfg.device.value}; profile the "
                f"model on this device, or use `dstack simulate` for other devices"
            )
        out[m.name] = prof
    if check_device:
        auto_profiles.warn_other_device(cfg, out, backend)
    return out


def planning_profiles(cfg: DeployConfig, config: str | Path, *,
                      say: Callable[[str], None] | None = None
                      ) -> tuple[DeployConfig, dict[str, Profile]]:
    """`cfg` and its profiles for planning only (`dstack plan`, `dstack simulate`, `dstack
    mig-advise`); they may come from another device. No `profiles:`, or `auto`: this
    machine's cache, never measured here (MissingProfiles names `dstack profile --config
    FILE`); `say` is told where it is. The config returned names the directory."""
    if cfg.profiles is None or cfg.profiles == "auto":
        auto = cfg.model_copy(update={"profiles": "auto"})
        directory, by_zoo = auto_profiles.resolve(auto, measure=False, config=config)
        if say is not None:
            say(f"profiles: auto -> {directory} (this machine's, {directory.name})")
        cfg = cfg.model_copy(update={"profiles": directory})
        return cfg, {m.name: by_zoo[m.zoo] for m in cfg.models}
    return cfg, served_profiles(cfg, check_device=False)


def load_for_planning(config: str | Path,
                      profiles_dir: str | Path | None = None, *,
                      say: Callable[[str], None] | None = None
                      ) -> tuple[DeployConfig, dict[str, Profile]]:
    """A config and its profiles for planning only (`planning_profiles`): `profiles_dir`
    overrides the config's `profiles:`."""
    cfg = load_config(config)
    if profiles_dir:
        cfg = cfg.model_copy(update={"profiles": Path(profiles_dir)})
    return planning_profiles(cfg, config, say=say)


def plan_for(cfg: DeployConfig, profiles: dict[str, Profile],
             backend: SliceBackend | None = None) -> Plan:
    """The `dstack` policy's lane plan for the config's models at their configured
    `rate_rps`, each grown by `rate_headroom`, on `backend` (default: the profiles'
    device), with the replicas the server would start. Never raises for a mix it cannot
    serve whole: a model no lane can serve is left out and named (status INFEASIBLE), the
    rest are planned."""
    if backend is None:
        backend = backend_of(profiles)
    run = expand(cfg, replica_counts(cfg, profiles, backend))
    return plan_lanes(run, _replica_profiles(run, profiles), backend)[0]


def replica_counts(cfg: DeployConfig, profiles: dict[str, Profile],
                   backend: SliceBackend) -> dict[str, int]:
    """How many workers each model gets under the `dstack` policy: the replica counts whose
    lane plan predicts the most goodput (`dstack.policies.replicas`)."""
    min_pct = 100.0 / backend.total_units if backend.kind == "cpu" else 0.0

    def plan(counts: dict[str, int]) -> LanePlan:
        run = expand(cfg, counts)
        return plan_lanes(run, _replica_profiles(run, profiles), backend)[0]

    low = [m for m in cfg.models if m.priority is Priority.LOW]
    fills = low if len(low) < len(cfg.models) else []  # low ones only fill gaps: below
    candidates = {m: r for m, r in wanted(cfg, profiles, min_pct).items()
                  if m not in {f.name for f in fills}}
    counts = choose(cfg, candidates, lambda c: plan(c).objective)
    if fills:  # gap fillers: a worker per lane they fit
        planned = plan(counts)
        for m in fills:
            counts[m.name] = max(1, min(m.max_replicas, gap_lanes(planned, profiles[m.name])))
    return counts


def _replica_profiles(run_cfg: DeployConfig,
                      profiles: dict[str, Profile]) -> dict[str, Profile]:
    return {m.name: profiles[public_name(m.name)] for m in run_cfg.models}


def add_guests(run_cfg: DeployConfig, plan: LanePlan, borrow_lanes: int,
               guests: Mapping[str, str] | None = None) -> tuple[DeployConfig, dict[str, str]]:
    """`run_cfg` with the guest workers of each planned worker (`borrow_lanes` each, at
    most one fewer than the plan's lanes; `guests`: a re-plan keeps the ones it has), and
    the guest -> host map. A guest is a copy of its host's entry named `host#gK`. (A model
    loaded at run time gets none: its workers start beside the ones there are.)"""
    if guests is None:
        k = min(borrow_lanes, len(plan.lanes) - 1)
        fill = {m for lane in plan.lanes for m in lane.fill}
        planned = [m for lane in plan.lanes for m in lane.models if m not in fill]
        guests = {f"{h}{SEP}g{i}": h for h in planned for i in range(1, k + 1)}
    by_name = {m.name: m for m in run_cfg.models}
    guests = {g: h for g, h in guests.items() if h in by_name}  # not an unloaded model's
    if not guests:
        return run_cfg, {}
    extra = [by_name[h].model_copy(update={"name": g, "zoo_name": by_name[h].zoo,
                                           "rate_rps": 0.0})
             for g, h in guests.items()]
    return run_cfg.model_copy(update={"models": [*run_cfg.models, *extra]}), dict(guests)


def setup_policy(cfg: DeployConfig, backend: SliceBackend, *, origin: float,
                 rates: dict[str, float] | None = None,
                 profiles: dict[str, Profile] | None = None,
                 replicas: dict[str, int] | None = None,
                 guests: dict[str, str] | None = None) -> PolicySetup:
    """The policy for `cfg` on `backend`. `rates`: measured rates per served model (a
    re-plan; default the configured ones). `replicas`: workers per model, fixed (a re-plan
    keeps the workers it has); default: chosen here for `dstack`, one for the others.
    `guests`: the same for the `dstack` policy's guest workers (`add_guests`)."""
    if profiles is None:
        profiles = served_profiles(cfg, backend=backend)
    if backend.kind == "cpu":  # a server given fewer cores than were profiled
        profiles = {k: p.on_cores(backend.total_units) for k, p in profiles.items()}
    counts = {m.name: 1 for m in cfg.models}
    if cfg.policy is PolicyName.DSTACK and profiles:
        counts = dict(replicas) if replicas is not None else replica_counts(cfg, profiles,
                                                                            backend)
    run_cfg = expand(cfg, counts)
    if run_cfg is not cfg:
        profiles = _replica_profiles(run_cfg, profiles)
        rates = split_rates(rates, counts)
    cfg = run_cfg
    params = model_params(cfg)
    plan = schedule = None
    knees: dict[str, float] = {}
    tbatch: dict[str, int] = {}
    guest_map: dict[str, str] = {}
    if cfg.policy is PolicyName.DSTACK:
        plan, schedule, _ = plan_lanes(cfg, profiles, backend, rates)
        if isinstance(plan, LanePlan):
            run_cfg, guest_map = add_guests(run_cfg, plan, cfg.borrow_lanes, guests)
            if guest_map:
                profiles = _replica_profiles(run_cfg, profiles)
                params = model_params(run_cfg)
    elif cfg.policy is PolicyName.SPATIAL:
        knees = {m.name: knee_percent(profiles[m.name], m.max_batch_size) for m in cfg.models}
    elif cfg.policy is PolicyName.TEMPORAL and profiles:
        tbatch = {
            m.name: temporal_batch(profiles[m.name], m.slo_ms, len(cfg.models), m.max_batch_size)
            for m in cfg.models
        }
    policy = make_policy(cfg.policy, params, backend, plan=plan, schedule=schedule,
                         knees=knees, temporal_batch=tbatch, origin=origin,
                         reuse_idle=cfg.reuse_idle, guests=guest_map)
    # Seed the latency model from the profile at the worker's slice where there is one.
    slices = policy.slices()
    estimates: dict[str, LinearLatency] = {}
    for name, prof in profiles.items():
        pct = min(max(prof.percentages), max(slices[name].percent, min(prof.percentages)))
        bs = sorted(prof.batch_sizes)
        if len(bs) >= 2:
            lat = LinearLatency.from_points(bs[0], prof.latency_ms(bs[0], pct) / 1000,
                                            bs[-1], prof.latency_ms(bs[-1], pct) / 1000)
            estimates[name] = lat
    policy.use_estimates(estimates)
    return PolicySetup(policy, plan, schedule, profiles, estimates, run_cfg, counts, guest_map)


def latency_ratios(setup: PolicySetup, measured: Mapping[str, tuple[int, float]]
                  ) -> dict[str, tuple[float, float, int]]:
    """Per served model with a profile: what its workers' batches took (`measured`, by
    worker: (items, seconds), at warm-up a batch of one, live the size their recent batches
    had), what the profile says for batches of those sizes at their slices (the estimates
    it seeded), and that size (the median over its workers of each)."""
    got: dict[str, list[tuple[float, float, int]]] = {}
    for worker, (n, seconds) in measured.items():
        est = setup.estimates.get(worker)
        if est is not None and seconds > 0:
            got.setdefault(public_name(worker), []).append((seconds, est.estimate_s(n), n))
    return {m: (statistics.median(s for s, _, _ in v), statistics.median(p for _, p, _ in v),
                int(statistics.median(n for _, _, n in v)))
            for m, v in got.items()}


def served_of(setup: PolicySetup) -> dict[str, Profile]:
    """The profiles `setup` planned with, by served model (a replica's are its model's):
    what a re-plan plans with, corrections included."""
    return {public_name(w): p for w, p in setup.profiles.items()}


def corrected_profiles(cfg: DeployConfig, profiles: Mapping[str, Profile],
                       ratios: Mapping[str, tuple[float, float, int]]
                       ) -> tuple[dict[str, Profile], dict[str, float]]:
    """`profiles` (by served model) with the latencies of each model whose warm-up
    disagrees with its profile by more than `cfg.profile_margin` scaled by measured /
    profiled (`latency_ratios`), and those factors (empty: none disagrees)."""
    if cfg.profile_margin is None:
        return dict(profiles), {}
    hi = 1 + cfg.profile_margin
    factors = {m: measured / profiled for m, (measured, profiled, _) in ratios.items()
               if m in profiles and not 1 / hi <= measured / profiled <= hi}
    return ({m: scaled(p, factors[m]) if m in factors else p
             for m, p in profiles.items()}, factors)


#: A re-plan replaces the plan in force only when it predicts more than this much more
#: goodput at the measured rates: every re-plan moves slices (shadow workers, a switch),
#: and in the simulator suite re-planning on every drift lost up to 11% on bursty mixes.
REPLAN_GAIN = 0.01


def start_share(backend: SliceBackend) -> float:
    """The share of the device's serving that a worker's start takes while it lasts: on a
    CPU a starting process (imports, weights, warm-up) keeps about one core busy, taken
    from the workers there; on a GPU it runs on the host's cores, beside the device."""
    return 1.0 / backend.total_units if backend.kind == "cpu" else 0.0


def switch_cost(current: PolicySetup, new: PolicySetup, backend: SliceBackend,
                goodput: float, start_s: Mapping[str, float]) -> float:
    """Requests that handing over from `current` to `new` is expected to lose: each worker
    whose slice changes starts a shadow, for as long as its last start took (`start_s`,
    by worker; the longest known for one never started), and each start takes
    `start_share` of the `goodput` served meanwhile."""
    longest = max(start_s.values(), default=0.0)
    starts = sum(start_s.get(w, longest) for w in moved_workers(current, new))
    return goodput * start_share(backend) * starts


def moved_workers(current: PolicySetup, new: PolicySetup) -> list[str]:
    """The workers of `new` that need a new process: a slice they did not have."""
    before = current.policy.slices()
    return [w for w, s in new.policy.slices().items() if before.get(w) != s]


@dataclass(frozen=True, slots=True)
class Replan:
    """What `replan` decided. `setup`: the plan to switch to (None: keep the one in force).
    `pending`: a better plan was found but is not worth starting its workers yet: ask
    again later, for the same rates."""

    setup: PolicySetup | None
    pending: bool = False


def replan(cfg: DeployConfig, backend: SliceBackend, current: PolicySetup, *, origin: float,
           rates: dict[str, float],
           profiles: dict[str, Profile] | None = None,
           horizon_s: float = float("inf"),
           start_s: Mapping[str, float] | None = None,
           correcting: bool = False) -> Replan:
    """The `dstack` policy re-planned for the measured `rates` (per served model) with the
    workers it has, and whether to switch to it. The plan in force is scored at those
    rates with its lanes and caps as they are (with `profiles`, the ones to plan with, by
    served model; default its own). The new plan is taken when it predicts more than
    `REPLAN_GAIN` more, and its gain over `horizon_s` (how long the plan in force has
    lasted: the new one is expected to last as long) outweighs `switch_cost` (`start_s`:
    how long each worker took to start). `correcting`: `profiles` correct the plan's own
    to what its batches take; a new plan that moves no worker is then taken whatever it
    gains (its caps and estimates fit the batches served)."""
    new = setup_policy(cfg, backend, origin=origin, rates=rates, profiles=profiles,
                       replicas=current.replicas, guests=current.guests)
    if not isinstance(current.plan, LanePlan) or new.plan is None:
        return Replan(new)
    if correcting and not moved_workers(current, new):
        return Replan(new)
    scored = (current.profiles if profiles is None
              else _replica_profiles(current.run_cfg, profiles))
    kept = predicted_goodput(current.plan, current.run_cfg, scored, backend,
                             split_rates(rates, current.replicas) or {})
    gain = new.plan.objective - kept
    if gain <= kept * REPLAN_GAIN:
        return Replan(None)
    cost = switch_cost(current, new, backend, kept, start_s or {})
    return Replan(new) if gain * horizon_s >= cost else Replan(None, pending=True)
