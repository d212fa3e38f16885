"""The asyncio runtime: drives the dispatch core on the real clock, with real workers.

`Runtime` implements `dstack.common.backend.InferenceBackend`. The rules (queues,
admission, refusals, estimates, counters) are the dispatch core's
(`dstack.runtime.dispatch`); workers are the supervisor's (`dstack.runtime.supervisor`);
re-planning is the re-planner's (`dstack.runtime.replanner`, solving off the event loop).
This module waits, copies tensors into the workers' shared memory, and resolves futures.

Every request has one future, registered before it is queued and resolved on every path:
success, refusal (naming the rule), a failed batch, a worker that died, a fault anywhere
in the dispatch path (500 naming it, logged once with its traceback), shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from dstack.common.backend import ModelStats
from dstack.common.config import (
    DeployConfig,
    ModelConfig,
    PolicyName,
    solve_in_process,
    worker_niceness,
)
from dstack.common.errors import (
    BackendError,
    DStackError,
    ModelNotFound,
    Unavailable,
)
from dstack.common.pauses import Lateness
from dstack.common.slices import (
    CpuSlices,
    MpsSlices,
    SliceBackend,
    SliceSpec,
    available_cores,
    quiet_cores,
)
from dstack.common.types import ModelSpec, Plan, Schedule
from dstack.policies.contract import Policy
from dstack.policies.latency import LinearLatency
from dstack.policies.planning import (
    PolicySetup,
    corrected_profiles,
    latency_ratios,
    served_of,
    setup_policy,
)
from dstack.policies.replicas import public_name, replica_names
from dstack.runtime.admission import (
    LAG_TURNS,
    RESTARTING,
    EarlyAdmission,
    refusal_error,
)
from dstack.runtime.dispatch import (
    Batch,
    CoreModel,
    DispatchCore,
    Step,
    Ticket,
)
from dstack.runtime.messages import BatchDone, Ready
from dstack.runtime.replanner import Replanner, SolverProcess, StalePlan
from dstack.runtime.repository import ModelState, RepoEntry, model_config
from dstack.runtime.shm import Arena
from dstack.runtime.specs import served_spec
from dstack.runtime.staging import Stager
from dstack.runtime.supervisor import RestartInfo, Supervisor, passive_models
from dstack.runtime.worker import WorkerHandle, WorkerState

log = logging.getLogger("dstack.runtime")

#: Longest a dispatcher wait may last: a missed wake-up can delay a batch by at most this.
MAX_IDLE_S = 0.5
#: A wake-up that is not in the future is taken this much later, as the simulator takes
#: it (`dstack.simulate.engine`): a queued request whose deadline is due exactly now is
#: refused just after now, and on a virtual clock a step at the same instant again would
#: never let time move on. (On the real clock, time has moved on by then: no wait.)
WAKE_NUDGE_S = 1e-9
#: The event loop's lag is sampled by a timer of this period (`Runtime.loop_lag_s`) ...
LAG_TICK_S = 0.01
#: ... into a running mean over about this long (each sample weighs 1 - exp(-dt / tau), dt
#: the time since the one before), so that it follows a loop that stays behind, not each
#: busy moment. Over time, not per sample: a loop 250 ms behind samples only 4 times a
#: second (docs/decisions.md).
LAG_TAU_S = 1.0


class Wake:
    """The dispatcher's wake-up: `set()` from the loop; `wait(timeout_s)` returns once it is
    set or after `timeout_s`. asyncio.Event under asyncio.timeout did the same for about
    2.5 times the CPU (21 us a wait against 8 on uvloop: a Timeout context, its timer and
    the event's waiter each time); here a wait is one future and one timer. A cancelled
    wait raises CancelledError (3.11's wait_for could swallow one racing the event)."""

    __slots__ = ("_set", "_waiter")

    def __init__(self) -> None:
        self._set = False
        self._waiter: asyncio.Future[None] | None = None

    def set(self) -> None:
        self._set = True
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def clear(self) -> None:
        self._set = False

    def is_set(self) -> bool:
        return self._set

    async def wait(self, timeout_s: float) -> None:
        if self._set:
            return
        loop = asyncio.get_running_loop()
        w = self._waiter = loop.create_future()
        timer = loop.call_later(timeout_s, _wake_up, w)
        try:
            await w
        finally:
            timer.cancel()
            self._waiter = None


def _wake_up(w: asyncio.Future[None]) -> None:
    if not w.done():
        w.set_result(None)


@dataclass(eq=False, slots=True)
class Request:
    """A request's payload in the core: its inputs and the future that answers it."""

    inputs: dict[str, np.ndarray]
    future: asyncio.Future[dict[str, np.ndarray]]
    answered_at: float = 0.0  # when its batch ended (the runtime's clock)


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """One executed batch, as the worker timed it (monotonic clock, seconds)."""

    model: str
    n: int
    start_s: float
    compute_s: float
    reuse: bool
    worker_pid: int


def default_slices(cfg: DeployConfig) -> SliceBackend:
    """CPU: core sets. CUDA: MPS percentages (the daemon is found or started in `start`)."""
    if cfg.device.value == "cuda":
        return MpsSlices()
    return CpuSlices(cfg.cores)


class WorkerPool(Protocol):
    """What the runtime uses of its `Supervisor` (the seam a test's fake workers plug
    into; see `Supervisor` for the contract of each method)."""

    async def start_all(self, slices: Mapping[str, SliceSpec], *,
                        passive: frozenset[str] = ...) -> dict[str, Ready]: ...
    def blocked(self) -> frozenset[str]: ...
    def worker(self, model: str) -> WorkerHandle | None: ...
    def is_ready(self, model: str) -> bool: ...
    def accepting(self, model: str) -> bool: ...
    def current_slice(self, model: str) -> SliceSpec | None: ...
    async def stop_all(self) -> None: ...
    async def start_shadows(self, slices: Mapping[str, SliceSpec], *,
                            passive: frozenset[str] = ...) -> dict[str, WorkerHandle]: ...
    async def switch(self, shadows: Mapping[str, WorkerHandle],
                     running: Callable[[str], bool]) -> None: ...


class Runtime(EarlyAdmission):
    """Dispatcher, supervisor and re-planner for one deployment. See module docstring.

    `clock` is read for every time the runtime hands the dispatch core, the policy and
    the re-planner; its waits are relative (`asyncio.timeout`), so it must run at the
    event loop's pace (the loop's own `time` in a virtual-time test). `supervisor`
    replaces the real one (deterministic fake workers in tests); it is not wired to the
    runtime's restart callbacks, so it should block no model."""

    def __init__(self, cfg: DeployConfig, *, slices: SliceBackend | None = None,
                 keep_batch_log: int = 10_000, clock: Callable[[], float] = time.monotonic,
                 supervisor: WorkerPool | None = None) -> None:
        self.cfg = cfg
        self.slices = slices or default_slices(cfg)
        self.specs: dict[str, ModelSpec] = {m.name: served_spec(m) for m in cfg.models}
        self.batch_log: deque[BatchRecord] = deque(maxlen=keep_batch_log)
        self.setup: PolicySetup | None = None
        # `workers(model)` by model, for the setup they were worked out from
        self._workers_of: tuple[PolicySetup | None, dict[str, tuple[str, ...]]] = (None, {})
        self.core: DispatchCore | None = None
        self._clock = clock
        self.supervisor: WorkerPool = supervisor if supervisor is not None else Supervisor(
            {m.name: (m, self.specs[m.name]) for m in cfg.models}, self.slices,
            on_change=self._poke, on_failed=self._model_failed,
            on_restarted=self._restarted, clock=clock, worker_nice=worker_niceness(cfg),
            cuda_graphs=cfg.cuda_graphs)
        # Requests refused because their model was restarting (503), per served model:
        # since start-up, and in the restart under way (with those that waited for it).
        self._restart_refused: dict[str, int] = {}
        self._event_refused: dict[str, int] = {}
        self._event_waited: dict[str, int] = {}
        # The model repository (`dstack.runtime.repository`): every model's config, served
        # or not, and the state of those not simply served (loading, unloading, unloaded).
        self.known_configs: dict[str, ModelConfig] = {m.name: m for m in cfg.models}
        self.repo_state: dict[str, RepoEntry] = {}
        self._plan_lock = asyncio.Lock()  # one re-plan, load or unload at a time
        self.replanner: Replanner | None = None
        self._solver: SolverProcess | None = None  # where the re-planner solves
        # Double buffering (`double_buffer`): each worker's arena halves, by worker.
        self._stagers: weakref.WeakKeyDictionary[WorkerHandle, Stager] = (
            weakref.WeakKeyDictionary())
        self._wake = Wake()
        self._tasks: set[asyncio.Task[None]] = set()
        self._dispatcher: asyncio.Task[None] | None = None
        self._adapter: asyncio.Task[None] | None = None
        self._ready = False
        self._closing = False
        # How late the loop runs what is due: a running mean of how late a timer fires
        # (`_watch_lag`). A loop that falls behind (its process short of CPU, or more work
        # than it can do) delays every request it has not answered yet by a multiple of it.
        self.loop_lag_s = 0.0
        self.loop_late = Lateness()  # each tick of that timer, by how late it fired
        self._lag_watch: asyncio.Task[None] | None = None
        # Told the cores where the server's own process costs the workers least
        # (`quiet_cores`) each time a plan's workers are in place: at start, after a
        # re-plan, a load or an unload (`dstack serve` keeps its process there).
        self.on_plan: Callable[[tuple[int, ...]], None] | None = None
        self._host_cores = available_cores()
        self._init_admission(cfg)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        # MPS: find or start the control daemon before any worker makes a CUDA context.
        self.slices.open()
        try:
            await self._start()
        except BaseException:
            await self._stop_solver()
            self.slices.close()
            raise

    async def _stop_solver(self) -> None:
        if self._solver is not None:
            await asyncio.to_thread(self._solver.stop)
            self._solver = None

    async def _start(self) -> None:
        self.setup = await asyncio.to_thread(setup_policy, self.cfg, self.slices,
                                             origin=self._clock())
        policy = self.setup.policy
        slices = policy.slices()
        adapts = policy.name is PolicyName.DSTACK and self.cfg.adapt.enabled
        solver_up = None
        if adapts and solve_in_process(self.cfg):
            self._solver = SolverProcess()
            solver_up = asyncio.ensure_future(self._solver.start())  # beside the workers'
        try:
            ready = await self.supervisor.start_all(
                slices, passive=passive_models(slices, policy.concurrent, self.setup.guests))
        finally:
            if solver_up is not None:
                await asyncio.gather(solver_up, return_exceptions=True)
        if solver_up is not None:  # the solver could not start: neither can the server
            log.info("re-plans solved in process %d (adapt.solve_in: %s)",
                     solver_up.result(), self.cfg.adapt.solve_in)
        estimates = dict(self.setup.estimates)
        for name, info in ready.items():
            # No profile: the worker's warm-up timings seed its estimate.
            estimates.setdefault(name, LinearLatency.from_points(
                1, info.warm_ms_batch1 / 1000, info.max_batch, info.warm_ms_max / 1000))
        self.core = DispatchCore(
            [CoreModel(m.name, m.slo_ms / 1000, m.max_batch_size, m.max_queue)
             for m in self.setup.run_cfg.models],
            policy, estimates, now=self._clock(),  # the cycle starts as serving starts
            groups=self.setup.groups())
        self._placed()
        await self._correct_profiles(ready)
        if adapts:
            self.replanner = Replanner(self.cfg, self.slices, self._hand_over, self._clock,
                                       self.setup, self._solver, self._live_batch_s,
                                       self.supervisor.start_times)
            self._adapter = asyncio.create_task(self.replanner.run(), name="dstack-adapt")
        self._dispatcher = asyncio.create_task(self._dispatch_loop(), name="dstack-dispatch")
        self._lag_watch = asyncio.create_task(self._watch_lag(), name="dstack-loop-lag")
        self._ready = True
        log.info("runtime ready: policy %s, %d models", policy.name, len(self.specs))

    async def _correct_profiles(self, ready: Mapping[str, Ready]) -> None:
        """Where the workers' warm-up batches disagree with their models' profiles by more
        than `profile_margin`, say so in one line and plan again with the profiles'
        latencies scaled by what was measured, before the first request is served (a
        model whose slice changes gets a new worker, as on a re-plan)."""
        setup = self.setup
        assert setup is not None
        if (self.cfg.policy not in (PolicyName.DSTACK, PolicyName.SPATIAL)
                or self.cfg.profile_margin is None or not setup.profiles):
            return
        ratios = latency_ratios(setup, {w: (1, r.warm_ms_batch1 / 1000)
                                        for w, r in ready.items()})
        served = served_of(setup)
        profiles, factors = corrected_profiles(self.cfg, served, ratios)
        if not factors:
            return
        device = next(iter(served.values())).device.name
        log.warning("profiles: warm-up batches of one item disagree with the profiles "
                    "(measured on %s) by more than profile_margin %g: %s; planning with "
                    "those latencies scaled", device, self.cfg.profile_margin, "; ".join(
                        f"{m} {1000 * ratios[m][0]:.1f} ms, profile {1000 * ratios[m][1]:.1f}"
                        f" ms (x{f:.2f})" for m, f in factors.items()))
        corrected = await asyncio.to_thread(
            setup_policy, self.cfg, self.slices, origin=self._clock(), profiles=profiles,
            replicas=setup.replicas, guests=setup.guests)
        await self._hand_over(corrected, {})

    def _live_batch_s(self) -> dict[str, tuple[int, float]]:
        """(n, seconds): what a batch of the size its recent batches had takes by each
        worker's live estimate, where real batches have confirmed it (the re-planner
        compares it with the plan's profiles at that size)."""
        core = self.core
        if core is None:
            return {}
        return {w: (est.typical_n(), est.estimate_s(est.typical_n()))
                for w, est in core.trusted_estimates().items()}

    async def stop(self) -> None:
        self._closing = True
        self._ready = False
        for t in (self._dispatcher, self._adapter, self._lag_watch, *self._tasks):
            if t is not None:
                t.cancel()
        for t in (self._dispatcher, self._adapter, self._lag_watch, *list(self._tasks)):
            if t is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
        if self.core is not None:
            self._fail(self.core.drain(), Unavailable("server is shutting down"))
        await self.supervisor.stop_all()
        await self._stop_solver()
        self.slices.close()  # stops an MPS daemon the runtime started, after its clients

    async def _watch_lag(self) -> None:
        before = 0.0
        while True:  # the loop's own time, whatever clock the runtime was given
            due = time.monotonic() + LAG_TICK_S
            await asyncio.sleep(LAG_TICK_S)
            late = max(0.0, time.monotonic() - due)
            self.loop_late.add(late)
            # Late twice in a row: a loop that stays behind is late at every turn, while one
            # that blocked once (the app's start-up, a collection) is on time again at the
            # next, and that block says nothing of the requests after it.
            weight = 1.0 - math.exp(-(LAG_TICK_S + late) / LAG_TAU_S)
            self.loop_lag_s += weight * (min(late, before) - self.loop_lag_s)
            before = late

    def _spawn(self, coro: object) -> None:
        t = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def _poke(self) -> None:
        self._wake.set()

    def _model_failed(self, model: str, err: DStackError) -> None:
        self._restart_ended(model, None, None)
        if self.core is not None:
            self._fail(self.core.drain(model),
                       Unavailable(f"model {model} is unavailable: {err.message}"))

    def _restarted(self, worker: str, took_s: float, expected_s: float | None) -> None:
        self._restart_ended(worker, took_s, expected_s)

    def _restart_ended(self, worker: str, took_s: float | None,
                       expected_s: float | None) -> None:
        """One log line per restart event, with what it cost (the requests refused while
        it lasted are not logged one by one)."""
        model = public_name(worker)
        refused = self._event_refused.pop(model, 0)
        waited = self._event_waited.pop(model, 0)
        expected = f" (expected {expected_s:.1f} s)" if expected_s is not None else ""
        outcome = (f"restarted in {took_s:.1f} s{expected}" if took_s is not None
                   else "could not be restarted")
        log.log(logging.WARNING if refused or took_s is None else logging.INFO,
                "model %s: worker %s %s; meanwhile %d requests were refused (503 %s) and "
                "%d waited for it", model, worker, outcome, refused, RESTARTING, waited)

    # ------------------------------------------------------------------ backend API

    @property
    def policy(self) -> Policy | None:
        return self.core.policy if self.core is not None else None

    @property
    def replans(self) -> int:
        return self.replanner.replans if self.replanner is not None else 0

    def model_names(self) -> list[str]:
        return list(self.specs)

    def spec(self, model: str) -> ModelSpec:
        try:
            return self.specs[model]
        except KeyError:
            pass
        st = self.repo_state.get(model)
        if st is not None and st.state is ModelState.LOADING:
            raise Unavailable(f"model {model} is loading")
        if st is not None:
            raise ModelNotFound(f"model {model} is not loaded: {st.reason}; load it with "
                                f"POST /v2/repository/models/{model}/load")
        raise ModelNotFound(
            f"unknown model {model!r}; served models: {', '.join(self.specs)}")

    # ------------------------------------------------------------------ repository

    def clock(self) -> float:
        return self._clock()

    def repository_index(self) -> list[RepoEntry]:
        """Every model served, loading, unloading or unloaded, with its state."""
        out = []
        for name in self.known_configs:
            st = self.repo_state.get(name)
            if st is not None:
                out.append(st)
            elif name in self.specs:
                ready = self.is_model_ready(name)
                why = "" if ready else ("restarting" if self._restarting(name) else "not ready")
                out.append(RepoEntry(name, ModelState.READY if ready else ModelState.UNAVAILABLE,
                                     why))
        return out

    async def load_model(self, model: str, config: dict[str, object] | None = None) -> bool:
        """Load `model` (Triton's repository load), with `config` (the model's dstack
        config, as under `models:`) or the one it was known by. False: it is served with
        that config already (nothing done). A served model given another config is
        unloaded (its queue finished) and loaded again with it."""
        from dstack.runtime import repository

        async with self._plan_lock:
            if self.core is None or self._closing:
                raise Unavailable("server is not ready")
            m = model_config(self, model, config)
            if model in self.specs:
                if self.cfg.model(model) == m and model not in self.repo_state:
                    return False
                await repository.unload(self, model, "reloading with a new config")
            await repository.load(self, m)
            return True

    async def unload_model(self, model: str) -> bool:
        """Unload `model` (Triton's repository unload). False: it was not loaded."""
        from dstack.runtime import repository

        async with self._plan_lock:
            if self.core is None or self._closing:
                raise Unavailable("server is not ready")
            if model not in self.specs:
                if model in self.known_configs:
                    return False
                self.spec(model)  # 404
            await repository.unload(self, model, "unload requested")
            return True

    def fail_queued(self, worker: str, err: DStackError) -> None:
        """Fail every request queued for `worker` with `err`."""
        if self.core is not None:
            self._fail(self.core.drain(worker), err)

    def models_changed(self, cfg: DeployConfig, setup: PolicySetup, now: float,
                       estimates: dict[str, LinearLatency]) -> None:
        """Hand over to the plan for a new set of models (the core has them already)."""
        assert self.core is not None
        self.core.set_policy(setup.policy, now, estimates)
        self.cfg = cfg
        self.setup = setup
        if self.replanner is not None:
            self.replanner.models_changed(cfg, setup)
        self._placed()
        self._wake.set()

    def quiet_cores(self) -> tuple[int, ...]:
        """The cores where the server's own process costs the plan's workers least
        (`dstack.common.slices.quiet_cores`); all of them on a GPU."""
        assert self.setup is not None
        slo_s = {m.name: m.slo_ms / 1000 for m in self.setup.run_cfg.models}
        # guest workers run only in their lane's gaps: the lane's own SLOs are what count
        slices = {w: s for w, s in self.setup.policy.slices().items()
                  if w not in self.setup.guests}
        return quiet_cores(slices, slo_s, self._host_cores)

    def _placed(self) -> None:
        if self.on_plan is None:
            return
        cores = self.quiet_cores()
        try:
            self.on_plan(cores)
            if self._solver is not None:
                self._solver.pin(cores)
        except OSError as e:  # a core taken offline since start-up: serving goes on
            log.warning("could not move the server's process to cores %s: %s", list(cores), e)

    def is_ready(self) -> bool:
        return self._ready and all(self.is_model_ready(m) for m in self.specs)

    def workers(self, model: str) -> tuple[str, ...]:
        """The workers serving `model`: itself, then its replicas (`m#1`, ...), then its
        guest workers on other lanes (`m#g1`, ...)."""
        setup = self.setup
        if setup is None:
            return (model,)
        known, by_model = self._workers_of
        if known is not setup:  # a new plan: worked out again (asked several times a request)
            by_model = {}
            self._workers_of = (setup, by_model)
        got = by_model.get(model)
        if got is None:
            guests = tuple(g for g, h in setup.guests.items() if public_name(h) == model)
            got = by_model[model] = replica_names(model, setup.replicas.get(model, 1)) + guests
        return got

    def is_model_ready(self, model: str) -> bool:
        self.spec(model)
        return self._ready and all(self.supervisor.is_ready(w) for w in self.workers(model))

    def plan(self) -> Plan | None:
        return self.policy.plan() if self.policy else None

    def schedule(self) -> Schedule | None:
        return self.policy.schedule() if self.policy else None

    def policy_name(self) -> str:
        return self.cfg.policy.value

    def deploy_config(self) -> DeployConfig:
        return self.cfg

    def forget_device_memory(self, handle: bytes) -> None:
        for worker in list(self._stagers):  # every worker a batch may have reached
            worker.forget(handle)

    def stats(self, model: str) -> ModelStats:
        self.spec(model)
        restarting = self._restart_refused.get(model, 0)
        if self.core is None:
            return ModelStats(model, 0, restarting, 0, 0, 0, 0, restarting, 0, 0)
        c = self.core.counters(model)
        refused = c.refused_total + restarting
        return ModelStats(model, c.served, c.failed + refused, c.items, c.batches,
                          int(c.queue_s * 1e9), int(c.compute_s * 1e9), refused,
                          c.within_slo, self.core.pending(model))

    def refusals(self, model: str) -> dict[str, int]:
        """Refusals of `model` by the rule that refused them (for /metrics): the dispatch
        core's rules, and `restarting` (503: it could not wait for its worker's restart)."""
        self.spec(model)
        out = dict(self.core.counters(model).refused) if self.core is not None else {}
        out[RESTARTING] = self._restart_refused.get(model, 0)
        return out

    def restarts(self, model: str) -> RestartInfo:
        """The model's worker restarts (for /metrics): a model with replicas, theirs
        summed, with the longest last restart."""
        self.spec(model)
        infos = [self.supervisor.restart_info(w) for w in self.workers(model)
                 ] if isinstance(self.supervisor, Supervisor) else []
        lasts = [i.last_s for i in infos if i.last_s is not None]
        expected = [i.expected_s for i in infos if i.expected_s is not None]
        died = [i.died_at for i in infos if i.died_at is not None]
        return RestartInfo(min(died) if died else None, max(expected) if expected else None,
                           sum(i.count for i in infos), max(lasts) if lasts else None)

    def admission_terms(self, model: str) -> dict[str, float]:
        """What the checks before admission count for a request of `model` besides its
        batches' compute and the work ahead of it, in seconds (for /metrics): `body`, the
        time its body takes to arrive (`body_s`); `loop`, LAG_TURNS of the event loop's
        lag; `overhead`, the hand-over of each batch to its worker and back; `delivery`,
        its answer's way out; and `margin`, the factor a finish behind work is scaled by.
        Empty before the runtime is ready."""
        self.spec(model)
        if self.core is None:
            return {}
        overhead, delivery, margin = self.core.admission_terms(model)
        return {"body": self.body_s(model), "loop": LAG_TURNS * self.loop_lag_s,
                "overhead": overhead, "delivery": delivery, "margin": margin}

    def current_batch_cap(self, model: str) -> int:
        """The batch size the policy aims for now (for metrics)."""
        return self.policy.batch_cap(model) if self.policy is not None else 0

    def current_slice(self, model: str) -> SliceSpec | None:
        return self.supervisor.current_slice(model)

    def _restarting(self, model: str) -> bool:
        """No worker of the model is ready and one is restarting."""
        sup = self.supervisor
        if not isinstance(sup, Supervisor):
            return False
        workers = self.workers(model)
        for w in workers:  # a loop, not any(...): asked for every request
            if sup.is_ready(w):
                return False
        return any(sup.restart_info(w).died_at is not None for w in workers)

    async def infer(self, model: str, inputs: dict[str, np.ndarray],
                    since_received_s: float = 0.0) -> dict[str, np.ndarray]:
        self.check_admission(model)
        core = self.core
        assert core is not None
        n = next(iter(inputs.values())).shape[0]
        now = self._clock()
        if self.replanner is not None:
            self.replanner.record(model, now)  # demand: counted before admission
        fut: asyncio.Future[dict[str, np.ndarray]] = asyncio.get_running_loop().create_future()
        req = Request(inputs, fut)
        got = core.admit(model, n, now, req, since_received_s)
        if not isinstance(got, Ticket):
            raise refusal_error(got.reason, got.message, got.stands_s, self.hold_s(model, got))
        if self._restarting(model):  # it waits for the worker to be back
            self._event_waited[model] = self._event_waited.get(model, 0) + 1
        stager = self._stager(self.supervisor.worker(core.names[got.model]))
        if stager is not None:
            stager.add(got)  # its rows go into the next batch's half now
        if not core.running(core.names[got.model]):  # its replica, where it has several
            self._wake.set()
        out = await fut
        core.observe_delivery(got.model, self._clock() - req.answered_at)
        return out

    # ------------------------------------------------------------------ dispatcher

    async def _dispatch_loop(self) -> None:
        core = self.core
        assert core is not None
        while not self._closing:
            self._wake.clear()
            now = self._clock()
            wake: float | None
            try:
                s = core.step(now, blocked=self._blocked())
                self._apply(s)
                wake = s.wake_at
            except Exception as e:  # noqa: BLE001 - the loop must go on for later requests
                log.exception("dispatch failed")
                self._fail(core.drain(), BackendError(f"dispatch failed: {e!r}"))
                wake = None
            if wake is not None and wake <= now:
                wake = now + WAKE_NUDGE_S
            timeout = MAX_IDLE_S if wake is None else min(MAX_IDLE_S, wake - self._clock())
            if timeout > 0:
                await self._wake.wait(timeout)
            else:
                await asyncio.sleep(0)

    def _blocked(self) -> frozenset[str]:
        """The supervisor's blocked workers that the core serves (a model being loaded
        has workers before the core has it)."""
        b = self.supervisor.blocked()
        if b and self.core is not None:
            index = self.core.index
            b = frozenset(n for n in b if n in index)
        return b

    def _apply(self, s: Step) -> None:
        for r in s.refusals:  # of queued requests (expired)
            e = refusal_error(r.reason, r.message)
            e.queued = True
            _resolve_error(r.ticket, e)
        for f in s.failures:
            log.error("%s", f.message, exc_info=f.error)
            self._fail(f.tickets, BackendError(f.message))
        for b in s.launches:
            self._launch(b)

    def _launch(self, b: Batch) -> None:
        core = self.core
        assert core is not None
        worker = self.supervisor.worker(b.model)
        try:
            if worker is None:
                raise Unavailable(f"model {b.model} has no worker ready")
            # Inputs copied and the batch sent here, in the dispatcher, before the
            # responses of the batch that just ended are written: the worker starts at once.
            stager = self._stager(worker)
            half: int | None = None
            if stager is None:
                for name, dst in worker.arena.inputs(b.n).items():
                    np.concatenate([_req(t).inputs[name] for t in b.tickets], axis=0, out=dst)
                fut = worker.submit(b.n)
            else:  # most rows are in the half already (staged on arrival)
                half, fresh_from, device_rows = stager.launch(b.tickets, b.n)
                fut = worker.submit(b.n, half, fresh_from, device_rows)
        except Exception as e:  # noqa: BLE001 - failed like a batch, below
            err = e if isinstance(e, DStackError) else BackendError(
                f"{b.model}: could not start a batch of {b.n}: {e!r}")
            if not isinstance(e, DStackError):
                log.exception("launch of a batch of %s failed", b.model)
            self._fail(core.fail(b, self._clock()), err)
            self._wake.set()
            return
        self._spawn(self._run_batch(b, worker, fut, half))
        if stager is not None:
            stager.restage()  # the requests still queued, into the other half

    def _stager(self, worker: WorkerHandle | None) -> Stager | None:
        """A double-buffered worker's stager (None: one arena half for every batch; a
        test's fake worker without a real arena has one half)."""
        if (worker is None or not self.cfg.double_buffer or not isinstance(worker.arena, Arena)
                or worker.state is not WorkerState.READY):
            return None
        st = self._stagers.get(worker)
        if st is None:
            st = self._stagers[worker] = Stager(worker.arena, lambda t: _req(t).inputs,
                                                 lambda t: _req(t).future.done(),
                                                 on_device=worker.reads_device_memory)
        elif st.on_device and not worker.reads_device_memory:
            st.through_host()
        return st

    async def _run_batch(self, b: Batch, worker: WorkerHandle,
                         fut: asyncio.Future[BatchDone], half: int | None = None) -> None:
        """`half`: a double-buffered batch's arena half; its outputs are read after the
        next batch has been sent (into the other half), so the worker does not wait."""
        core = self.core
        assert core is not None
        try:
            done = await fut
            if done.n != b.n:
                raise BackendError(f"{b.model}: the worker ran {done.n} items of a batch "
                                   f"of {b.n}")
            results = _outputs(worker, b.n, 0) if half is None else {}
        except asyncio.CancelledError:
            self._fail(core.fail(b, self._clock()), Unavailable("server is shutting down"))
            raise
        except Exception as e:  # noqa: BLE001 - every ticket of the batch is answered
            err = e if isinstance(e, DStackError) else BackendError(f"{b.model}: {e!r}")
            if not isinstance(e, DStackError) or isinstance(e, BackendError):
                log.error("batch of %d for %s failed: %s", b.n, b.model, err.message,
                          exc_info=not isinstance(e, DStackError))
            self._fail(core.fail(b, self._clock()), err)
            self._wake.set()
            return
        end = self._clock()
        self.batch_log.append(BatchRecord(b.model, b.n, done.start_s, done.compute_s, b.reuse,
                                          worker.pid or 0))
        tickets = core.complete(b, done.compute_s, end)
        if half is not None:
            self._notify(b, done.compute_s, end)
            self._step_now()  # the next batch goes out before these outputs are read
            try:
                results = _outputs(worker, b.n, half)
            except Exception as e:  # noqa: BLE001 - every ticket of the batch is answered
                log.exception("reading the outputs of a batch of %s failed", b.model)
                self._fail(tickets, BackendError(f"{b.model}: {e!r}"))
                self._wake.set()
                return
        i = 0
        for t in tickets:
            res = {k: v[i:i + t.n] for k, v in results.items()}
            i += t.n
            req = _req(t)
            if not req.future.done():
                req.answered_at = end
                req.future.set_result(res)
        if half is None:
            self._notify(b, done.compute_s, end)
        self._wake.set()

    def _notify(self, b: Batch, compute_s: float, end: float) -> None:
        core = self.core
        assert core is not None
        try:
            core.notify_policy(b, compute_s, end)
        except Exception:  # its requests are answered; later batches go on
            log.exception("policy %s failed after a batch of %s", core.policy.name, b.model)

    def _step_now(self) -> None:
        """One step of the dispatch loop, here and now (the loop is woken as well)."""
        core = self.core
        assert core is not None
        try:
            self._apply(core.step(self._clock(), blocked=self._blocked()))
        except Exception as e:  # noqa: BLE001 - as in the loop: later requests go on
            log.exception("dispatch failed")
            self._fail(core.drain(), BackendError(f"dispatch failed: {e!r}"))

    def _fail(self, tickets: tuple[Ticket, ...] | list[Ticket], err: DStackError) -> None:
        for t in tickets:
            _resolve_error(t, err)

    # ------------------------------------------------------------------ re-planning

    async def _hand_over(self, setup: PolicySetup, rates: dict[str, float]) -> None:
        """Start shadows for models whose slice changes, switch when they are ready, then
        give the core the new policy, all on the event loop."""
        core = self.core
        assert core is not None
        async with self._plan_lock:
            current = self.setup
            if current is not None and ({m.name for m in current.run_cfg.models}
                                        != {m.name for m in setup.run_cfg.models}):
                raise StalePlan
            new_slices = setup.policy.slices()
            shadows = await self.supervisor.start_shadows(
                new_slices, passive=passive_models(new_slices, setup.policy.concurrent,
                                                   setup.guests))
            await self.supervisor.switch(shadows, core.running)
            core.set_policy(setup.policy, self._clock(), setup.estimates)
            self.setup = setup
            self._placed()
            self._wake.set()


def _req(t: Ticket) -> Request:
    return t.payload  # type: ignore[return-value]


def _outputs(worker: WorkerHandle, n: int, half: int) -> dict[str, np.ndarray]:
    """Copies of a batch's outputs: the arena is the worker's again once it is read."""
    if half == 0:  # one half: a test's fake arena takes no half
        return {k: v.copy() for k, v in worker.arena.outputs(n).items()}
    return {k: v.copy() for k, v in worker.arena.outputs(n, half).items()}


def _resolve_error(t: Ticket, err: Exception) -> None:
    fut = _req(t).future
    if not fut.done():
        fut.set_exception(err)
