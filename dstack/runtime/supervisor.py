"""The worker supervisor: one worker process per model slice, started, restarted,
switched to a shadow, and stopped. The one owner of worker handles.

Per model, a small state machine:

    starting -> ready -> (restarting -> ready)* -> (switching -> ready)* -> stopped

- `ready`: the worker takes batches.
- `restarting`: the worker died; its in-flight batch was failed at once by its handle (no
  hang); a new worker with the same slice is starting. Other models are untouched. How
  long that should take is the worker's last measured start-up time (`RestartInfo`), so
  that the runtime can tell which requests can wait for it.
- `switching`: a re-plan changed the model's slice; a shadow worker with the new slice is
  started first, then new batches are held until the running one ends, and the shadow
  takes over. Queued requests stay queued.
- `stopped`: shut down.

Models not in `ready` are *blocked*: the dispatch core does not launch batches for them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from dstack.common.config import ModelConfig
from dstack.common.errors import DStackError
from dstack.common.slices import SliceBackend, SliceSpec, available_cores
from dstack.common.types import ModelSpec
from dstack.policies.replicas import public_name
from dstack.runtime.messages import Ready
from dstack.runtime.worker import WorkerConfig, WorkerHandle, WorkerState, arena_for

log = logging.getLogger("dstack.runtime.supervisor")


class SlotState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    SWITCHING = "switching"
    FAILED = "failed"  # could not be (re)started: its requests are failed
    STOPPED = "stopped"


@dataclass(slots=True)
class _Slot:
    cfg: ModelConfig
    spec: ModelSpec
    state: SlotState = SlotState.STARTING
    worker: WorkerHandle | None = None
    held: bool = False  # switching: launch nothing until the shadow is attached
    passive: bool = False  # its CPU threads wait asleep (cores shared with a concurrent model)
    start_s: float | None = None  # how long its last worker took to start (spawn to ready)
    died_at: float | None = None  # restarting: when its worker died
    expected_s: float | None = None  # restarting: how long it should take (start_s then)
    restarts: int = 0  # restarts that succeeded
    last_restart_s: float | None = None  # how long the last one took (death to ready)


@dataclass(frozen=True, slots=True)
class RestartInfo:
    """A worker's restarts (seconds; the supervisor's clock)."""

    died_at: float | None  # restarting now: when its worker died; else None
    expected_s: float | None  # how long a restart should take: its last measured start
    count: int  # restarts that succeeded
    last_s: float | None  # how long the last one took, death to ready

    def expected_ready(self) -> float | None:
        """When the restart under way should be done (None: none, or never measured)."""
        if self.died_at is None or self.expected_s is None:
            return None
        return self.died_at + self.expected_s


def passive_models(slices: Mapping[str, SliceSpec], concurrent: bool,
                   guests: Mapping[str, str] | None = None) -> frozenset[str]:
    """Models whose CPU cores another model's worker may be computing on at the same time.
    Their OpenMP threads must wait for work asleep (OMP_WAIT_POLICY=PASSIVE): spinning,
    they take the cores from the other worker's batch. Measured on the CPU mix under
    `shared` (both workers on both cores), closed loop: 3.1 rps within SLO and 55% refused
    spinning, 77.2 rps and none refused asleep; under `temporal` (one batch at a time)
    sleeping costs the wake-up instead (36.9 against 17.9 rps), so not there. `guests`
    (the `dstack` policy's guest workers) run only while their lane is idle: they count
    for nothing here, and are never passive."""
    if not concurrent:
        return frozenset()
    own = {n: s for n, s in slices.items() if n not in (guests or {})}
    return frozenset(n for n, s in own.items()
                     if any(set(s.units) & set(o.units) for m, o in own.items() if m != n))


def _waves(names: list[str], slices: Mapping[str, SliceSpec]) -> list[list[int]]:
    """`names` (positions) in start-up waves: each worker in the first wave where no other
    worker's cores overlap its own. Warm-ups on the same cores at once would time each
    other (a lane's guest worker beside its own: `dstack.policies.lane_policy`), and the
    warm-up times correct the plan's profiles."""
    waves: list[list[int]] = []
    cores: list[set[int]] = []
    for i, n in enumerate(names):
        units = set(slices[n].units)
        for w, used in zip(waves, cores, strict=True):
            if not units & used:
                w.append(i)
                used.update(units)
                break
        else:
            waves.append([i])
            cores.append(units)
    return waves


class Supervisor:
    """Workers of every model. `on_change` is called (no arguments) whenever a model
    becomes able to take batches again or fails for good, so the dispatcher looks again;
    `on_failed(model, error)` when a model's worker could not be restarted;
    `on_restarted(model, took_s, expected_s)` when it was (before `on_change`); `clock`
    times starts
    and restarts (`RestartInfo`)."""

    def __init__(self, models: Mapping[str, tuple[ModelConfig, ModelSpec]],
                 slices: SliceBackend, *, on_change: Callable[[], None],
                 on_failed: Callable[[str, DStackError], None],
                 on_restarted: Callable[[str, float, float | None], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, worker_nice: int = 0,
                 cuda_graphs: bool = True) -> None:
        self.slices = slices
        self.worker_nice = worker_nice  # DeployConfig.worker_nice
        self.cuda_graphs = cuda_graphs  # DeployConfig.cuda_graphs
        # The cores every worker starts on (its slice narrows them): this process's now,
        # before the front end confines itself to `server.cores`.
        self.cpus = available_cores()
        self._slots = {name: _Slot(cfg, spec) for name, (cfg, spec) in models.items()}
        self._on_change = on_change
        self._on_failed = on_failed
        self._on_restarted = on_restarted
        self._clock = clock
        self._closing = False
        self._tasks: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ reading

    def worker(self, model: str) -> WorkerHandle | None:
        s = self._slots[model]
        return s.worker if s.state is SlotState.READY or s.state is SlotState.SWITCHING \
            else None

    def state(self, model: str) -> SlotState:
        return self._slots[model].state

    def is_ready(self, model: str) -> bool:
        s = self._slots[model]
        return (s.state in (SlotState.READY, SlotState.SWITCHING) and s.worker is not None
                and s.worker.state is WorkerState.READY)

    def accepting(self, model: str) -> bool:
        """Requests are queued for the model (it is up, or coming back up)."""
        return self._slots[model].state in (SlotState.READY, SlotState.SWITCHING,
                                            SlotState.RESTARTING)

    def blocked(self) -> frozenset[str]:
        """Models that cannot take a batch now."""
        return frozenset(n for n, s in self._slots.items()
                         if s.held or not self.is_ready(n))

    def current_slice(self, model: str) -> SliceSpec | None:
        w = self._slots[model].worker
        return w.cfg.slice if w is not None else None

    def start_times(self) -> dict[str, float]:
        """How long each worker's last start took (spawn to ready), where measured."""
        return {n: s.start_s for n, s in self._slots.items() if s.start_s is not None}

    def restart_info(self, model: str) -> RestartInfo:
        s = self._slots[model]
        if s.state is SlotState.RESTARTING:
            return RestartInfo(s.died_at, s.expected_s, s.restarts, s.last_restart_s)
        return RestartInfo(None, s.start_s, s.restarts, s.last_restart_s)

    # ------------------------------------------------------------------ start / stop

    async def start_all(self, slices: Mapping[str, SliceSpec], *,
                        passive: frozenset[str] = frozenset()) -> dict[str, Ready]:
        """Start every model's worker in its slice; all or nothing (raises the first
        error after stopping the ones that started). `passive`: see `passive_models`.
        A name in `slices` that is not a model's is a replica of one
        (`dstack.policies.replicas`): another worker for the same model."""
        self._add_replicas(slices)
        names = list(self._slots)
        for n in names:
            self._slots[n].passive = n in passive
        got: list[object] = [None] * len(names)
        for wave in _waves(names, slices):
            done = await asyncio.gather(*(self._start(names[i], slices[names[i]])
                                          for i in wave), return_exceptions=True)
            for i, g in zip(wave, done, strict=True):
                got[i] = g
            if any(isinstance(g, BaseException) for g in done):
                break
        errors = [g for g in got if isinstance(g, BaseException)]
        for n, g in zip(names, got, strict=True):
            if isinstance(g, WorkerHandle):
                self._attach(n, g)
        if errors:
            await self.stop_all()
            raise errors[0]
        return {n: g.ready_info for n, g in zip(names, got, strict=True)  # type: ignore[union-attr]
                if isinstance(g, WorkerHandle) and g.ready_info is not None}

    def _add_replicas(self, slices: Mapping[str, SliceSpec]) -> None:
        for n in slices:
            if n not in self._slots:
                base = self._slots[public_name(n)]
                self._slots[n] = _Slot(base.cfg, base.spec)

    def add_models(self, models: Mapping[str, tuple[ModelConfig, ModelSpec]]) -> None:
        """Models loaded at run time: their workers start with `start_shadows` (a model
        with no worker counts as changed) and are attached by `switch`."""
        for name, (cfg, spec) in models.items():
            if name in self._slots:
                raise ValueError(f"model {name} has workers already")
            self._slots[name] = _Slot(cfg, spec)

    def remove_models(self, names: list[str]) -> list[WorkerHandle]:
        """Forget models unloaded at run time (workers' names, replicas included); returns
        their workers, for the caller to stop once nothing runs on them."""
        out = []
        for n in names:
            s = self._slots.pop(n, None)
            if s is not None and s.worker is not None:
                s.state = SlotState.STOPPED
                out.append(s.worker)
        return out

    async def _start(self, name: str, sl: SliceSpec) -> WorkerHandle:
        s = self._slots[name]
        wcfg = WorkerConfig(
            model=name, zoo_name=s.cfg.zoo, spec=s.spec, slice=sl, arena_name="",
            layout=arena_for(s.spec), warmup_batch=s.cfg.max_batch_size,
            weights=str(s.cfg.weights) if s.cfg.weights else None,
            torchscript=str(s.cfg.torchscript) if s.cfg.torchscript else None,
            builder=s.cfg.builder,
            extra_env={**self.slices.worker_env(),
                       **({"OMP_WAIT_POLICY": "PASSIVE"} if s.passive else {})},
            nice=self.worker_nice,
            cpus=self.cpus,
            cuda_graphs=self.cuda_graphs,
        )
        t0 = self._clock()
        h = WorkerHandle.create(wcfg)
        try:
            await h.start()
        except BaseException:
            await h.kill()
            raise
        s.start_s = self._clock() - t0
        log.info("worker %s ready in %.1f s (pid %s, slice %g%% %s)", name, s.start_s, h.pid,
                 sl.percent, list(sl.units))
        return h

    def _attach(self, name: str, h: WorkerHandle) -> None:
        h.on_death.append(self._on_death)
        s = self._slots[name]
        s.worker = h
        s.state = SlotState.READY
        s.held = False

    async def stop_all(self) -> None:
        self._closing = True
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            try:
                await t
            except BaseException:  # noqa: BLE001 - shutting down: nothing to report to
                pass
        workers = [s.worker for s in self._slots.values() if s.worker is not None]
        for s in self._slots.values():
            s.state = SlotState.STOPPED
        await asyncio.gather(*(w.stop() for w in workers), return_exceptions=True)

    # ------------------------------------------------------------------ restarts

    def _on_death(self, h: WorkerHandle) -> None:
        name = h.cfg.model
        s = self._slots.get(name)
        if s is None or s.worker is not h or self._closing:  # None: unloaded
            return
        s.state = SlotState.RESTARTING
        s.died_at = self._clock()
        s.expected_s = s.start_s
        expect = f"about {s.start_s:.1f} s, its last start" if s.start_s is not None else "?"
        log.error("worker %s (pid %s) died; restarting it (expected to take %s)", name, h.pid,
                  expect)
        self._spawn(self._restart(name, h))

    async def _restart(self, name: str, old: WorkerHandle) -> None:
        s = self._slots[name]
        try:
            h = await self._start(name, old.cfg.slice)
        except DStackError as e:
            log.error("restart of %s failed: %s", name, e)
            s.state = SlotState.FAILED
            s.died_at = None
            self._on_failed(name, e)
            self._on_change()
            return
        finally:
            await old.kill()
        if self._closing or self._slots.get(name) is not s:  # shut down, or unloaded
            await h.stop()
            return
        took = self._clock() - (s.died_at if s.died_at is not None else self._clock())
        s.restarts += 1
        s.last_restart_s = took
        s.died_at = None
        self._attach(name, h)
        if self._on_restarted is not None:
            self._on_restarted(name, took, s.expected_s)
        self._on_change()

    def _spawn(self, coro: object) -> None:
        t = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ shadow switch

    def changed(self, slices: Mapping[str, SliceSpec]) -> list[str]:
        """Workers with no worker yet or another slice in `slices` (a model it leaves out,
        being unloaded, is left as it is)."""
        return [n for n, s in self._slots.items()
                if n in slices and (s.worker is None or s.worker.cfg.slice != slices[n])]

    async def start_shadows(self, slices: Mapping[str, SliceSpec], *,
                            passive: frozenset[str] = frozenset()
                            ) -> dict[str, WorkerHandle]:
        """Start a worker with its new slice for every model whose slice changes; all or
        nothing (a failure stops the shadows that started and raises). A model added by
        `add_models` gets its first workers here (its replicas too)."""
        self._add_replicas(slices)
        names = self.changed(slices)
        for n in names:
            self._slots[n].passive = n in passive
        got = await asyncio.gather(*(self._start(n, slices[n]) for n in names),
                                   return_exceptions=True)
        errors = [g for g in got if isinstance(g, BaseException)]
        if errors:
            await asyncio.gather(*(g.stop() for g in got if isinstance(g, WorkerHandle)),
                                 return_exceptions=True)
            raise errors[0]
        return dict(zip(names, got, strict=True))  # type: ignore[arg-type]

    async def switch(self, shadows: Mapping[str, WorkerHandle],
                     running: Callable[[str], bool]) -> None:
        """Hold new launches on the switched models, wait for their running batches to
        end (`running(model)`), then attach every shadow at once and stop the old ones."""
        for n in shadows:
            self._slots[n].held = True
            self._slots[n].state = SlotState.SWITCHING
        try:
            while any(running(n) for n in shadows):
                await asyncio.sleep(0.0005)
        finally:
            olds = []
            for n, h in shadows.items():
                olds.append(self._slots[n].worker)
                self._attach(n, h)
            self._on_change()
        for o in olds:
            if o is not None:
                await o.stop()
