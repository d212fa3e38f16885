"""The runtime: request queues, the asyncio dispatcher, workers and their supervisor.

`Runtime` implements `dstack.backend.InferenceBackend`. Every request gets a deadline
(arrival + SLO) and one future, registered before it is queued and resolved on every path:
success, refusal (queue full, deadline can no longer be met), worker failure or death,
shutdown. The policy (`dstack.policies`) decides what runs; this module only waits, copies
tensors into the workers' shared memory, and resolves futures.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from dstack.adapt import RateTracker, ReplanTrigger
from dstack.backend import ModelStats
from dstack.config import ConfigError, DeployConfig, ModelConfig, PolicyName
from dstack.decisions import Policy, QueueView
from dstack.errors import (
    BackendError,
    DeadlineRefused,
    DStackError,
    ModelNotFound,
    Overloaded,
    Unavailable,
)
from dstack.latency import LinearLatency
from dstack.messages import BatchDone
from dstack.planning import PolicySetup, setup_policy
from dstack.slices import CpuSlices, MpsSlices, SliceBackend, SliceSpec
from dstack.types import ModelSpec, Plan, Schedule
from dstack.worker import WorkerConfig, WorkerHandle, WorkerState, arena_for

log = logging.getLogger("dstack.runtime")


@dataclass(eq=False, slots=True)
class Request:
    model: str
    inputs: dict[str, np.ndarray]
    n: int
    arrival: float
    deadline: float
    future: asyncio.Future[dict[str, np.ndarray]]


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """One executed batch, as the worker timed it (monotonic clock, seconds)."""

    model: str
    n: int
    start_s: float
    compute_s: float
    reuse: bool
    worker_pid: int


@dataclass(slots=True)
class _Counters:
    success: int = 0
    failure: int = 0
    inferences: int = 0
    executions: int = 0
    queue_ns: int = 0
    compute_ns: int = 0
    refused: int = 0
    slo_met: int = 0


@dataclass(slots=True)
class _ModelState:
    cfg: ModelConfig
    spec: ModelSpec
    queue: deque[Request] = field(default_factory=deque)
    items: int = 0
    worker: WorkerHandle | None = None
    running: bool = False
    restarting: bool = False
    held: bool = False  # switching to a shadow worker: launch nothing until it is attached
    last_done: float = 0.0  # monotonic time its last batch finished (or serving began)
    counters: _Counters = field(default_factory=_Counters)


def served_spec(m: ModelConfig) -> ModelSpec:
    """The zoo's spec with the configured max batch (or one built from the config for a
    TorchScript / builder model outside the zoo)."""
    import models
    from dstack.types import DType, TensorSpec

    try:
        base = models.spec(m.zoo)
    except models.ModelZooError as e:
        if m.input_shape is None or m.num_classes is None:
            if m.torchscript is not None or m.builder is not None:
                raise ConfigError(
                    f"models.{m.name}: not in the zoo, so give input_shape and num_classes"
                ) from None
            raise ConfigError(f"models.{m.name}: {e}") from None
        base = ModelSpec(
            m.name,
            (TensorSpec("input", DType.FP32, (-1, *m.input_shape)),),
            (TensorSpec("output", DType.FP32, (-1, m.num_classes)),),
            m.max_batch_size,
        )
    if m.input_shape is not None:
        base = ModelSpec(base.name, (TensorSpec(base.inputs[0].name, base.inputs[0].datatype,
                                                (-1, *m.input_shape)), *base.inputs[1:]),
                         base.outputs, base.max_batch_size)
    return ModelSpec(m.name, base.inputs, base.outputs, m.max_batch_size)


def default_slices(cfg: DeployConfig) -> SliceBackend:
    """CPU: core sets. CUDA: MPS percentages (the daemon is found or started in `start`)."""
    if cfg.device.value == "cuda":
        return MpsSlices()
    return CpuSlices(cfg.cores)


class Runtime:
    """Queues, dispatcher and workers for one deployment. See module docstring."""

    def __init__(self, cfg: DeployConfig, *, slices: SliceBackend | None = None,
                 keep_batch_log: int = 10_000) -> None:
        self.cfg = cfg
        self.slices = slices or default_slices(cfg)
        self.models: dict[str, _ModelState] = {
            m.name: _ModelState(m, served_spec(m)) for m in cfg.models
        }
        self.batch_log: deque[BatchRecord] = deque(maxlen=keep_batch_log)
        self.setup: PolicySetup | None = None
        self.policy: Policy | None = None
        self.latency: dict[str, LinearLatency] = {}
        self.rates = RateTracker(list(self.models), alpha=cfg.adapt.ewma_alpha)
        self.trigger: ReplanTrigger | None = None
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._dispatcher: asyncio.Task[None] | None = None
        self._adapter: asyncio.Task[None] | None = None
        self._ready = False
        self._closing = False
        self._replanning = False
        self.replans = 0

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        # MPS: find or start the control daemon before any worker makes a CUDA context.
        opener = getattr(self.slices, "open", None)
        if opener is not None:
            opener()
        try:
            await self._start()
        except BaseException:
            self._close_slices()
            raise

    def _close_slices(self) -> None:
        closer = getattr(self.slices, "close", None)
        if closer is not None:
            closer()

    async def _start(self) -> None:
        self.setup = setup_policy(self.cfg, self.slices, origin=time.monotonic())
        self.policy = self.setup.policy
        self.latency = self.policy.latency if hasattr(self.policy, "latency") else {}
        slices = self.policy.slices()
        handles = await asyncio.gather(
            *(self._start_worker(name, slices[name]) for name in self.models),
            return_exceptions=True,
        )
        errors = [h for h in handles if isinstance(h, BaseException)]
        for name, h in zip(self.models, handles, strict=True):
            if isinstance(h, WorkerHandle):
                self._attach(name, h)
        if errors:
            await self.stop()
            raise errors[0]
        # Anchor the cycle at the moment serving starts.
        self._reanchor()
        for st in self.models.values():
            st.last_done = time.monotonic()
        if self.policy.name is PolicyName.DSTACK and self.cfg.adapt.enabled:
            self.trigger = ReplanTrigger(
                {m.name: m.rate_rps for m in self.cfg.models},
                drift=self.cfg.adapt.drift, hold_s=self.cfg.adapt.hold_s,
                down_hold_s=self.cfg.adapt.down_hold_s,
            )
            self._adapter = asyncio.create_task(self._adapt_loop(), name="dstack-adapt")
        self._dispatcher = asyncio.create_task(self._dispatch_loop(), name="dstack-dispatch")
        self._ready = True
        log.info("runtime ready: policy %s, %d models", self.policy.name, len(self.models))

    def _reanchor(self) -> None:
        if hasattr(self.policy, "origin"):
            self.policy.origin = time.monotonic()  # type: ignore[union-attr]

    async def _start_worker(self, name: str, sl: SliceSpec,
                            warmup_batch: int | None = None) -> WorkerHandle:
        st = self.models[name]
        wcfg = WorkerConfig(
            model=name, zoo_name=st.cfg.zoo, spec=st.spec, slice=sl, arena_name="",
            layout=arena_for(st.spec),
            warmup_batch=warmup_batch or st.cfg.max_batch_size,
            weights=str(st.cfg.weights) if st.cfg.weights else None,
            torchscript=str(st.cfg.torchscript) if st.cfg.torchscript else None,
            builder=st.cfg.builder,
            extra_env=getattr(self.slices, "worker_env", dict)(),
        )
        h = WorkerHandle.create(wcfg)
        try:
            info = await h.start()
        except BaseException:
            await h.kill()
            raise
        if name not in self.latency:
            self.latency[name] = LinearLatency.from_points(
                1, info.warm_ms_batch1 / 1000, info.max_batch, info.warm_ms_max / 1000
            )
        log.info("worker %s ready (pid %s, slice %g%% %s)", name, h.pid, sl.percent,
                 list(sl.units))
        return h

    def _attach(self, name: str, h: WorkerHandle) -> None:
        h.on_death.append(self._on_worker_death)
        self.models[name].worker = h

    def _on_worker_death(self, h: WorkerHandle) -> None:
        name = h.cfg.model
        st = self.models[name]
        if st.worker is not h or self._closing:
            return
        log.error("worker %s (pid %s) died; restarting it", name, h.pid)
        st.restarting = True
        self._spawn(self._restart(name, h.cfg.slice))

    async def _restart(self, name: str, sl: SliceSpec) -> None:
        st = self.models[name]
        old = st.worker
        try:
            h = await self._start_worker(name, sl)
        except DStackError as e:
            log.error("restart of %s failed: %s", name, e)
            self._fail_queue(name, Unavailable(f"model {name} is unavailable: {e.message}"))
            return
        finally:
            st.restarting = False
        if old is not None:
            await old.kill()
        if self._closing:
            await h.stop()
            return
        self._attach(name, h)
        self._wake.set()

    async def stop(self) -> None:
        self._closing = True
        self._ready = False
        for t in (self._dispatcher, self._adapter):
            if t is not None:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for name in self.models:
            self._fail_queue(name, Unavailable("server is shutting down"))
        await asyncio.gather(
            *(st.worker.stop() for st in self.models.values() if st.worker is not None),
            return_exceptions=True,
        )
        self._close_slices()  # stops an MPS daemon the runtime started, after its clients

    def _spawn(self, coro: object) -> None:
        t = asyncio.create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ backend API

    def model_names(self) -> list[str]:
        return list(self.models)

    def spec(self, model: str) -> ModelSpec:
        return self._state(model).spec

    def _state(self, model: str) -> _ModelState:
        try:
            return self.models[model]
        except KeyError:
            raise ModelNotFound(
                f"unknown model {model!r}; served models: {', '.join(self.models)}"
            ) from None

    def is_ready(self) -> bool:
        return self._ready and all(self.is_model_ready(m) for m in self.models)

    def is_model_ready(self, model: str) -> bool:
        w = self._state(model).worker
        return self._ready and w is not None and w.state is WorkerState.READY

    def plan(self) -> Plan | None:
        return self.policy.plan() if self.policy else None

    def schedule(self) -> Schedule | None:
        return self.policy.schedule() if self.policy else None

    def policy_name(self) -> str:
        return self.cfg.policy.value

    def stats(self, model: str) -> ModelStats:
        st = self._state(model)
        c = st.counters
        return ModelStats(model, c.success, c.failure, c.inferences, c.executions,
                          c.queue_ns, c.compute_ns, c.refused, c.slo_met,
                          len(st.queue) + (1 if st.running else 0))

    def current_batch_cap(self, model: str) -> int:
        """The batch size the policy aims for now (for metrics)."""
        p = self.policy
        if p is None:
            return 0
        if p.plan() is not None:
            return p.plan().for_model(model).batch  # type: ignore[union-attr]
        cap = getattr(p, "batch_cap", None)
        return int(cap(model)) if cap else self.models[model].cfg.max_batch_size

    def current_slice(self, model: str) -> SliceSpec | None:
        w = self.models[model].worker
        return w.cfg.slice if w else None

    async def infer(self, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        st = self._state(model)
        if self._closing or not self._ready:
            raise Unavailable("server is not ready")
        if st.worker is None or (st.worker.state is not WorkerState.READY and not st.restarting):
            raise Unavailable(f"model {model} is not ready")
        n = next(iter(inputs.values())).shape[0]
        now = time.monotonic()
        self.rates.record(model, now)
        if st.items + n > st.cfg.max_queue:
            raise _refused(st, Overloaded(
                f"model {model}: queue is full ({st.items} items waiting, max_queue "
                f"{st.cfg.max_queue}); retry later"
            ))
        deadline = now + st.cfg.slo_ms / 1000
        est = self._refusal_estimate(model, now)
        if est is not None and now + est.estimate_s(n) > deadline:
            raise _refused(st, DeadlineRefused(
                f"model {model}: a batch of {n} takes about {est.estimate_s(n) * 1000:.1f} ms, "
                f"over its SLO of {st.cfg.slo_ms:g} ms"
            ))
        fut: asyncio.Future[dict[str, np.ndarray]] = asyncio.get_running_loop().create_future()
        req = Request(model, inputs, n, now, deadline, fut)
        st.queue.append(req)  # one SLO per model: FIFO order is earliest-deadline order
        st.items += n
        self._wake.set()
        return await fut

    # ------------------------------------------------------------------ dispatcher

    def _refusal_estimate(self, name: str, now: float) -> LinearLatency | None:
        """The latency estimate that may refuse requests of `name`, or None while it is
        only a seed (see LinearLatency.trusted) or stale: when the model has finished no
        batch for max(1 s, its SLO) while idle, the next request is let through as a probe,
        so an estimate that says "too slow" cannot refuse everything for ever."""
        est = self.latency.get(name)
        if est is None or not est.trusted:
            return None
        st = self.models[name]
        if not st.running and now - st.last_done > max(1.0, st.cfg.slo_ms / 1000):
            return None
        return est

    def _views(self) -> dict[str, QueueView]:
        out = {}
        for name, st in self.models.items():
            head = st.queue[0] if st.queue else None
            busy = (st.running or st.held or st.worker is None
                    or st.worker.state is not WorkerState.READY)
            out[name] = QueueView(name, st.items, head.arrival if head else None,
                                  head.deadline if head else None, busy)
        return out

    def _refuse_doomed(self, now: float) -> float | None:
        """Refuse queued requests that can no longer meet their deadline, even if run
        alone right now. Returns when the next one would become doomed."""
        nxt: float | None = None
        for name, st in self.models.items():
            est = self._refusal_estimate(name, now)
            run_s = est.estimate_s(1) if est else 0.0
            while st.queue and st.queue[0].deadline - run_s < now:
                r = st.queue.popleft()
                st.items -= r.n
                _fail(r, _refused(st, DeadlineRefused(
                    f"model {name}: request waited {1000 * (now - r.arrival):.1f} ms and can no "
                    f"longer be answered within its SLO of {st.cfg.slo_ms:g} ms"
                )))
            if st.queue:
                t = st.queue[0].deadline - run_s
                nxt = t if nxt is None else min(nxt, t)
        return nxt

    async def _dispatch_loop(self) -> None:
        while not self._closing:
            self._wake.clear()
            now = time.monotonic()
            doom = self._refuse_doomed(now)
            assert self.policy is not None
            try:
                decision = self.policy.decide(now, self._views())
            except Exception:  # a policy bug must not hang every client
                log.exception("policy %s failed", self.policy.name)
                for name in self.models:
                    self._fail_queue(name, BackendError("scheduler error; see server log"))
                decision = None
            if decision is not None:
                for launch in decision.launches:
                    self._launch(launch.model, launch.max_items, launch.reuse, now)
            wake = decision.wake_at if decision else None
            if doom is not None:
                wake = doom if wake is None else min(wake, doom)
            timeout = None if wake is None else max(0.0, wake - time.monotonic())
            if timeout is None or timeout > 0:
                # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation
                # that races with the event, and then stop() would wait forever.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout):
                        await self._wake.wait()
            else:
                await asyncio.sleep(0)

    def _launch(self, model: str, max_items: int, reuse: bool, now: float) -> None:
        st = self.models[model]
        if (st.running or st.held or st.worker is None
                or st.worker.state is not WorkerState.READY):
            return
        batch: list[Request] = []
        taken = 0
        # The first request always goes (the server checked it fits max_batch_size),
        # then whole requests while they fit the policy's cap and the arena.
        while st.queue and (
            not batch or taken + st.queue[0].n <= min(max_items, st.spec.max_batch_size)
        ):
            r = st.queue.popleft()
            st.items -= r.n
            batch.append(r)
            taken += r.n
        # Refuse, rather than serve late, the requests this batch would answer after their
        # deadline. FIFO order is deadline order, so only heads can be late.
        est = self._refusal_estimate(model, now)
        while batch and est is not None and batch[0].deadline < now + est.estimate_s(taken):
            r = batch.pop(0)
            taken -= r.n
            _fail(r, _refused(st, DeadlineRefused(
                f"model {model}: request waited {1000 * (now - r.arrival):.1f} ms; the next batch "
                f"would answer it after its SLO of {st.cfg.slo_ms:g} ms"
            )))
        if not batch:
            return
        st.running = True
        worker = st.worker
        # Inputs copied and the batch sent here, in the dispatcher, before the responses
        # of the batch that just ended are written: the worker starts without waiting.
        fut: asyncio.Future[BatchDone]
        try:
            for name, dst in worker.arena.inputs(taken).items():
                np.concatenate([r.inputs[name] for r in batch], axis=0, out=dst)
            fut = worker.submit(taken)
        except Exception as e:  # noqa: BLE001 - failed like a batch (in _run_batch)
            fut = asyncio.get_running_loop().create_future()
            fut.set_exception(e)
        self._spawn(self._run_batch(st, worker, batch, taken, reuse, fut, now))

    async def _run_batch(self, st: _ModelState, worker: WorkerHandle, batch: list[Request],
                         n: int, reuse: bool, fut: asyncio.Future[BatchDone],
                         started: float) -> None:
        try:
            done = await fut
            outs = worker.arena.outputs(n)
            results = {k: v.copy() for k, v in outs.items()}  # leave the arena to the worker
            del outs
        except asyncio.CancelledError:
            for r in batch:
                _fail(r, Unavailable("server is shutting down"))
            raise
        except Exception as e:
            err = e if isinstance(e, DStackError) else BackendError(f"{st.cfg.name}: {e}")
            if not isinstance(e, DStackError):
                log.exception("batch for %s failed", st.cfg.name)
            for r in batch:
                st.counters.failure += 1
                _fail(r, err)
            return
        finally:
            st.running = False
            self._wake.set()
        end = time.monotonic()
        st.last_done = end
        c = st.counters
        c.executions += 1
        c.inferences += n
        c.compute_ns += int(done.compute_s * 1e9)
        self.batch_log.append(BatchRecord(st.cfg.name, n, done.start_s, done.compute_s, reuse,
                                          worker.pid or 0))
        est = self.latency.get(st.cfg.name)
        if est is not None:
            est.observe(n, done.compute_s)
        assert self.policy is not None
        self.policy.on_batch_done(st.cfg.name, n, done.compute_s, end)
        i = 0
        for r in batch:
            c.queue_ns += int((started - r.arrival) * 1e9)
            res = {k: v[i:i + r.n] for k, v in results.items()}
            i += r.n
            if not r.future.done():
                c.success += 1
                if end <= r.deadline:
                    c.slo_met += 1
                r.future.set_result(res)

    def _fail_queue(self, name: str, err: DStackError) -> None:
        st = self.models[name]
        while st.queue:
            r = st.queue.popleft()
            st.counters.failure += 1
            _fail(r, err)
        st.items = 0

    # ------------------------------------------------------------------ adapting to load

    async def _adapt_loop(self) -> None:
        assert self.trigger is not None
        period = self.cfg.adapt.sample_s
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            rates = self.rates.sample(now)
            if not self._replanning and self.trigger.should_replan(now, rates):
                self._replanning = True
                self._spawn(self._replan(rates))

    async def _replan(self, rates: dict[str, float]) -> None:
        """Re-solve for the measured rates; start shadow workers for models whose slice
        changes and switch each over only once its shadow is ready."""
        try:
            new = setup_policy(self.cfg, self.slices, origin=time.monotonic(), rates=rates)
            new_slices = new.policy.slices()
            old_slices = {n: st.worker.cfg.slice for n, st in self.models.items() if st.worker}
            changed = [n for n in self.models if new_slices[n] != old_slices.get(n)]
            shadows = await asyncio.gather(
                *(self._start_worker(n, new_slices[n]) for n in changed),
                return_exceptions=True,
            )
            failed = [s for s in shadows if isinstance(s, BaseException)]
            if failed:
                log.error("re-plan abandoned: a shadow worker failed: %s", failed[0])
                for s in shadows:
                    if isinstance(s, WorkerHandle):
                        await s.stop()
                return
            # Switch: hold new launches on the changed models, wait for their running
            # batches to finish, then swap all at once so the new plan and its slices take
            # effect together. Queued requests stay queued across the switch.
            for n in changed:
                self.models[n].held = True
            while any(self.models[n].running for n in changed):
                await asyncio.sleep(0.0005)
            olds = []
            for n, h in zip(changed, shadows, strict=True):
                assert isinstance(h, WorkerHandle)
                olds.append(self.models[n].worker)
                self._attach(n, h)
                self.models[n].held = False
            new.policy.latency.update(self.latency)  # type: ignore[attr-defined]
            self.latency = new.policy.latency  # type: ignore[attr-defined]
            self.setup, self.policy = new, new.policy
            self._reanchor()
            self.replans += 1
            assert self.trigger is not None
            self.trigger.planned(time.monotonic(), rates)
            log.info("re-planned for rates %s; %d workers switched", _fmt(rates), len(changed))
            self._wake.set()
            for o in olds:
                if o is not None:
                    await o.stop()
        except Exception:
            log.exception("re-plan failed; keeping the current plan")
        finally:
            for st in self.models.values():
                st.held = False
            self._replanning = False


def _refused(st: _ModelState, err: DStackError) -> DStackError:
    """Count a refusal (queue full or SLO out of reach) against the model; returns `err`."""
    st.counters.refused += 1
    st.counters.failure += 1
    return err


def _fail(r: Request, err: Exception) -> None:
    if not r.future.done():
        r.future.set_exception(err)


def _fmt(rates: dict[str, float]) -> str:
    return ", ".join(f"{m}={r:.1f}/s" for m, r in rates.items())
