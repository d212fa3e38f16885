"""Slice backends: where a worker runs and how much of the device it may use.

A *slice* is a share of device compute (ARCHITECTURE.md). The parent decides slices
(`SliceBackend.allocate`); the worker process applies its slice first thing, before the
model is built (`enter_slice`), because on CUDA an MPS percentage is fixed when the context
is created and on CPU the thread pool is sized once.

- CPU: a set of cores (affinity) and `torch.set_num_threads(len(cores))`.
- CUDA + MPS: `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` set in the worker before CUDA starts.
  `MpsSlices.open()` starts a private MPS control daemon (own pipe/log directories, handed
  to the workers through `worker_env()`) or attaches to a running one; the worker checks
  it really is an MPS client (`dstack.common.mps.verify_client`) and refuses to start otherwise.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger("dstack.common.slices")


@dataclass(frozen=True, slots=True)
class SliceSpec:
    """percent of the device; units = concrete cores (CPU) or () where there are none."""

    percent: float
    units: tuple[int, ...] = ()
    device: str = "cpu"  # "cpu" | "cuda"
    mechanism: str = "cpu-affinity"  # | "mps" | "none"


class SliceBackend(Protocol):
    kind: str

    @property
    def total_units(self) -> int: ...

    def whole(self) -> SliceSpec:
        """The whole device (100%)."""
        ...

    def slice_for(self, percent: float, units: tuple[int, ...] = ()) -> SliceSpec: ...

    def allocate(self, percents: dict[str, float]) -> dict[str, SliceSpec]:
        """Concurrent slices for models that run at the same time; disjoint where the
        device has units and there are enough of them."""
        ...

    def open(self) -> None:
        """Before any worker starts (MPS: find or start the control daemon)."""
        ...

    def worker_env(self) -> dict[str, str]:
        """Environment every worker process gets."""
        ...

    def close(self) -> None:
        """After the last worker stopped."""
        ...


def available_cores() -> tuple[int, ...]:
    return tuple(sorted(os.sched_getaffinity(0)))


def thread_ids() -> list[int]:
    """This process's threads (Linux keeps a niceness and an affinity per thread); [0], the
    calling thread, where there is no /proc."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def pin_threads(cores: tuple[int, ...]) -> None:
    """Confine this process to `cores`: every thread running now, and (through the calling
    thread) every thread and child process made later."""
    for tid in thread_ids():
        try:
            os.sched_setaffinity(tid, cores)
        except ProcessLookupError:  # that thread has ended meanwhile
            pass


def quiet_cores(slices: Mapping[str, SliceSpec], slo_s: Mapping[str, float],
                host: tuple[int, ...]) -> tuple[int, ...]:
    """The cores of `host` where a process beside the workers of `slices` (the server's own:
    reading, refusing and answering requests, dispatch) costs their SLOs least: those no
    slice names, if any; else those whose tightest SLO (`slo_s`, of the models whose
    slices name the core) is the longest. On a core it shares, the process pre-empts the
    worker's batch (the workers run nicer): a few ms taken from a batch under a 250 ms
    SLO cost its worker throughput, from one under a 60 ms SLO they make its answers late.
    `host` itself where the slices name no cores (a GPU's)."""
    tightest: dict[int, float] = {}
    for model, s in slices.items():
        for c in s.units:
            tightest[c] = min(tightest.get(c, math.inf), slo_s[model])
    spare = tuple(c for c in host if c not in tightest)
    if spare or not tightest:
        return spare or host
    longest = max(tightest.get(c, -math.inf) for c in host)
    return tuple(c for c in host if tightest.get(c) == longest)


