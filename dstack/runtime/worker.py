"""Worker processes: one per model slice, started with `spawn`.

The child applies its slice, builds the model, warms it up, reports `Ready`, then runs the
batches it is told to, reading inputs from and writing outputs to the half of its
shared-memory arena each batch names (`dstack.runtime.upload`: on CUDA, from pinned memory
on a copy stream, the next batch's rows copied while the current one computes).
The parent side (`WorkerHandle`) is asyncio: it waits on the pipe with `add_reader`, so a
dead worker is noticed at once (EOF on the pipe) and its in-flight batch is failed.

States: starting -> ready -> (draining ->) stopped; `dead` when the process went away.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import time
import traceback
from dataclasses import dataclass, field
from enum import StrEnum
from multiprocessing.connection import Connection

from dstack.common.errors import BackendError, DStackError, RequestError, Unavailable
from dstack.common.heap import keep_heap
from dstack.common.pauses import freeze_startup_objects
from dstack.common.slices import SliceSpec, enter_slice, pin_threads, thread_ids
from dstack.common.types import ModelSpec
from dstack.runtime.graphs import graphed_or_eager
from dstack.runtime.messages import (
    BatchDone,
    BatchFailed,
    DeviceRows,
    ForgetMemory,
    Ready,
    RunBatch,
    StartFailed,
    Stop,
    decode,
    encode,
)
from dstack.runtime.shm import Arena, ArenaLayout
from dstack.runtime.upload import CudaInputs, DeviceMemoryError, inputs_for

log = logging.getLogger("dstack.runtime.worker")


def start_failure(model: str, error: str) -> DStackError:
    """The error a worker that failed to start (`StartFailed`: its exception, a line, then
    its traceback) is raised as: its first line; the traceback goes to the debug log. A model
    the zoo cannot make as configured (weights it cannot read, say) is the config's fault:
    RequestError (a repository load is answered 400); anything else, Unavailable. (The
    traceback went to the client too, with the server's file paths in it.)"""
    first, _, detail = error.partition("\n")
    if detail:
        log.debug("worker for %s failed to start: %s", model, error)
    kind = RequestError if first.startswith("ModelZooError:") else Unavailable
    return kind(f"worker for {model} failed to start: {first}")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Everything a worker process needs; picklable."""

    model: str  # served name
    zoo_name: str
    spec: ModelSpec
    slice: SliceSpec
    arena_name: str
    layout: ArenaLayout
    warmup_batch: int = 1
    weights: str | None = None
    torchscript: str | None = None
    builder: str | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    nice: int = 0  # added to the worker's niceness, before it starts any thread
    # The cores it starts on, which its slice may narrow: the server's own at start-up,
    # not those the front end confines itself to later (`server.cores`), which the
    # process it was spawned from has. (): where it was spawned.
    cpus: tuple[int, ...] = ()
    cuda_graphs: bool = True  # CUDA: the forward replayed as graphs (dstack/runtime/graphs.py)


# --------------------------------------------------------------------------- child side


def _check_mps_client(cfg: WorkerConfig) -> None:
    """The CUDA context now exists: prove it is an MPS client. A context made while no
    daemon answered on the pipe directory is plain CUDA and its percentage is ignored, so
    such a worker must not report ready."""
    from dstack.common.mps import MpsError, verify_client

    try:
        verify_client(os.environ)
    except MpsError as e:
        raise RuntimeError(
            f"worker for {cfg.model} is not running under MPS (asked for a "
            f"{cfg.slice.percent:g}% slice): {e}"
        ) from None


def _renice(n: int) -> None:
    """Make every thread of this process `n` nicer: those already running (made while
    the worker's modules were imported) one by one, as Linux keeps a niceness per
    thread; those made later (torch's) inherit the main thread's."""
    for tid in thread_ids():
        try:
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + n)
        except ProcessLookupError:  # that thread has ended meanwhile
            pass


def _batch_scheduling() -> None:
    """Run every thread of this process as CPU-bound batch work (Linux `SCHED_BATCH`, at
    the same weight as its niceness gives it): a worker that wakes does not pre-empt the
    server's event loop on a shared core, and keeps its fair share against other
    programs, which a niceness of 10 gave away. Threads made later inherit it."""
    if not hasattr(os, "SCHED_BATCH"):
        return
    for tid in thread_ids():
        try:
            os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
        except (ProcessLookupError, PermissionError):  # ended meanwhile; not allowed here
            pass


def _worker_main(cfg: WorkerConfig, conn: Connection) -> None:
    os.environ.update(cfg.extra_env)
    if cfg.nice:
        _renice(cfg.nice)
    if cfg.slice.device == "cpu":
        _batch_scheduling()
    if cfg.cpus:
        pin_threads(cfg.cpus)
    keep_heap()  # before torch allocates anything
    try:
        enter_slice(cfg.slice)
        import torch

        import models

        # Without a weights file a zoo model starts from random weights: the same ones in
        # every worker, so a replica, a restarted worker or a re-plan's shadow answers
        # exactly as the worker before it.
        torch.manual_seed(0)
        model = models.load_model(
            cfg.zoo_name, weights=cfg.weights, builder=cfg.builder, torchscript=cfg.torchscript
        )
        device = torch.device("cuda" if cfg.slice.device == "cuda" else "cpu")
        model = model.to(device)
        if cfg.slice.mechanism == "mps":
            _check_mps_client(cfg)
        arena = Arena(cfg.layout, name=cfg.arena_name)
        upload = inputs_for(arena, device)
        forward = model
        if isinstance(upload, CudaInputs) and cfg.cuda_graphs:
            forward = graphed_or_eager(model, [torch.zeros_like(d) for d in upload.dev[0]],
                                       cfg.layout.max_batch, cfg.model)
        out_names = [r.name for r in cfg.layout.outputs]

        def run(n: int, half: int = 0, fresh_from: int = 0,
                device_rows: tuple[DeviceRows, ...] = ()) -> None:
            xs = upload.batch(half, n, fresh_from, device_rows)
            with torch.inference_mode():
                y = forward(*xs)
            upload.overlap(half)  # CUDA: the next batch's rows go up while this computes
            ys = y if isinstance(y, (tuple, list)) else (y,)
            if len(ys) != len(out_names):
                raise RuntimeError(f"model returned {len(ys)} outputs, spec has {len(out_names)}")
            outs = arena.outputs(n, half)
            for name, t in zip(out_names, ys, strict=True):
                if t.shape[0] != n:
                    raise RuntimeError(f"output {name} has {t.shape[0]} rows for {n} inputs")
                outs[name][...] = t.detach().to("cpu").numpy()
            if device.type == "cuda":
                torch.cuda.synchronize()

        def timed(n: int) -> float:
            t0 = time.perf_counter()
            run(n)
            return (time.perf_counter() - t0) * 1000

        # Warm-up: allocator and kernels at the planned and the largest batch, then timed
        # points for the latency model.
        warm_b = max(1, min(cfg.warmup_batch, cfg.layout.max_batch))
        for a in arena.inputs(cfg.layout.max_batch).values():
            a[...] = 0
        for b in {1, warm_b, cfg.layout.max_batch}:
            timed(b)
        # Minimum of several runs: on a busy machine one run can be many times too slow.
        # These two points only seed the dispatcher's latency model, which refuses nothing
        # until real batches have confirmed it (LinearLatency.trusted).
        ms1 = min(timed(1) for _ in range(5))
        ms_max = min(timed(cfg.layout.max_batch) for _ in range(3))
        freeze_startup_objects()  # no batch waits for a collection that walks torch's objects
        conn.send_bytes(encode(Ready(os.getpid(), ms1, ms_max, cfg.layout.max_batch)))
    except Exception as e:  # noqa: BLE001 - reported to the parent, then exit
        conn.send_bytes(encode(StartFailed(
            f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}")))
        return

    while True:
        try:
            msg = decode(conn.recv_bytes())
        except (EOFError, OSError):
            break  # parent went away
        if isinstance(msg, Stop):
            break
        if isinstance(msg, ForgetMemory):
            upload.forget(msg.handle)
            continue
        assert isinstance(msg, RunBatch)
        start = time.monotonic()
        try:
            run(msg.n, msg.half, msg.fresh_from, msg.device_rows)
            conn.send_bytes(encode(
                BatchDone(msg.batch_id, msg.n, start, time.monotonic() - start)))
        except Exception as e:  # noqa: BLE001 - a bad batch fails its requests, not the worker
            conn.send_bytes(encode(BatchFailed(msg.batch_id, f"{type(e).__name__}: {e}",
                                               isinstance(e, DeviceMemoryError))))
    upload.close()
    arena.close()


# --------------------------------------------------------------------------- parent side


class WorkerState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    DEAD = "dead"


def _preloaded() -> mp.context.BaseContext:
    """Workers fork from one process that imported torch, torchvision and the model zoo
    once (multiprocessing's forkserver, preloaded), instead of each importing them anew: on
    a 2-core AMD EPYC those imports took 6 s of CPU of a worker's 7-10 s start. The
    preloaded process never initialises CUDA nor runs a model (a fork after either is not
    safe); each worker applies its slice, niceness and cores itself."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torchvision", "models"])
    return ctx


_PRELOADED = _preloaded()
#: OpenMP reads its environment once, when torch loads it: a worker whose environment sets
#: it (`OMP_WAIT_POLICY=PASSIVE` for workers that share cores) starts a fresh interpreter
#: and imports torch after setting it.
_SPAWN = mp.get_context("spawn")
_OPENMP_ENV = ("OMP_", "GOMP_", "KMP_")


def start_method(cfg: WorkerConfig) -> str:
    """'forkserver' (from the preloaded process), or 'spawn' where the worker's own
    environment must reach OpenMP."""
    return "spawn" if any(k.startswith(_OPENMP_ENV) for k in cfg.extra_env) else "forkserver"


class WorkerHandle:
    """The parent's end of one worker. Runs at most one batch at a time."""

    def __init__(self, cfg: WorkerConfig, arena: Arena) -> None:
        self.cfg = cfg
        self.arena = arena
        self.state = WorkerState.STARTING
        self.ready_info: Ready | None = None
        self.busy = False
        # Rows in a client's device memory may be sent to it (`DeviceRows`): a CUDA worker,
        # until it fails to open such memory (`BatchFailed.device_memory`).
        self.reads_device_memory = cfg.slice.device == "cuda"
        self._batch_id = 0
        self._pending: asyncio.Future[BatchDone] | None = None
        self._ready_fut: asyncio.Future[Ready] | None = None
        ctx = _SPAWN if start_method(cfg) == "spawn" else _PRELOADED
        self._conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(
            target=_worker_main, args=(cfg, child), name=f"dstack-worker-{cfg.model}",
            daemon=True,
        )
        self._child_conn = child
        self._loop: asyncio.AbstractEventLoop | None = None
        self.on_death: list = []  # callbacks(handle) run when the process dies unexpectedly

    @classmethod
    def create(cls, cfg_without_arena: WorkerConfig) -> WorkerHandle:
        arena = Arena(cfg_without_arena.layout)
        cfg = WorkerConfig(**{**_fields(cfg_without_arena), "arena_name": arena.name})
        return cls(cfg, arena)

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    async def start(self, timeout_s: float = 300.0) -> Ready:
        self._loop = asyncio.get_running_loop()
        self._ready_fut = self._loop.create_future()
        # Starting a spawned interpreter takes tens of ms on a busy machine: not on the loop.
        await asyncio.to_thread(self.proc.start)
        self._child_conn.close()
        self._loop.add_reader(self._conn.fileno(), self._on_readable)
        try:
            info = await asyncio.wait_for(self._ready_fut, timeout_s)
        except TimeoutError:
            await self.kill()
            raise Unavailable(
                f"worker for {self.cfg.model} did not start in {timeout_s:g} s"
            ) from None
        self.ready_info = info
        self.state = WorkerState.READY
        return info

    def _on_readable(self) -> None:
        try:
            msg = decode(self._conn.recv_bytes())
        except (EOFError, OSError):
            self._on_eof()
            return
        if isinstance(msg, Ready):
            if self._ready_fut and not self._ready_fut.done():
                self._ready_fut.set_result(msg)
        elif isinstance(msg, StartFailed):
            if self._ready_fut and not self._ready_fut.done():
                self._ready_fut.set_exception(start_failure(self.cfg.model, msg.error))
        elif isinstance(msg, (BatchDone, BatchFailed)):
            fut, self._pending = self._pending, None
            self.busy = False
            if isinstance(msg, BatchFailed) and msg.device_memory:
                self.reads_device_memory = False
                log.warning("worker for %s cannot open clients' device memory; their inputs "
                            "reach it through the host from now on: %s", self.cfg.model,
                            msg.error)
            if fut is None or fut.done():
                return
            if isinstance(msg, BatchDone):
                fut.set_result(msg)
            else:
                fut.set_exception(BackendError(f"{self.cfg.model}: {msg.error}"))

    def _on_eof(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._conn.fileno())
        was = self.state
        self.state = WorkerState.DEAD if was not in (WorkerState.STOPPED,) else was
        self.busy = False
        exitcode = self.proc.exitcode
        err = BackendError(f"worker for {self.cfg.model} died (exit code {exitcode})")
        if self._pending is not None and not self._pending.done():
            self._pending.set_exception(err)
        self._pending = None
        if self._ready_fut is not None and not self._ready_fut.done():
            self._ready_fut.set_exception(
                Unavailable(f"worker for {self.cfg.model} exited during start-up")
            )
        if was in (WorkerState.READY, WorkerState.DRAINING):
            for cb in self.on_death:
                cb(self)

    def submit(self, n: int, half: int = 0, fresh_from: int = 0,
               device_rows: tuple[DeviceRows, ...] = ()) -> asyncio.Future[BatchDone]:
        """Start the n items already written to the inputs of the arena's `half`
        (`fresh_from`, `device_rows`: see `RunBatch`); the future holds the outcome. Sent
        at once, not from a task: the worker must not wait for the event loop to get
        round to it (it would idle while responses are written)."""
        if self.state is not WorkerState.READY or self.busy:
            raise BackendError(f"worker for {self.cfg.model} cannot take a batch ({self.state})")
        assert self._loop is not None
        self._batch_id += 1
        fut: asyncio.Future[BatchDone] = self._loop.create_future()
        self._pending = fut
        self.busy = True
        try:
            self._conn.send_bytes(encode(RunBatch(self._batch_id, n, half, fresh_from,
                                                  device_rows)))
        except (BrokenPipeError, OSError):
            self._on_eof()
        return fut

    def forget(self, handle: bytes) -> None:
        """Tell the worker to close a client's device allocation it may have opened
        (`ForgetMemory`); nothing to a worker that is gone."""
        if self.state in (WorkerState.READY, WorkerState.DRAINING):
            try:
                self._conn.send_bytes(encode(ForgetMemory(handle)))
            except (BrokenPipeError, OSError):
                pass  # its end of the pipe is noticed by the reader

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the worker to exit, then make sure it did; frees the arena."""
        if self.state in (WorkerState.STOPPED,):
            return
        self.state = WorkerState.STOPPED
        if self.proc.is_alive():
            try:
                self._conn.send_bytes(encode(Stop()))
            except (BrokenPipeError, OSError):
                pass
            deadline = time.monotonic() + timeout_s
            while self.proc.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        await self.kill()

    async def kill(self) -> None:
        if self.proc.pid is not None and self.proc.is_alive():
            self.proc.kill()
            await asyncio.to_thread(self.proc.join, 5)
        if self._loop is not None:
            try:
                self._loop.remove_reader(self._conn.fileno())
            except (ValueError, OSError):
                pass
        self._conn.close()
        self.arena.close()
        if self.state is not WorkerState.DEAD:
            self.state = WorkerState.STOPPED


def _fields(cfg: WorkerConfig) -> dict[str, object]:
    return {f: getattr(cfg, f) for f in WorkerConfig.__dataclass_fields__}


def arena_for(spec: ModelSpec) -> ArenaLayout:
    return ArenaLayout.for_spec(spec)


__all__ = ["WorkerConfig", "WorkerHandle", "WorkerState", "arena_for"]
