"""The sweep: every model x slice x batch size, one fresh child process per slice.

Measured cells already in the output file are kept (an interrupted sweep resumes) unless
`force`; the file is rewritten after every cell, atomically, so it is always loadable. Its
grid (`batch_sizes` x `percentages`) is the part that is complete; cells measured beyond it
stay in `cells` until the rest of their percentage arrives; `measured["complete"]` says
whether everything asked for is there.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dstack.common.types import Cell, DeviceInfo, Profile, ProfileError, load_profile
from knee_profiler.knee import knee_max_curvature, knees
from knee_profiler.messages import CellResult, ChildDone, ChildError, MeasureRequest, decode
from knee_profiler.slices import Slice, SliceMechanism, cpu_name, make_mechanism

REPO_ROOT = Path(__file__).resolve().parents[1]


class ProfilerError(RuntimeError):
    """The sweep cannot go on: a child failed, the existing file is for another device..."""


@dataclass(frozen=True, slots=True)
class SweepConfig:
    """What to measure and where to write it (`out_dir/<model>.json`)."""

    models: tuple[str, ...]
    device: str  # "cpu" | "cuda"
    batch_sizes: tuple[int, ...]
    percentages: tuple[float, ...]
    out_dir: Path
    warmup: int = 5
    repeats: int = 20
    epsilon: float = 0.10
    force: bool = False
    mechanism: str | None = None  # default: the device's default mechanism
    start_mps: bool = False
    seed: int = 0
    child_timeout_s: float = 3600.0
    timing: str = "graph"  # CUDA: "graph" (replays of a captured forward) | "eager"
    dtype: str = "fp32"
    min_time_s: float = 0.2  # graph timing: more samples for short forwards...
    max_repeats: int = 200  # ... up to this many

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("no models to profile")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch sizes must be >= 1, got {self.batch_sizes}")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError(f"need repeats >= 1, warmup >= 0 (got {self.repeats}, {self.warmup})")
        if self.epsilon < 0:
            raise ValueError(f"epsilon must be >= 0, got {self.epsilon}")
        if self.timing not in ("graph", "eager"):
            raise ValueError(f"timing must be graph or eager, got {self.timing!r}")
        if self.dtype not in ("fp32", "fp16", "bf16"):
            raise ValueError(f"dtype must be fp32, fp16 or bf16, got {self.dtype!r}")


@dataclass
class SweepReport:
    paths: dict[str, Path] = field(default_factory=dict)
    measured_cells: int = 0  # cells measured by this run
    kept_cells: int = 0  # cells found in the files and kept
    children: int = 0  # measuring processes started
    failed: list[str] = field(default_factory=list)  # "model batch b at p%: error"


# --------------------------------------------------------------------------- state


@dataclass
class _Acc:
    """Everything known so far of one model's profile (existing file + this run)."""

    model: str
    mechanism: str
    epsilon: float
    device: DeviceInfo | None = None
    cells: dict[tuple[int, float], Cell] = field(default_factory=dict)
    batch_sizes: set[int] = field(default_factory=set)
    percentages: set[float] = field(default_factory=set)
    memory_mb: dict[int, float] = field(default_factory=dict)
    measured: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_profile(cls, p: Profile, epsilon: float) -> _Acc:
        acc = cls(p.model, p.mechanism, epsilon, p.device)
        acc.cells = {(c.batch, float(c.percent)): c for c in p.cells}
        acc.batch_sizes = set(p.batch_sizes) | {c.batch for c in p.cells}
        acc.percentages = set(p.percentages) | {float(c.percent) for c in p.cells}
        acc.memory_mb = dict(p.memory_mb)
        acc.measured = dict(p.measured)
        return acc

    def profile(self) -> Profile:
        """The profile of what is complete so far."""
        failed = {int(b) for b in self.measured.get("failed", {})}
        batches = sorted(self.batch_sizes - failed)
        pcts = sorted(
            p for p in self.percentages if all((b, p) in self.cells for b in batches)
        )
        curves = {b: {p: self.cells[(b, p)].p50_ms for p in pcts} for b in batches}
        measured = dict(self.measured)
        measured["complete"] = not failed and len(pcts) == len(self.percentages)
        measured["knee_max_curvature"] = {
            str(b): knee_max_curvature(c) for b, c in curves.items() if c
        }
        assert self.device is not None
        return Profile(
            model=self.model,
            device=self.device,
            mechanism=self.mechanism,
            batch_sizes=tuple(batches),
            percentages=tuple(pcts),
            cells=tuple(self.cells[k] for k in sorted(self.cells)),
            epsilon=self.epsilon,
            knee=knees(curves, self.epsilon) if pcts else {},
            memory_mb={b: self.memory_mb[b] for b in sorted(self.memory_mb)},
            measured=measured,
            provenance=f"measured by knee-profiler ({self.mechanism}) on {self.device.name}",
        )


