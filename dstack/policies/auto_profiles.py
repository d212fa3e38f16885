"""`profiles: auto`: knee profiles measured on this very machine, cached per device.

A profile belongs to the device it was measured on. The committed CPU profiles came from
an Intel Xeon about 3x faster than a 2-core AMD EPYC the server also runs on; planned
with them there, the policies counted on latencies a third of the real ones and refused
most requests under load (issue 63). `auto` plans with profiles measured here:

- the cache is `$DSTACK_PROFILE_CACHE`, else `$XDG_CACHE_HOME/dstack-serve/profiles` (by
  default `~/.cache/dstack-serve/profiles`), and in it one directory per device
  (`device_dir_name`: `cpu-amd-epyc-7b13-2cores`, `cuda-nvidia-h100-80gb-hbm3-mps`), one
  `<zoo model>.json` per model, as `knee-profiler profile --out` writes them;
- a served model with no complete profile there is measured at start-up by a short knee
  sweep (`AUTO_*` below), bounded by `profile_time_limit_s`, and saved for the next start;
- `dstack plan` / `dstack simulate` read the same cache and never measure: a model
  missing there is an error that names `dstack profile --config FILE`, which measures
  ahead of time.

Imports run one way: this module needs `dstack.common` only, and imports `knee_profiler`
(which imports `dstack.common`, never the server) lazily, to measure.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from dstack.common.config import (
    PROFILED_POLICIES,
    ConfigError,
    DeployConfig,
    DeviceKind,
    ModelConfig,
)
from dstack.common.slices import available_cores
from dstack.common.types import Profile, ProfileError, load_profile

if TYPE_CHECKING:
    from dstack.common.slices import SliceBackend
    from knee_profiler.slices import SliceMechanism

log = logging.getLogger("dstack.profiles")

#: Environment variable naming the cache's root directory.
CACHE_ENV = "DSTACK_PROFILE_CACHE"

# The start-up sweep. It runs before the server is ready, so it is the least that plans
# well, not what `knee-profiler profile` would measure for a paper:
#: Batch sizes on a CPU (capped by the model's max_batch_size): the ones the committed CPU
#: profiles have; the planner interpolates between them and a CPU batch above 8 is seldom
#: worth its latency. Each costs (warmup + repeats) forwards per slice, and batch 8 is
#: most of the time (resnet18: ~1 s a forward on one core of the 2-core EPYC).
AUTO_CPU_BATCH_SIZES = (1, 2, 4, 8)
#: Batch sizes on a GPU (capped by max_batch_size): a GPU's knee moves with the batch.
AUTO_CUDA_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
#: MPS percentages on a GPU: five slices (one measuring process each, a CUDA context and
#: a model load apiece) instead of the ten of the committed H100 profiles; a lane on a
#: slice between two is planned with the smaller one's latency (conservative).
AUTO_CUDA_PERCENTAGES = (20.0, 40.0, 60.0, 80.0, 100.0)
#: A CPU slice is a number of cores: every count up to this many cores is measured, on a
#: bigger CPU this many counts spread from 1 to all (each is a measuring process, and the
#: planner rounds a slice down to a measured one).
AUTO_MAX_CPU_SLICES = 8
#: Forwards run before timing, per batch size: the first of a new input shape lets oneDNN
#: create its primitives and allocates; after it the times settle (on the 2-core EPYC,
#: resnet18 at batch 1 on one core read 139 ms with one warm-up, 146 ms with two, against
#: 134-140 ms timed in-process over many runs).
AUTO_WARMUP = 1
#: Timed forwards per cell: the planner reads the p50, and the median of five stands two
#: slow samples (the p95 of five is about their slowest: rough, and no plan reads it).
#: Each forward more costs a second on a 2-core EPYC (resnet18 at batch 8 on one core):
#: the default config's first start there was ready after 48-56 s (three runs; 57.6 s
#: with two warm-ups), the sweep 35-42 s of it, torch's import in its two processes ~16 s.
AUTO_REPEATS = 5


class MissingProfiles(ConfigError):
    """`profiles: auto` where this machine's cache lacks a model's profile and measuring
    is not allowed here (`dstack plan`, `dstack simulate`)."""


# --------------------------------------------------------------------------- the device


def wants_auto(cfg: DeployConfig) -> bool:
    """Whether `cfg` plans with this machine's cached profiles: `profiles: auto`, or no
    `profiles:` under a policy that plans with profiles."""
    return cfg.profiles == "auto" or (cfg.profiles is None and cfg.policy in PROFILED_POLICIES)


def cache_root() -> Path:
    """`$DSTACK_PROFILE_CACHE`, else `$XDG_CACHE_HOME/dstack-serve/profiles` (by default
    `~/.cache/dstack-serve/profiles`)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "dstack-serve" / "profiles"


