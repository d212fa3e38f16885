"""Slice mechanisms: how a measuring child is confined to a share of the device.

A mechanism has a parent side (map requested percentages to slices the device can really
express, the environment each child needs, set-up and tear-down such as an MPS daemon) and a
child side (`enter_slice`, run first thing in the fresh child). Adding a mechanism (e.g.
green contexts via `torch.cuda.green_contexts`, slices as SM counts) means one class here,
one entry in `_CHILD_ENTER` and one in `MECHANISMS`.

The parent side imports no torch: it must not create a CUDA context of its own.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from dstack.common.heap import keep_heap
from knee_profiler import mps


class SliceError(RuntimeError):
    """A slice cannot be made as asked (bad percent, no MPS daemon, ...)."""


@dataclass(frozen=True, slots=True)
class Slice:
    """One slice to measure in. `percent` is what the device really gives (requested ones
    rounded up); `requested` every requested percent mapped onto it; `units` the cores/SMs,
    None where the mechanism does not know them."""

    percent: float
    requested: tuple[float, ...]
    units: int | None


class SliceMechanism(Protocol):
    """Parent side of a mechanism. `open()` before the first child, `close()` always."""

    name: str  # recorded as Profile.mechanism
    device_kind: str  # "cpu" | "cuda"

    def plan(self, requested: Sequence[float]) -> list[Slice]:
        """Requested percentages -> distinct slices, ascending. Raises SliceError."""
        ...

    def child_env(self, s: Slice) -> dict[str, str]:
        """Environment variables to add for a child measuring in `s`."""
        ...

    def slice_args(self, s: Slice) -> dict[str, Any]:
        """What the child-side `enter_slice` needs (JSON-able)."""
        ...

    def open(self) -> None: ...

    def close(self) -> None: ...


def cpu_name() -> str:
    """The CPU's model name (for the profile's device name)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "cpu"


def _check_percent(p: float) -> None:
    if not (0 < p <= 100):
        raise SliceError(f"slice percent must be in (0, 100], got {p:g}")