def _load_existing(path: Path, cfg: SweepConfig, mechanism: str) -> _Acc | None:
    if cfg.force or not path.exists():
        return None
    try:
        old = load_profile(path)
    except ProfileError as e:
        raise ProfilerError(f"{e}; fix or remove it, or pass --force to start afresh") from e
    if old.mechanism != mechanism or old.device.kind != cfg.device:
        raise ProfilerError(
            f"{path} holds a {old.device.kind}/{old.mechanism} profile, this sweep is "
            f"{cfg.device}/{mechanism}: use another --out or --force"
        )
    return _Acc.from_profile(old, cfg.epsilon)


def _check_device(acc: _Acc, dev: DeviceInfo, path: Path) -> None:
    if acc.device is None:
        acc.device = dev
    elif (acc.device.name, acc.device.units) != (dev.name, dev.units):
        raise ProfilerError(
            f"{path} was measured on {acc.device.name} ({acc.device.units} "
            f"{acc.device.unit_kind}), this is {dev.name} ({dev.units} {dev.unit_kind}): "
            "use another --out or --force"
        )


# --------------------------------------------------------------------------- children


def child_command() -> list[str]:
    return [sys.executable, "-m", "knee_profiler._measure"]


def run_child(
    req: MeasureRequest,
    extra_env: dict[str, str],
    on_cell: Callable[[CellResult], None],
    timeout_s: float,
    command: Sequence[str] = (),
) -> ChildDone:
    """Start one measuring child in its slice (`command`, default `child_command()`);
    `on_cell` for every batch it reports. Raises ProfilerError with the child's own
    message (or its stderr tail) when it fails."""
    env = {**os.environ, **extra_env}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    env["PYTHONUNBUFFERED"] = "1"
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            list(command) or child_command(),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env, text=True,
        )
        done: ChildDone | None = None
        failure: str | None = None
        try:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(req.to_json())
            proc.stdin.close()
            for line in proc.stdout:
                if not line.strip():
                    continue
                msg = decode(line)
                if isinstance(msg, CellResult):
                    on_cell(msg)
                elif isinstance(msg, ChildDone):
                    done = msg
                elif isinstance(msg, ChildError):
                    failure = msg.message
            proc.wait(timeout=timeout_s)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if done is None:
            err.seek(0)
            tail = err.read()[-3000:]
            why = failure or f"exited with {proc.returncode} without a result"
            raise ProfilerError(
                f"{req.model} at {req.percent:g}% ({req.mechanism}): {why}\n{tail}".rstrip()
            )
    return done


# --------------------------------------------------------------------------- sweep