_NOISE = {"r", "tm", "c", "cpu", "processor"}


def slug(text: str) -> str:
    """A device name as a directory name: lower case, words joined by `-`, trademarks
    and the words cpu/processor dropped ("AMD EPYC 7B13 64-Core Processor" ->
    "amd-epyc-7b13-64-core")."""
    words = [w for w in re.split(r"[^a-z0-9]+", text.lower()) if w and w not in _NOISE]
    return "-".join(words)[:64].strip("-") or "unknown"


def device_dir_name(kind: str, name: str, units: int = 0, mechanism: str | None = None,
                    dtype: str | None = None) -> str:
    """The cache directory of a device: kind, name and (CPU) core count, plus the slice
    mechanism of a GPU and a dtype other than fp32 (`cpu-amd-epyc-7b13-2cores`,
    `cuda-nvidia-h100-80gb-hbm3-mps`)."""
    parts = [kind, slug(name)]
    if kind == "cpu":
        parts.append(f"{units}core" if units == 1 else f"{units}cores")
    elif mechanism:
        parts.append(slug(mechanism))
    if dtype and dtype != "fp32":
        parts.append(dtype)
    return "-".join(parts)


@dataclass(frozen=True, slots=True)
class ThisDevice:
    """The device the server's workers run on, as a profile names it."""

    kind: str  # "cpu" | "cuda"
    name: str  # the CPU's model name / the GPU's name
    mechanism: str  # the slice mechanism: "cpu-affinity" | "mps"
    cores: tuple[int, ...] = ()  # CPU: the cores the workers may use
    dtype: str = "fp32"

    @property
    def units(self) -> int:
        return len(self.cores)

    @property
    def dir_name(self) -> str:
        return device_dir_name(self.kind, self.name, self.units, self.mechanism, self.dtype)


@functools.cache
def cpu_name() -> str:
    from knee_profiler.slices import cpu_name as name

    return name()


@functools.cache
def gpu_name() -> str:
    """The name of the GPU the workers get (the first of CUDA_VISIBLE_DEVICES), as
    torch's `get_device_name` says it, without a CUDA context in this process:
    `nvidia-smi`, else a child process with torch. ConfigError when neither tells."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip() or "0"
    tries = [["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", visible],
             [sys.executable, "-c",
              "import torch; print(torch.cuda.get_device_name(0))"]]
    for cmd in tries:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
        except (OSError, subprocess.SubprocessError):
            continue
        lines = [ln.strip() for ln in done.stdout.splitlines() if ln.strip()]
        if lines:
            return lines[0]
    raise ConfigError("profiles: auto on device cuda needs the GPU's name, and neither "
                      "nvidia-smi nor torch could tell it; give `profiles:` a directory")


def this_device(cfg: DeployConfig, backend: SliceBackend | None = None) -> ThisDevice:
    """This machine's device for `cfg`: on a CPU the cores the workers may use (the
    backend's, else `cores:`, else all this process may use), on CUDA the GPU's name."""
    if cfg.device is DeviceKind.CUDA:
        return ThisDevice("cuda", gpu_name(), "mps")
    cores = tuple(getattr(backend, "cores", ()) or cfg.cores or available_cores())
    return ThisDevice("cpu", cpu_name(), "cpu-affinity", cores)


def cache_dir(cfg: DeployConfig, backend: SliceBackend | None = None) -> Path:
    """Where `profiles: auto` keeps the profiles of this machine's device for `cfg`."""
    return cache_root() / this_device(cfg, backend).dir_name


# --------------------------------------------------------------------------- what to measure


