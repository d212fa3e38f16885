"""A worker starts on the cores it is given (`WorkerConfig.cpus`: the server's at start-up),
not on those of the process that spawned it: a front end confined to its own core
(`server.cores`) must not take a GPU worker's CPU threads (whose slice names no cores) with
it. The CPU worker's slice narrows the cores itself (tests/e2e/test_restart_serve.py)."""

from __future__ import annotations

import asyncio
import os

import models
from dstack.common.slices import SliceSpec, available_cores, pin_threads
from dstack.runtime.worker import WorkerConfig, WorkerHandle, arena_for


def _affinity(pid: int) -> set[frozenset[int]]:
    return {frozenset(os.sched_getaffinity(int(t))) for t in os.listdir(f"/proc/{pid}/task")}


def test_a_worker_started_by_a_pinned_process_runs_on_its_own_cores() -> None:
    """Workers fork from a process started with the first of them (`worker.start_method`),
    so they carry whatever cores that process had: a worker sets its own."""
    host = available_cores()
    spec = models.spec("tiny_cnn")
    no_cores = SliceSpec(100.0, (), "cpu", "none")  # as a CUDA slice: nothing to pin

    async def start(cpus: tuple[int, ...]) -> set[frozenset[int]]:
        h = WorkerHandle.create(WorkerConfig(model="tiny", zoo_name="tiny_cnn", spec=spec,
                                             slice=no_cores, arena_name="",
                                             layout=arena_for(spec), cpus=cpus))
        try:
            await h.start(timeout_s=120)
            assert h.pid is not None
            return _affinity(h.pid)
        finally:
            await h.kill()

    pin_threads(host[-1:])  # the starting process, as a front end on `server.cores`
    try:
        given = asyncio.run(start(host))
    finally:
        pin_threads(host)
    assert given == {frozenset(host)}
    # and from an unpinned process, a worker given one core keeps to it
    assert asyncio.run(start(host[:1])) == {frozenset(host[:1])}


def test_a_worker_whose_openmp_settings_must_apply_is_a_fresh_interpreter() -> None:
    """OpenMP reads OMP_WAIT_POLICY when torch loads it, which a worker forked from the
    preloaded process did before its environment was set: a worker that shares cores
    (`OMP_WAIT_POLICY=PASSIVE`) is spawned and imports torch after setting it."""
    spec = models.spec("tiny_cnn")
    sl = SliceSpec(100.0, available_cores())

    async def command_line(env: dict[str, str]) -> str:
        h = WorkerHandle.create(WorkerConfig(model="tiny", zoo_name="tiny_cnn", spec=spec,
                                             slice=sl, arena_name="", layout=arena_for(spec),
                                             extra_env=env))
        try:
            await h.start(timeout_s=120)
            with open(f"/proc/{h.pid}/cmdline", "rb") as f:
                return f.read().decode()
        finally:
            await h.kill()

    assert "spawn_main" in asyncio.run(command_line({"OMP_WAIT_POLICY": "PASSIVE"}))
    assert "forkserver" in asyncio.run(command_line({}))