def sweep(
    cfg: SweepConfig,
    *,
    progress: bool = True,
    mechanism: SliceMechanism | None = None,
    child: Sequence[str] = (),
) -> SweepReport:
    """Measure every missing cell of every model and write `out_dir/<model>.json`.

    `mechanism` replaces the one named in `cfg`; `child` the measuring command (tests use
    a fake that speaks the same protocol). Raises ProfilerError when a child fails; the
    cells measured until then are saved.
    """
    mech = mechanism or make_mechanism(cfg.device, cfg.mechanism, start_daemon=cfg.start_mps)
    slices = sorted(mech.plan(cfg.percentages), key=lambda s: -s.percent)  # 100% first
    percent_map = {f"{r:g}": s.percent for s in slices for r in s.requested}
    batches = sorted(set(cfg.batch_sizes))
    report = SweepReport()
    # CPU: the device is known here. CUDA: from the first child at 100% (a child in a
    # smaller MPS slice sees only its SMs), an existing file, or a probe child.
    device: DeviceInfo | None = None
    if cfg.device == "cpu":
        device = DeviceInfo("cpu", cpu_name(), len(getattr(mech, "cores", ())), "cores")

    accs: dict[str, _Acc] = {}
    todo: list[tuple[str, Slice, list[int]]] = []
    for model in cfg.models:
        path = cfg.out_dir / f"{model}.json"
        report.paths[model] = path
        acc = _load_existing(path, cfg, mech.name)
        if acc is None:
            acc = _Acc(model, mech.name, cfg.epsilon)
        else:
            device = device or acc.device
            for b in batches:  # failed before (e.g. out of memory): try again
                acc.measured.get("failed", {}).pop(str(b), None)
        accs[model] = acc
        for s in slices:
            need = [b for b in batches if (b, s.percent) not in acc.cells]
            report.kept_cells += len(batches) - len(need)
            if need:
                todo.append((model, s, need))
    for acc in accs.values():
        if acc.device is not None and device is not None:
            _check_device(acc, device, report.paths[acc.model])

    bar = _progress_bar(sum(len(n) for _, _, n in todo), progress)
    try:
        if todo:
            mech.open()
            if device is None and todo[0][1].percent < 100:
                device = _probe_device(cfg, mech, todo[0][0], child)
        # One child per slice measures every model that needs it: one CUDA context and
        # one MPS client per slice, children strictly one after another.
        for sl in slices:
            group = [(accs[m], need) for m, s2, need in todo if s2 is sl]
            if not group:
                continue
            bar.set_postfix_str(f"{len(group)} models @ {sl.percent:g}%")
            device = _measure_slice(
                group, sl, cfg, mech, device, percent_map, report, bar, child
            )
    finally:
        bar.close()
        mech.close()
    for model, acc in accs.items():
        acc.batch_sizes.update(batches)
        acc.percentages.update(s.percent for s in slices)
        if acc.device is not None:
            acc.profile().save(report.paths[model])
    return report


def _measure_slice(
    group: list[tuple[_Acc, list[int]]], s: Slice, cfg: SweepConfig, mech: SliceMechanism,
    device: DeviceInfo | None, percent_map: dict[str, float], report: SweepReport,
    bar: Any, child: Sequence[str],
) -> DeviceInfo | None:
    """One child measuring the `need`ed batch sizes of each model in `group` in slice `s`;
    saves after every cell. Returns the device, learnt from the child if not known yet."""
    by_model = {acc.model: acc for acc, _ in group}
    for acc, need in group:
        if acc.device is None and device is not None:
            acc.device = device
        acc.epsilon = cfg.epsilon
        acc.batch_sizes.update(need)
        acc.percentages.add(s.percent)
        _start_measured(acc, cfg, mech.name, percent_map)
    first, need0 = group[0]
    req = MeasureRequest(
        first.model, cfg.device, mech.name, s.percent, s.units, tuple(need0),
        cfg.warmup, cfg.repeats, cfg.seed, mech.slice_args(s),
        per_model={acc.model: list(need) for acc, need in group} if len(group) > 1 else {},
        timing=cfg.timing, dtype=cfg.dtype, min_time_s=cfg.min_time_s,
        max_repeats=cfg.max_repeats,
    )

    def on_cell(r: CellResult) -> None:
        bar.update(1)
        acc = by_model.get(r.model or first.model)
        if acc is None:
            return
        if r.error:
            acc.measured.setdefault("failed", {})[str(r.batch)] = f"at {s.percent:g}%: {r.error}"
            report.failed.append(f"{acc.model} batch {r.batch} at {s.percent:g}%: {r.error}")
            return
        report.measured_cells += 1
        _add_cell(acc, r, s)
        if r.method:
            methods = acc.measured.setdefault("timing_methods", {})
            methods[r.method] = methods.get(r.method, 0) + 1
        if acc.device is not None:
            acc.profile().save(report.paths[acc.model])

    done = run_child(req, mech.child_env(s), on_cell, cfg.child_timeout_s, child)
    report.children += 1
    if device is None and done.units_total > 0:
        device = DeviceInfo(cfg.device, done.device_name, done.units_total, done.unit_kind)
    if device is None:
        raise ProfilerError(f"{first.model}: the child at {s.percent:g}% could not tell the "
                            "device's size; include 100 in --percentages")
    info = dict(done.slice_info)
    weights = info.pop("weights_mb", {})
    for acc, _ in group:
        path = report.paths[acc.model]
        if done.device_name != device.name:
            raise ProfilerError(f"{path}: measured on {device.name}, the child ran on "
                                f"{done.device_name}: use another --out or --force")
        _check_device(acc, device, path)
        acc.measured.setdefault("slices", {})[f"{s.percent:g}"] = info
        w = weights.get(acc.model, done.weights_mb) if isinstance(weights, dict) else 0.0
        acc.measured["weights_mb"] = round(w, 3)
        acc.measured["torch"] = done.torch_version
        acc.profile().save(path)
    return device


