"""The re-planner: measures demand, decides when to re-plan, and solves off the event loop.

Demand is what arrives, not what was answered: every request is counted at arrival,
refused ones included (`RateTracker.record` is called before admission), so a closed
loop or a burst that the current plan refuses still grows the next plan. The solve
(`dstack.policies.planning.replan`: the lane search, taken only when it predicts more
than the plan in force for the measured rates) runs in a worker thread; HTTP, health
checks and dispatch go on meanwhile. The new policy is handed over
by the runtime in one step on the event loop, after its shadow workers are ready.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from dstack.common.config import DeployConfig
from dstack.common.slices import SliceBackend
from dstack.policies.planning import PolicySetup, replan
from dstack.runtime.adapt import tracker_for, trigger_for

log = logging.getLogger("dstack.runtime.replanner")


class StalePlan(Exception):
    """The served models changed (a load or an unload) while the plan was being solved."""


class Replanner:
    """`record(model, now)` on every arrival; `run()` is the sampling loop (a task).
    `apply(setup, rates)` is the runtime's hand-over: start shadows, switch, swap."""

    def __init__(self, cfg: DeployConfig, slices: SliceBackend,
                 apply: Callable[[PolicySetup, dict[str, float]], Awaitable[None]],
                 clock: Callable[[], float], setup: PolicySetup) -> None:
        self.cfg = cfg
        self.setup = setup  # the plan in force
        self.slices = slices
        self._apply = apply
        self._clock = clock
        self.rates = tracker_for(cfg)
        self.trigger = trigger_for(cfg)
        self.replans = 0
        self.busy = False

    def record(self, model: str, now: float) -> None:
        self.rates.record(model, now)

    def models_changed(self, cfg: DeployConfig, setup: PolicySetup) -> None:
        """A model was loaded or unloaded: `setup` is the plan in force for `cfg`'s models
        (a new model's rate is its configured one until measured)."""
        self.cfg = cfg
        self.setup = setup
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
            if not self.busy and self.trigger.should_replan(now, rates):
                await self.replan(rates)

    async def replan(self, rates: dict[str, float]) -> bool:
        """Solve for `rates` in a thread, then hand over. False (and the current plan
        kept) when the solve or the hand-over failed; the reason is logged."""
        self.busy = True
        try:
            setup = await asyncio.to_thread(replan, self.cfg, self.slices, self.setup,
                                            origin=self._clock(), rates=rates)
            if setup is None:  # the plan in force predicts as much for these rates
                self.trigger.planned(self._clock(), rates)
                log.debug("re-plan for %s kept the plan in force", rates)
                return False
            await self._apply(setup, rates)
            self.setup = setup
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