@dataclass(frozen=True, slots=True)
class Grid:
    """What the start-up sweep measures of one model."""

    batch_sizes: tuple[int, ...]
    percentages: tuple[float, ...]  # ascending


def core_counts(n: int) -> list[int]:
    """The CPU slices measured on `n` cores: each count up to `AUTO_MAX_CPU_SLICES`
    cores, else that many spread from 1 to `n`."""
    if n <= AUTO_MAX_CPU_SLICES:
        return list(range(1, n + 1))
    k = AUTO_MAX_CPU_SLICES
    return sorted({1, n, *(max(1, round(i * n / k)) for i in range(1, k + 1))})


def grid_for(here: ThisDevice, max_batch_size: int) -> Grid:
    if here.kind == "cpu":
        n = here.units
        pcts = tuple(round(100.0 * k / n, 6) for k in core_counts(n))
        base = AUTO_CPU_BATCH_SIZES
    else:
        pcts, base = AUTO_CUDA_PERCENTAGES, AUTO_CUDA_BATCH_SIZES
    return Grid(tuple(b for b in base if b <= max_batch_size) or (1,), pcts)


def grids(cfg: DeployConfig, here: ThisDevice) -> dict[str, Grid]:
    """Per zoo model served (aliases once, at their largest max_batch_size)."""
    most: dict[str, int] = {}
    for m in cfg.models:
        most[m.zoo] = max(most.get(m.zoo, 0), m.max_batch_size)
    return {zoo: grid_for(here, b) for zoo, b in most.items()}


def covers(prof: Profile, grid: Grid, here: ThisDevice) -> bool:
    """Whether `prof` was measured on `here` and has every cell of `grid`: each batch
    size measured, or tried and failed (out of memory: the profile leaves it out, as the
    planner must), on each slice."""
    if not _same_device(prof, here) or not prof.batch_sizes:
        return False
    tried = set(prof.batch_sizes) | {int(b) for b in prof.measured.get("failed", {})}
    return (set(grid.batch_sizes) <= tried
            and all(any(math.isclose(p, q) for q in prof.percentages)
                    for p in grid.percentages))


def _custom(cfg: DeployConfig, zoo: str) -> ModelConfig | None:
    """A served model of zoo name `zoo` that is not the zoo's model (torchscript, builder)."""
    for m in cfg.models:
        if m.zoo == zoo and (m.torchscript is not None or m.builder is not None):
            return m
    return None


def _read(path: Path) -> Profile | None:
    try:
        return load_profile(path)
    except ProfileError:
        return None


# --------------------------------------------------------------------------- resolving


def resolve(cfg: DeployConfig, *, backend: SliceBackend | None = None, measure: bool = True,
            config: str | Path | None = None, time_limit_s: float | None = None,
            force: bool = False, child: Sequence[str] = ()) -> tuple[Path, dict[str, Profile]]:
    """This machine's cache directory for `cfg` and a profile there for each served zoo
    model (keyed by zoo name). A model whose profile is missing or incomplete is measured
    (`measure`) within `time_limit_s` seconds (None: the config's `profile_time_limit_s`;
    0: no limit), else MissingProfiles names `dstack profile --config` (with `config`,
    the file). `force`: measure every model afresh. `child` replaces the measuring
    command (tests)."""
    here = this_device(cfg, backend)
    directory = cache_root() / here.dir_name
    want = grids(cfg, here)
    have: dict[str, Profile] = {}
    todo: dict[str, Grid] = {}
    for zoo, grid in want.items():
        path = directory / f"{zoo}.json"
        prof = None if force else _read(path)
        if prof is not None and covers(prof, grid, here):
            have[zoo] = prof
        else:
            todo[zoo] = grid
    if not todo:
        return directory, have
    if not measure:
        cmd = f"dstack profile --config {config}" if config else "dstack profile --config FILE"
        raise MissingProfiles(
            f"profiles: auto: no complete profile of {', '.join(sorted(todo))} measured on "
            f"this machine ({here.dir_name}) in {directory}; measure them first with "
            f"`{cmd}` (plan and simulate do not measure)")
    for zoo in todo:
        custom = _custom(cfg, zoo)
        if custom is not None:
            raise ConfigError(
                f"models.{custom.name}: profiles: auto measures zoo models only, and this one "
                "is served from `torchscript`/`builder`; profile it with knee-profiler and "
                f"save it as {directory / f'{zoo}.json'}, or give `profiles:` a directory")
    limit = cfg.profile_time_limit_s if time_limit_s is None else time_limit_s
    mps_env = None
    if here.kind == "cuda" and backend is not None:  # the server's daemon
        mps_env = {**os.environ, **backend.worker_env()}
    measure_profiles(here, directory, todo, time_limit_s=limit if limit > 0 else None,
                     force=force, child=child, mps_env=mps_env)
    for zoo, grid in todo.items():
        prof = _read(directory / f"{zoo}.json")
        if prof is None or not covers(prof, grid, here):
            raise ConfigError(f"profiles: auto: measuring {zoo} on {here.dir_name} left no "
                              f"complete profile in {directory}")
        have[zoo] = prof
    return directory, have