def _probe_device(
    cfg: SweepConfig, mech: SliceMechanism, model: str, child: Sequence[str]
) -> DeviceInfo:
    """A child at 100% that measures nothing, only to learn the whole device's size."""
    (full,) = mech.plan([100.0])
    req = MeasureRequest(model, cfg.device, mech.name, 100.0, full.units, (), 0, 1,
                         cfg.seed, mech.slice_args(full))
    done = run_child(req, mech.child_env(full), lambda r: None, cfg.child_timeout_s, child)
    return DeviceInfo(cfg.device, done.device_name, done.units_total, done.unit_kind)


def _add_cell(acc: _Acc, r: CellResult, s: Slice) -> None:
    exact = [q for q in s.requested if q == s.percent]
    acc.cells[(r.batch, s.percent)] = Cell(
        batch=r.batch,
        percent=s.percent,
        p50_ms=round(r.p50_ms, 4),
        p95_ms=round(max(r.p95_ms, r.p50_ms), 4),
        requested_percent=exact[0] if exact else max(s.requested),
        units=r.units if r.units is not None else s.units,
    )
    acc.memory_mb[r.batch] = round(max(acc.memory_mb.get(r.batch, 0.0), r.memory_mb), 3)


def _start_measured(
    acc: _Acc, cfg: SweepConfig, mechanism: str, percent_map: dict[str, float]
) -> None:
    m = acc.measured
    m.update(
        tool="knee-profiler",
        repeats=cfg.repeats,
        warmup=cfg.warmup,
        seed=cfg.seed,
        timer=_timer(cfg),
        dtype=cfg.dtype,
        statistic="p50/p95 over repeats, per batch size and slice",
        memory=(
            "torch.cuda.max_memory_allocated (weights+inputs+activations)"
            if cfg.device == "cuda"
            else "RSS growth while running the batch (inputs+activations; weights excluded)"
        ),
        percent_map={**m.get("percent_map", {}), **percent_map},
        date=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        python=platform.python_version(),
        host_loadavg_at_start=[round(x, 2) for x in os.getloadavg()],
    )
    m.setdefault("mechanism_detail", _mechanism_detail(mechanism))


def _timer(cfg: SweepConfig) -> str:
    if cfg.device != "cuda":
        return "perf_counter_ns"
    if cfg.timing == "graph":
        return (
            "cuda-graph-replay: forward captured once per batch size (torch.cuda.graph), "
            "replays queued back to back with a CUDA event between each, one sync; "
            f"at least {cfg.repeats} replays, more up to {cfg.max_repeats} until "
            f"{cfg.min_time_s:g} s; eager fallback per cell in timing_methods"
        )
    return "cuda-events around each eager forward, synchronised after each"


def _mechanism_detail(mechanism: str) -> str:
    return {
        "cpu-affinity": "each slice a fresh process pinned to the first k cores "
        "(sched_setaffinity) with torch.set_num_threads(k), k = ceil(p/100 x cores)",
        "mps": "each slice a fresh process with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=p, "
        "checked to be a client of an MPS server",
    }.get(mechanism, mechanism)


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="cell", desc="knee sweep", dynamic_ncols=True)


def expressible_percentages(device: str = "cpu") -> list[float]:
    """Every distinct slice the CPU can express here (100·k/n for k = 1..n cores)."""
    if device != "cpu":
        raise ValueError("only the CPU has a fixed set of expressible slices")
    n = len(os.sched_getaffinity(0))
    return [round(100.0 * k / n, 6) for k in range(1, n + 1)]


__all__ = [
    "ProfilerError",
    "SweepConfig",
    "SweepReport",
    "expressible_percentages",
    "sweep",
]