class CpuSlices:
    """Slices of a CPU as disjoint core sets."""

    kind = "cpu"

    def __init__(self, cores: tuple[int, ...] | None = None) -> None:
        self.cores = tuple(cores) if cores else available_cores()

    @property
    def total_units(self) -> int:
        return len(self.cores)

    def cores_for(self, percent: float) -> int:
        """Cores a percentage needs, rounded up (a slice never gets less than asked)."""
        return max(1, min(len(self.cores), math.ceil(percent / 100 * len(self.cores) - 1e-9)))

    def whole(self) -> SliceSpec:
        return SliceSpec(100.0, self.cores)

    def slice_for(self, percent: float, units: tuple[int, ...] = ()) -> SliceSpec:
        if not units:
            units = self.cores[: self.cores_for(percent)]
        return SliceSpec(100.0 * len(units) / len(self.cores), tuple(units))

    def open(self) -> None:
        return None

    def worker_env(self) -> dict[str, str]:
        return {}

    def close(self) -> None:
        return None

    def allocate(self, percents: dict[str, float]) -> dict[str, SliceSpec]:
        counts = {m: self.cores_for(p) for m, p in percents.items()}
        # Scale down (largest first) until the core sets fit side by side, never below 1.
        while sum(counts.values()) > len(self.cores) and max(counts.values()) > 1:
            biggest = max(counts, key=lambda m: counts[m])
            counts[biggest] -= 1
        out: dict[str, SliceSpec] = {}
        nxt = 0
        for m, c in counts.items():
            # More models than cores: wrap around (those slices then share cores).
            units = tuple(self.cores[(nxt + i) % len(self.cores)] for i in range(c))
            nxt = (nxt + c) % len(self.cores)
            out[m] = SliceSpec(100.0 * c / len(self.cores), units)
        return out


class MpsSlices:
    """CUDA MPS: a thread percentage per worker process; no concrete units.

    `open()` (the runtime calls it before starting workers) finds the control daemon:
    with `start_daemon` True it starts a private one; False attaches to the one that the
    environment's `CUDA_MPS_PIPE_DIRECTORY` (or the default /tmp/nvidia-mps) reaches and
    refuses if none answers; None (default) attaches when `CUDA_MPS_PIPE_DIRECTORY` is set,
    else starts a private one. `close()` stops only a daemon it started."""

    kind = "cuda"

    def __init__(self, sm_count: int = 100, *, start_daemon: bool | None = None,
                 base_env: Mapping[str, str] | None = None) -> None:
        self.sm_count = sm_count
        self.start_daemon = start_daemon
        self.base_env = dict(base_env if base_env is not None else os.environ)
        self._env: dict[str, str] = {}
        self._daemon: object | None = None

    @property
    def total_units(self) -> int:
        return self.sm_count

    def whole(self) -> SliceSpec:
        return SliceSpec(100.0, (), "cuda", "mps")

    def slice_for(self, percent: float, units: tuple[int, ...] = ()) -> SliceSpec:
        return SliceSpec(float(min(100.0, max(1.0, percent))), (), "cuda", "mps")

    def allocate(self, percents: dict[str, float]) -> dict[str, SliceSpec]:
        total = sum(percents.values())
        scale = min(1.0, 100.0 / total) if total else 1.0
        return {m: self.slice_for(p * scale) for m, p in percents.items()}

    def open(self) -> None:
        from dstack.common import mps

        start = self.start_daemon
        if start is None:
            start = "CUDA_MPS_PIPE_DIRECTORY" not in self.base_env
        if start:
            daemon = mps.start_private_daemon(self.base_env)
            self._daemon, self._env = daemon, mps.client_env(daemon.env)
            log.info("started a private MPS control daemon (pipe %s)", daemon.pipe_dir)
            return
        if not mps.daemon_answers(self.base_env):
            pipe = self.base_env.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps (default)")
            raise mps.MpsError(
                f"device cuda with MPS slices, but no MPS control daemon answers on {pipe}: "
                "start one (nvidia-cuda-mps-control -d) or unset CUDA_MPS_PIPE_DIRECTORY "
                "to let the server start a private one"
            )
        self._env = mps.client_env(self.base_env)

    def worker_env(self) -> dict[str, str]:
        """What a worker needs to reach the daemon (pipe/log directories)."""
        return dict(self._env)

    def close(self) -> None:
        if self._daemon is not None:
            self._daemon.stop()  # type: ignore[attr-defined]
            self._daemon = None


def enter_slice(s: SliceSpec) -> int:
    """Apply a slice inside the worker process; returns the thread count to use."""
    import torch

    if s.device == "cpu":
        if s.units:
            os.sched_setaffinity(0, set(s.units))
        threads = max(1, len(s.units) or len(available_cores()))
        torch.set_num_threads(threads)
        return threads
    if s.mechanism == "mps":
        # Read by the CUDA driver when this process creates its context: must precede it.
        os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = f"{s.percent:g}"
    return torch.get_num_threads()