def measure_profiles(here: ThisDevice, directory: Path, todo: dict[str, Grid], *,
                     time_limit_s: float | None, force: bool = False,
                     child: Sequence[str] = (), mps_env: dict[str, str] | None = None) -> None:
    """Measure `todo` (zoo model -> grid) on `here` into `directory`: one knee sweep per
    slice, the whole device first, each a fresh measuring process that measures every
    model of the slice (importing torch and torchvision alone takes such a process ~8 s
    on a 2-core EPYC: one per model and slice would double the first start) and adds its
    cells to each model's file (a sweep interrupted, by the time limit say, goes on from
    there next time). One log line per slice, naming its models. ConfigError when the time
    limit is reached (the measuring process is killed at it) or a measurement fails.
    `mps_env`: the environment that reaches the server's MPS daemon (else one is found or
    started for the sweep)."""
    from knee_profiler.sweep import ProfilerError, SweepConfig, child_command, sweep

    directory.mkdir(parents=True, exist_ok=True)
    for zoo in todo:  # a file a sweep could not go on from (another device, corrupt)
        path = directory / f"{zoo}.json"
        if path.exists() and (force or not _same_device(_read(path), here)):
            if not force:
                log.warning("profiles: auto: %s is not a profile of %s; measuring afresh",
                            path, here.dir_name)
            path.unlink()
    slices = sorted({p for g in todo.values() for p in g.percentages}, reverse=True)
    steps: list[tuple[int, float, tuple[int, ...], tuple[str, ...]]] = []
    for i, pct in enumerate(slices, 1):
        groups: dict[tuple[int, ...], list[str]] = {}  # models of one grid share a process
        for zoo, grid in todo.items():
            if any(math.isclose(pct, q) for q in grid.percentages):
                groups.setdefault(grid.batch_sizes, []).append(zoo)
        steps += [(i, pct, b, tuple(zoos)) for b, zoos in groups.items()]
    started = time.monotonic()
    timeout = shutil.which("timeout")
    mech = _mechanism(here, mps_env)
    mech.open()  # once for every step (an MPS daemon), not per sweep
    try:
        for i, pct, batches, zoos in steps:
            names = ", ".join(zoos)
            left = (None if time_limit_s is None
                    else time_limit_s - (time.monotonic() - started))
            if left is not None and left <= 0:
                _over_limit(here, directory, names, pct, time_limit_s)
            what = (f"{round(pct * here.units / 100)} of {here.units} cores"
                    if here.kind == "cpu" else f"{pct:g}% MPS")
            log.info("profiling %s on %s: slice %d/%d (%s), batch sizes %s ...", names,
                     here.dir_name, i, len(slices), what, ",".join(map(str, batches)))
            cmd = list(child) or child_command()
            if left is not None and timeout:  # the hard bound: the child killed at the limit
                cmd = [timeout, "--kill-after=5", f"{max(1.0, left):.1f}", *cmd]
            cfg = SweepConfig(models=zoos, device=here.kind, batch_sizes=batches,
                              percentages=(pct,), out_dir=directory, warmup=AUTO_WARMUP,
                              repeats=AUTO_REPEATS, mechanism=here.mechanism,
                              dtype=here.dtype)
            try:
                sweep(cfg, progress=False, mechanism=_Held(mech), child=cmd)
            except ProfilerError as e:
                if time_limit_s is not None and time.monotonic() - started >= time_limit_s - 1:
                    _over_limit(here, directory, names, pct, time_limit_s)
                raise ConfigError(f"profiles: auto: measuring {names} on {here.dir_name} "
                                  f"failed: {e}") from e
    finally:
        mech.close()
    log.info("profiled %s on %s in %.1f s; saved in %s", ", ".join(todo), here.dir_name,
             time.monotonic() - started, directory)


