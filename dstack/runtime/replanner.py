"""The re-planner: measures demand, decides when to re-plan, and solves off the event loop.

Demand is what arrives, not what was answered: every request is counted at arrival,
refused ones included (`RateTracker.record` is called before admission), so a closed
loop or a burst that the current plan refuses still grows the next plan. The solve
(`dstack.policies.planning.replan`: the lane search, taken only when it predicts more
than the plan in force for the measured rates, by more than starting the workers it moves
would cost over the time the plan in force has lasted) runs off the event loop, in a process of
its own (`SolverProcess`; `adapt.solve_in`, by default on a CUDA device) or in a thread
(by default on a CPU device). In a thread its 5-20 ms of Python take turns at the GIL
with the event loop, which meanwhile does a fraction of its work: under load it falls that
far behind, and every request in hand is answered or refused that much later. In its own
process only the pickled arguments and plan (about 16 KB, half a ms) cost the serving
process; but on a CPU device it then takes a core's time beside the loop from the
workers, where the GIL let the two take turns. HTTP, health checks and dispatch go on
meanwhile. The new policy is handed over by the runtime in one step on the event
loop, after its shadow workers are ready.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from dstack.common.config import DeployConfig
from dstack.common.slices import SliceBackend
from dstack.common.types import Profile
from dstack.policies.planning import (
    PolicySetup,
    corrected_profiles,
    latency_ratios,
    replan,
    served_of,
)
from dstack.runtime.adapt import tracker_for, trigger_for

log = logging.getLogger("dstack.runtime.replanner")


class StalePlan(Exception):
    """The served models changed (a load or an unload) while the plan was being solved."""


T = TypeVar("T")


def _solver_init() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the serving process stops it
    parent = os.getppid()

    def orphaned() -> None:  # the serving process killed: nothing stops this one but this
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=orphaned, name="dstack-solver-parent", daemon=True).start()


class SolverProcess:
    """One spawned process that runs the re-plans' solves, one at a time. `start()` when
    the server starts (before it is ready: spawning an interpreter takes a while) returns
    its pid; `call(fn, ...)` runs `fn` there (arguments and result pickled, on this
    machine only), in a new process if it has died; `stop()` ends it."""

    def __init__(self) -> None:
        self._pool = self._new()
        self.pid: int | None = None  # the process's, once started

    @staticmethod
    def _new() -> ProcessPoolExecutor:
        return ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"),
                                   initializer=_solver_init)

    async def start(self) -> int:
        self.pid = await self.call(os.getpid)
        return self.pid

    async def call(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` in the process; if it has died, in a new one."""
        pool = self._pool
        try:
            return await self._call(pool, fn, *args, **kwargs)
        except BrokenProcessPool:
            if self._pool is pool:
                log.warning("the re-planner's solver process (pid %s) died; starting "
                            "another", self.pid)
                pool.shutdown(wait=False, cancel_futures=True)
                self._pool = self._new()
                self.pid = await self._call(self._pool, os.getpid)
            return await self._call(self._pool, fn, *args, **kwargs)

    @staticmethod
    async def _call(pool: ProcessPoolExecutor, fn: Callable[..., T], /, *args: Any,
                    **kwargs: Any) -> T:
        # Submitted from a thread: a submit that starts the process spawns an interpreter.
        fut = await asyncio.to_thread(pool.submit, fn, *args, **kwargs)
        return await asyncio.wrap_future(fut)

    def pin(self, cores: tuple[int, ...]) -> None:
        """Keep the process on `cores`: where the serving process is kept, so that a solve
        takes no more from the workers' cores than it did in a thread of it."""
        if self.pid is None:
            return
        try:
            for tid in os.listdir(f"/proc/{self.pid}/task"):
                os.sched_setaffinity(int(tid), cores)
        except (FileNotFoundError, ProcessLookupError):  # died: the next call replaces it
            pass

    def stop(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class Replanner:
    """`record(model, now)` on every arrival; `run()` is the sampling loop (a task).
    `apply(setup, rates)` is the runtime's hand-over: start shadows, switch, swap. The
    solve runs in `solver`'s process, or without one in a thread."""

    def __init__(self, cfg: DeployConfig, slices: SliceBackend,
                 apply: Callable[[PolicySetup, dict[str, float]], Awaitable[None]],
                 clock: Callable[[], float], setup: PolicySetup,
                 solver: SolverProcess | None = None,
                 live_s: Callable[[], dict[str, tuple[int, float]]] | None = None,
                 start_s: Callable[[], dict[str, float]] | None = None) -> None:
        self.cfg = cfg
        self.solver = solver
        self.setup = setup  # the plan in force
        self.slices = slices
        self._apply = apply
        self._clock = clock
        self.rates = tracker_for(cfg)
        self.trigger = trigger_for(cfg)
        self.trigger.held(clock())  # the plan in force dates from now
        self._since = clock()  # when the plan in force was put in force
        self._start_s = start_s  # how long each worker took to start, by worker
        self.replans = 0
        self.busy = False
        # (n, seconds): what a batch of the size each worker's recent batches had takes by
        # its live estimate (trusted ones only): a plan whose profiles it leaves by more
        # than `profile_margin` for `trigger.confirm` samples running is made again with
        # the profiles scaled to it.
        self._live_s = live_s
        self._slow_streak = 0
        self._fast_since: dict[str, float] = {}  # model -> since when its batches run faster
        self._declined: str | None = None  # the drift last logged as not worth a switch

    def record(self, model: str, now: float) -> None:
        self.rates.record(model, now)

    def models_changed(self, cfg: DeployConfig, setup: PolicySetup) -> None:
        """A model was loaded or unloaded: `setup` is the plan in force for `cfg`'s models
        (a new model's rate is its configured one until measured)."""
        self.cfg = cfg
        self.setup = setup
        self._since = self._clock()
        names = [m.name for m in cfg.models]
        self.rates.models = names
        planned = self.trigger.planned_rates
        self.trigger.planned_rates = {m.name: planned.get(m.name, m.rate_rps)
                                      for m in cfg.models}

    async def run(self) -> None:
        period = self.cfg.adapt.sample_s
        while True:
            await asyncio.sleep(period)
            now = self._clock()
            rates = self.rates.sample(now)
            if self.busy:
                continue
            drift = self._drifted(now)
            if drift is not None:
                profiles, said = drift
                if await self.replan(self.trigger.plan_rates(now, rates), profiles):
                    log.warning("%s; planned again with those latencies scaled", said)
                    self._declined = None
                elif said != self._declined:
                    log.warning("%s; the plan in force is kept: a plan for them predicts "
                                "too little more for the workers it would start (the plan "
                                "in force has lasted %.0f s; asked again later)",
                                said, now - self._since)
                    self._declined = said
            elif self.trigger.should_replan(now, rates, self.rates.noise()):
                await self.replan(self.trigger.plan_rates(now, rates))

    def _drifted(self, now: float) -> tuple[dict[str, Profile], str] | None:
        """The plan's profiles scaled to the live estimates, where these have left them by
        more than `profile_margin` for `trigger.confirm` samples running and the plan in
        force is `trigger.hold_s` old, and a line that says so; else None. Batches slower
        than planned count at once; faster ones only once they have been faster for
        `adapt.down_hold_s`, as a rate that fell does: a burst's batches, slowed by the
        work beside them, must not be followed down in its lull and up again in the next."""
        if self._live_s is None or self.cfg.profile_margin is None:
            return None
        served = served_of(self.setup)
        ratios = latency_ratios(self.setup, self._live_s())
        factors = corrected_profiles(self.cfg, served, ratios)[1]
        for m in list(self._fast_since):
            if factors.get(m, 1.0) >= 1.0:
                del self._fast_since[m]
        for m, f in factors.items():
            if f < 1.0:
                self._fast_since.setdefault(m, now)
        hold = self.cfg.adapt.down_hold_s
        ratios = {m: r for m, r in ratios.items() if m in factors and (
            factors[m] > 1.0 or now - self._fast_since[m] >= hold)}
        profiles, factors = corrected_profiles(self.cfg, served, ratios)
        self._slow_streak = self._slow_streak + 1 if factors else 0
        if self._slow_streak < self.trigger.confirm or not self.trigger.held(now):
            return None
        self._slow_streak = 0
        return profiles, (
            f"profiles: the batches served disagree with the plan's profiles by more than "
            f"profile_margin {self.cfg.profile_margin:g}: " + "; ".join(
                f"{m} {1000 * ratios[m][0]:.1f} ms a batch of {ratios[m][2]}, planned "
                f"{1000 * ratios[m][1]:.1f} ms (x{f:.2f})" for m, f in factors.items()))

    async def replan(self, rates: dict[str, float],
                     profiles: dict[str, Profile] | None = None) -> bool:
        """Solve for `rates` off the loop, then hand over if the new plan is worth the
        switch (`replan`: its gain over the time the plan in force has lasted against what
        starting the moved workers costs), with `profiles` (the plan's corrected to what its
        batches take) or the profiles of the plan in force. False (and the current plan
        kept) when it is not worth it, or the solve or the hand-over failed (logged)."""
        self.busy = True
        try:
            now = self._clock()
            solve = functools.partial(
                replan, self.cfg, self.slices, self.setup, origin=now, rates=rates,
                profiles=profiles if profiles is not None else served_of(self.setup),
                horizon_s=now - self._since if self.cfg.adapt.weigh_switch else float("inf"),
                start_s=self._start_s() if self._start_s is not None else None,
                correcting=profiles is not None)
            decided = await (self.solver.call(solve) if self.solver is not None
                             else asyncio.to_thread(solve))
            setup = decided.setup
            if setup is None:
                if decided.pending:  # better, not yet worth its starts: ask again later
                    self.trigger.deferred(self._clock())
                    log.debug("re-plan for %s not yet worth its workers' starts", rates)
                else:  # the plan in force predicts as much for these rates
                    self.trigger.planned(self._clock(), rates)
                    log.debug("re-plan for %s kept the plan in force", rates)
                return False
            await self._apply(setup, rates)
            self.setup = setup
            self._since = self._clock()
        except StalePlan:
            log.info("re-plan dropped: the served models changed while it was solved")
            return False
        except Exception:
            log.exception("re-plan failed; keeping the current plan")
            return False
        finally:
            self.busy = False
        self.replans += 1
        self.trigger.planned(self._clock(), rates)
        log.info("re-planned for rates %s",
                 ", ".join(f"{m}={r:.1f}/s" for m, r in rates.items()))
        return True