@dataclass
class CpuAffinity:
    """CPU slices: the first k of the cores this process may use, k = ceil(p/100 x n)."""

    cores: tuple[int, ...] = ()
    name: str = "cpu-affinity"
    device_kind: str = "cpu"

    def __post_init__(self) -> None:
        if not self.cores:
            self.cores = tuple(sorted(os.sched_getaffinity(0)))

    def plan(self, requested: Sequence[float]) -> list[Slice]:
        n = len(self.cores)
        groups: dict[int, list[float]] = {}
        for p in requested:
            _check_percent(p)
            k = max(1, math.ceil(p / 100.0 * n - 1e-9))
            groups.setdefault(k, []).append(float(p))
        return [
            Slice(round(100.0 * k / n, 6), tuple(sorted(set(groups[k]))), k)
            for k in sorted(groups)
        ]

    def child_env(self, s: Slice) -> dict[str, str]:
        # OpenMP sizes its pool at start-up: tell it before torch is imported.
        return {"OMP_NUM_THREADS": str(s.units), "MKL_NUM_THREADS": str(s.units)}

    def slice_args(self, s: Slice) -> dict[str, Any]:
        assert s.units is not None
        return {"cores": list(self.cores[: s.units])}

    def open(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class Mps:
    """CUDA MPS slices: `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=p` per child (fixed for the life
    of its context). Refuses when no control daemon answers; with `start_daemon` it runs a
    private one (own pipe/log directories) for the sweep and stops it in `close()`."""

    start_daemon: bool = False
    base_env: Mapping[str, str] | None = None
    name: str = "mps"
    device_kind: str = "cuda"
    _env: dict[str, str] | None = None
    _daemon: mps.PrivateDaemon | None = None

    def plan(self, requested: Sequence[float]) -> list[Slice]:
        out: dict[float, list[float]] = {}
        for p in requested:
            _check_percent(p)
            # The variable takes whole percentages; the driver maps them to SMs itself.
            q = float(math.ceil(p - 1e-9))
            out.setdefault(q, []).append(float(p))
        return [Slice(q, tuple(sorted(set(out[q]))), None) for q in sorted(out)]

    def open(self) -> None:
        base = dict(self.base_env if self.base_env is not None else os.environ)
        if self.start_daemon:
            self._daemon = mps.start_private_daemon(base)
            self._env = self._daemon.env
            return
        if not mps.daemon_answers(base):
            pipe = base.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps (default)")
            raise SliceError(
                "MPS was asked for but no MPS control daemon answers "
                f"(pipe directory {pipe}). Start one (nvidia-cuda-mps-control -d) or pass "
                "--start-mps to let the profiler run a private one."
            )
        self._env = base

    def child_env(self, s: Slice) -> dict[str, str]:
        env = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": f"{s.percent:g}"}
        for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"):
            if self._env and k in self._env:
                env[k] = self._env[k]
        return env

    def slice_args(self, s: Slice) -> dict[str, Any]:
        return {"verify_mps": True}

    def close(self) -> None:
        if self._daemon is not None:
            self._daemon.stop()
            self._daemon = None


MECHANISMS: dict[str, tuple[str, Callable[..., SliceMechanism]]] = {
    "cpu-affinity": ("cpu", CpuAffinity),
    "mps": ("cuda", Mps),
}
DEFAULT_MECHANISM = {"cpu": "cpu-affinity", "cuda": "mps"}


def make_mechanism(device: str, name: str | None = None, **kwargs: Any) -> SliceMechanism:
    """The mechanism `name` (default: the device's default) for `device`."""
    name = name or DEFAULT_MECHANISM.get(device)
    if name not in MECHANISMS:
        raise SliceError(f"unknown slice mechanism {name!r}; known: {', '.join(MECHANISMS)}")
    kind, factory = MECHANISMS[name]
    if kind != device:
        raise SliceError(f"mechanism {name!r} is for device {kind!r}, not {device!r}")
    if name == "cpu-affinity":
        kwargs.pop("start_daemon", None)
    return factory(**kwargs)


# --------------------------------------------------------------------------- child side


def _enter_cpu(args: Mapping[str, Any]) -> dict[str, Any]:
    import torch

    cores = [int(c) for c in args["cores"]]
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    return {"cores": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads()}


def _enter_mps(args: Mapping[str, Any]) -> dict[str, Any]:
    """Create the CUDA context (the MPS percentage binds now), then prove it is an MPS
    client: a child that silently fell back to plain CUDA would measure 100% every time."""
    import torch

    if not torch.cuda.is_available():
        raise SliceError("CUDA is not available in the measuring child")
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    servers = mps.server_list(os.environ)
    if not servers:
        raise SliceError("MPS daemon answers but runs no server after our context was made")
    clients = {c for s in servers for c in mps.client_list(os.environ, s)}
    me = os.getpid()
    if me not in clients:
        raise SliceError(
            f"this process (pid {me}) is not among the MPS servers' clients {sorted(clients)}: "
            "it runs outside MPS, so its slice would not be enforced"
        )
    props = torch.cuda.get_device_properties(0)
    return {
        "mps_servers": servers,
        "mps_verified_client": True,
        "active_thread_percentage": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
        "sm_count_seen": props.multi_processor_count,
    }


_CHILD_ENTER: dict[str, Callable[[Mapping[str, Any]], dict[str, Any]]] = {
    "cpu-affinity": _enter_cpu,
    "mps": _enter_mps,
}


def enter_slice(mechanism: str, args: Mapping[str, Any]) -> dict[str, Any]:
    """Child side: confine this process to its slice; returns what it observed."""
    keep_heap()  # allocate as the server's workers do
    try:
        fn = _CHILD_ENTER[mechanism]
    except KeyError:
        raise SliceError(f"unknown slice mechanism {mechanism!r}") from None
    return fn(args)