def _mechanism(here: ThisDevice, mps_env: dict[str, str] | None) -> SliceMechanism:
    from knee_profiler.slices import CpuAffinity, make_mechanism

    if here.kind == "cpu":
        return CpuAffinity(cores=here.cores)
    from knee_profiler import mps

    env = dict(mps_env if mps_env is not None else os.environ)
    return make_mechanism("cuda", here.mechanism, base_env=env,
                          start_daemon=not mps.daemon_answers(env))


class _Held:
    """A mechanism opened and closed by `measure_profiles`, once, not by each sweep."""

    def __init__(self, mech: SliceMechanism) -> None:
        self._mech = mech

    def __getattr__(self, name: str) -> Any:
        return getattr(self._mech, name)

    def open(self) -> None:
        pass

    def close(self) -> None:
        pass


def _same_device(prof: Profile | None, here: ThisDevice) -> bool:
    return prof is not None and (prof.device.kind, prof.device.name, prof.mechanism) == (
        here.kind, here.name, here.mechanism) and (here.kind != "cpu"
                                                   or prof.device.units == here.units)


def _over_limit(here: ThisDevice, directory: Path, zoo: str, pct: float,
                limit: float | None) -> NoReturn:
    msg = (f"profiles: auto: measuring stopped at its time limit (profile_time_limit_s: "
           f"{limit:g} s) on {here.dir_name} before {zoo} at {pct:g}% was done; what was "
           f"measured is kept in {directory} and the next start goes on from there. Raise "
           "profile_time_limit_s, or measure ahead with `dstack profile --config FILE` "
           "(no time limit)")
    log.error(msg)
    raise ConfigError(msg)


# --------------------------------------------------------------------------- explicit profiles


_warned: set[tuple[str, ...]] = set()


def warn_other_device(cfg: DeployConfig, profiles: dict[str, Profile],
                      backend: SliceBackend | None = None) -> str | None:
    """One warning line (once per process and set of profiles) when profiles given as a
    directory were measured on another device name than this machine's; the line, or
    None. Their latencies may be off by the ratio of the two machines' speeds."""
    try:
        here = cpu_name() if cfg.device is DeviceKind.CPU else gpu_name()
    except ConfigError:
        return None
    other: dict[str, list[str]] = {}
    for name, prof in profiles.items():
        if prof.device.name != here:
            other.setdefault(prof.device.name, []).append(name)
    if not other:
        return None
    key = (str(cfg.profiles), here, *sorted(f"{d}:{m}" for d, ms in other.items() for m in ms))
    if key in _warned:
        return None
    _warned.add(key)
    theirs = "; ".join(f"{d} ({', '.join(ms)})" for d, ms in other.items())
    line = (f"profiles in {cfg.profiles} were measured on {theirs}, but this machine is "
            f"{here}: their latencies may not fit it; `profiles: auto` measures here")
    log.warning(line)
    return line


def format_table(profiles: dict[str, Profile]) -> str:
    """p50 ms per batch size on the whole device (each profile's largest slice), a row
    per model."""
    batches = sorted({b for p in profiles.values() for b in p.batch_sizes})
    lines = ["p50 ms per batch on the whole device:",
             f"{'model':24s}" + "".join(f"{f'batch {b}':>10s}" for b in batches)]
    for name, prof in sorted(profiles.items()):
        full = max(prof.percentages)
        cells = [f"{prof.latency_ms(b, full):10.1f}" if b in prof.batch_sizes else f"{'-':>10s}"
                 for b in batches]
        lines.append(f"{name:24s}" + "".join(cells))
    return "\n".join(lines)
