"""`dstack mig-advise`: a MIG layout for a config, beside its MPS plan and no partitioning.

The advisor's models are built from the config and its knee profiles as the lane planner
builds them (`dstack.policies.lane_planning`: candidate batches, p50 + `LATENCY_MARGIN`,
unknown rates guessed, rates grown by `rate_headroom` for the tie-break), so the three
figures are one score on one scale: the MIG plan (`optimizer.mig.advise`), the `dstack`
policy's lane plan on MPS slices (`plan_lanes`, what `dstack plan` prints) and the
temporal assignment (every model taking turns on the whole GPU) that plan is compared with.
Nothing here runs a command: the `nvidia-smi` lines are printed for a person to run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dstack.common.config import ConfigError, DeployConfig
from dstack.common.types import Priority, Profile
from dstack.policies.lane_planning import LATENCY_MARGIN, plan_lanes
from dstack.simulate.latency import latency_ms
from optimizer.lanes import LaneModel, candidate_batches, planning_latency
from optimizer.mig import CONTEXT_MB, MAX_SHARE, Group, MigChoice, MigModel, advise, alone
from optimizer.mig_layouts import MigDataError, MigGpu, MigProfile, describe, load_gpu


@dataclass(frozen=True, slots=True)
class Baseline:
    name: str
    value: float  # weighted goodput (rps), the same score as the MIG plan's
    served_rps: float  # requests/s within SLO, unweighted
    detail: str


@dataclass(frozen=True, slots=True)
class MigReport:
    gpu: MigGpu
    extra: bool
    profiles_device: str
    models: tuple[MigModel, ...]
    choice: MigChoice
    alone: tuple[tuple[Group | None, ...], ...]  # [model][kind]: each model alone
    alone_p50_ms: tuple[tuple[float, ...], ...]  # [model][kind]: p50 at the smallest batch
    mps: Baseline | None
    temporal: Baseline | None
    commands: tuple[str, ...]
    notes: tuple[str, ...]

    @property
    def kinds(self) -> list[MigProfile]:
        return [p for p in self.gpu.profiles if self.extra or not p.extra]


def mig_models(cfg: DeployConfig, profiles: dict[str, Profile]) -> list[MigModel]:
    grow = 1.0 + cfg.rate_headroom
    out = []
    for m in cfg.models:
        prof = profiles[m.name]
        rate = m.rate_rps
        if rate <= 0:  # unknown: a device's worth of its smallest batch (as plan_lanes)
            b0 = min(prof.batch_sizes)
            rate = 1000.0 * b0 / prof.latency_ms(b0, max(prof.percentages))
        lane = LaneModel(m.name, m.slo_ms, rate, m.priority.weight,
                         candidate_batches(prof, m.max_batch_size),
                         planning_latency(prof, margin=LATENCY_MARGIN),
                         low=m.priority is Priority.LOW, grown_rps=grow * rate)
        mem = tuple(sorted((int(b), float(v)) for b, v in prof.memory_mb.items()))
        out.append(MigModel(lane, mem))
    return out


def mig_report(cfg: DeployConfig, profiles: dict[str, Profile], gpu_key: str, *,
               extra: bool = False, max_share: int = MAX_SHARE,
               context_mb: float = CONTEXT_MB) -> MigReport:
    try:
        gpu = load_gpu(gpu_key)
    except MigDataError as e:
        raise ConfigError(str(e)) from None
    devices = {(p.device.kind, p.device.name, p.mechanism) for p in profiles.values()}
    if any(kind == "cpu" for kind, _, _ in devices):
        raise ConfigError("mig-advise needs GPU profiles (MPS percentages); these were "
                          "measured on a CPU")
    models = mig_models(cfg, profiles)
    choice = advise(models, gpu, extra=extra, max_share=max_share, context_mb=context_mb)
    kinds = [p for p in gpu.profiles if extra or not p.extra]
    p50 = tuple(
        tuple(latency_ms(profiles[m.name], m.lane.batches[0], gpu.percent(k)) for k in kinds)
        for m in models)
    notes = [f"a Kg instance is predicted as an MPS slice of K/7 of the SMs (3g = "
             f"{100 * 3 / 7:.1f}%), rounded down to a profiled percentage; MIG also splits "
             f"memory bandwidth and L2, which MPS profiles do not measure (docs/mig.md)"]
    names = sorted({name for _, name, _ in devices})
    notes.append(f"profiles measured on {', '.join(names)}; the MPS and temporal figures are "
                 f"for that device")
    if not any(_same_family(gpu_key, n) for n in names):
        notes.append(f"--gpu {gpu_key} is not the profiled device: the prediction assumes "
                     f"its SMs run as fast as the profiled ones")
    if not any(m.memory_points for m in models):
        notes.append("the profiles record no memory: only the SLO limits the assignment")
    mps, temporal = _baselines(cfg, profiles)
    return MigReport(gpu, extra, ", ".join(names), tuple(models), choice,
                     tuple(tuple(row) for row in alone(models, gpu, extra=extra,
                                                       context_mb=context_mb)),
                     p50, mps, temporal, commands(choice), tuple(notes))


def _same_family(gpu_key: str, device_name: str) -> bool:
    chip, mem = gpu_key.split("-")
    name = device_name.lower().replace(" ", "")
    return chip in name and mem in name


def _baselines(cfg: DeployConfig, profiles: dict[str, Profile]
               ) -> tuple[Baseline | None, Baseline | None]:
    plan, _, ref = plan_lanes(cfg, profiles, None)
    lanes = getattr(plan, "lanes", ())
    detail = " | ".join(f"{ln.percent:.1f}% {'+'.join(ln.models)}" for ln in lanes)
    mps = Baseline("MPS lane plan (dstack plan)", plan.objective,
                   sum(m.served_rps for m in plan.models), detail)
    temporal = None
    if ref.temporal is not None:
        t = ref.temporal
        temporal = Baseline("no partitioning (temporal)", t.value,
                            sum(s for e in t.lanes for s in e.served_rps),
                            "every model takes turns on 100%")
    return mps, temporal


def commands(choice: MigChoice, gpu_index: int = 0) -> tuple[str, ...]:
    """The nvidia-smi lines that create the layout (profile:start, so placement is exact)."""
    spec = ",".join(f"{inst.profile.name}:{inst.start}" for inst in choice.layout)
    i = gpu_index
    return (
        f"sudo nvidia-smi -i {i} -mig 1",
        f"sudo nvidia-smi mig -i {i} -dci; sudo nvidia-smi mig -i {i} -dgi",
        f"sudo nvidia-smi mig -i {i} -cgi {spec} -C",
        "nvidia-smi -L",
    )


def _planned(report: MigReport) -> float:
    return sum(m.lane.rate_rps for m in report.models)


def format_report(r: MigReport) -> str:
    c = r.choice
    gpu = r.gpu
    head = (f"MIG advice for {gpu.key} ({gpu.name}): {c.layouts} valid layouts"
            f"{' (with the 2-slice 1g profiles)' if r.extra else ''}, {len(r.models)} models")
    proof = "proven optimal" if c.proven_optimal else "best found, not proven optimal"
    lines = [head, f"best layout: {describe(c.layout)}   (weighted goodput {c.value:.1f} rps; "
                   f"{proof}; {c.solve_time_s:.2f} s)", ""]
    row = (f"{'instance':12s} {'SMs':>6s} {'memory':>7s}  {'model':20s} {'batch':>5s} "
           f"{'latency':>9s} {'goodput/rate rps':>18s} {'SLO':>7s} {'mem MB':>7s}")
    lines += [row, "-" * len(row)]
    for inst, g in zip(c.layout, c.groups, strict=True):
        left = f"{str(inst):12s} {gpu.percent(inst.profile):5.1f}% {inst.profile.memory_gb:5g}GB"
        if g is None:
            lines.append(f"{left}  (idle)")
            continue
        for k, i in enumerate(g.members):
            m = r.models[i].lane
            ev = g.eval
            rate = f"{ev.served_rps[k]:.0f} / {m.rate_rps:.0f}"
            mem = r.models[i].memory_mb(ev.caps[k])
            lines.append(f"{left if k == 0 else ' ' * len(left)}  {m.name:20s} {ev.caps[k]:5d} "
                         f"{ev.lat_ms[k]:6.2f} ms {rate:>18s} {m.slo_ms:4g} ms {mem:7.0f}")
    placed = c.placed()
    for i, m in enumerate(r.models):
        if i not in placed and i not in dict(c.unfit):
            lines.append(f"{'-':12s} {'':6s} {'':7s}  {m.name:20s} (no instance left: not served)")
    lines += ["", "predicted goodput (weighted rps within SLO; served / planned rps):"]
    planned = _planned(r)
    served = sum(s for g in c.groups if g for s in g.eval.served_rps)
    rows = [("MIG, this layout", c.value, served, describe(c.layout))]
    for b in (r.mps, r.temporal):
        if b is not None:
            rows.append((b.name, b.value, b.served_rps, b.detail))
    for name, v, s, detail in rows:
        lines.append(f"  {name:30s} {v:9.1f}   {s:8.1f} / {planned:.1f}   {detail}")
    ratios = [f"MIG / {b.name.split(' (')[0]} {c.value / b.value:.2f}x"
              for b in (r.mps, r.temporal) if b is not None and b.value > 0]
    if ratios:
        lines.append("  " + "; ".join(ratios))
    lines += ["", "each model alone on one instance (batch-1 p50 ms | best batch -> goodput rps):"]
    kinds = r.kinds
    lines.append(f"  {'model':20s}" + "".join(f" {k.name:>20s}" for k in kinds))
    for i, m in enumerate(r.models):
        cells = []
        for j, _ in enumerate(kinds):
            g = r.alone[i][j]
            tail = "no memory" if g is None else f"b{g.eval.caps[0]} -> {g.eval.served_rps[0]:.0f}"
            cells.append(f" {f'{r.alone_p50_ms[i][j]:.2f} | {tail}':>20s}")
        lines.append(f"  {m.name:20s}" + "".join(cells))
    if c.unfit:
        lines += ["", "fits no instance:"] + [f"  {why}" for _, why in c.unfit]
    lines += ["", "create the layout (printed, not run: root, an idle GPU; -i is the GPU index):"]
    lines += [f"  {cmd}" for cmd in r.commands]
    lines.append("  then start each model's worker with CUDA_VISIBLE_DEVICES=<its MIG UUID>")
    lines += [""] + [f"note: {n}" for n in r.notes]
    return "\n".join(lines)


def report_dict(r: MigReport) -> dict[str, Any]:
    c = r.choice
    instances = []
    for inst, g in zip(c.layout, c.groups, strict=True):
        members = []
        if g is not None:
            for k, i in enumerate(g.members):
                members.append({
                    "model": r.models[i].name, "batch": g.eval.caps[k],
                    "latency_ms": g.eval.lat_ms[k], "served_rps": g.eval.served_rps[k],
                    "rate_rps": r.models[i].lane.rate_rps, "slo_ms": r.models[i].lane.slo_ms,
                    "fraction_within_slo": g.eval.fraction[k],
                    "memory_mb": r.models[i].memory_mb(g.eval.caps[k])})
        instances.append({"profile": inst.profile.name, "start": inst.start,
                          "percent": r.gpu.percent(inst.profile),
                          "memory_gb": inst.profile.memory_gb, "models": members,
                          "memory_used_mb": g.memory_mb if g else 0.0})
    placed = c.placed()
    kinds = r.kinds
    return {
        "gpu": r.gpu.key,
        "valid_layouts": c.layouts,
        "layout": describe(c.layout),
        "instances": instances,
        "weighted_goodput_rps": c.value,
        "proven_optimal": c.proven_optimal,
        "solve_time_s": c.solve_time_s,
        "unserved": [r.models[i].name for i in range(len(r.models))
                     if i not in placed and i not in dict(c.unfit)],
        "fits_no_instance": [{"model": r.models[i].name, "reason": why} for i, why in c.unfit],
        "baselines": {
            key: None if b is None else {"weighted_goodput_rps": b.value,
                                         "served_rps": b.served_rps, "detail": b.detail}
            for key, b in (("mps", r.mps), ("temporal", r.temporal))},
        "alone": {
            m.name: {k.name: {"batch1_p50_ms": r.alone_p50_ms[i][j],
                              "batch": None if g is None else g.eval.caps[0],
                              "served_rps": 0.0 if g is None else g.eval.served_rps[0]}
                     for j, (k, g) in enumerate(zip(kinds, r.alone[i], strict=True))}
            for i, m in enumerate(r.models)},
        "commands": list(r.commands),
        "notes": list(r.notes),
    }
