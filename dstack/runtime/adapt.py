"""Adapting to load: arrival rates measured online, and when to re-plan.

Both objects are pure (the clock is passed in), so the hysteresis is tested on a fake
clock. The runtime samples the rates every `adapt.sample_s` seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dstack.common.config import DeployConfig

#: A rate drifts only by more than this many standard errors of its moving average (its
#: samples' own spread): bursty arrivals swing far more than Poisson ones, and a plan
#: re-made for each burst or lull is wrong for the next one.
NOISE_Z = 2.0


@dataclass
class RateTracker:
    """Arrivals per model, turned into an exponentially weighted moving rate (req/s), with
    the moving variance of the samples (`noise`: how far the moving rate swings by chance)."""

    models: list[str]
    alpha: float = 0.2
    _counts: dict[str, int] = field(default_factory=dict)
    _ewma: dict[str, float | None] = field(default_factory=dict)
    _var: dict[str, float] = field(default_factory=dict)
    _last: float | None = None

    def record(self, model: str, now: float, n: int = 1) -> None:
        """`n` arrivals of `model` at `now`."""
        self._counts[model] = self._counts.get(model, 0) + n
        if self._last is None:
            self._last = now

    def sample(self, now: float) -> dict[str, float]:
        """Close the current window and return the smoothed rates."""
        if self._last is None:
            self._last = now
            return {m: self._ewma.get(m) or 0.0 for m in self.models}
        dt = max(now - self._last, 1e-9)
        a = self.alpha
        for m in self.models:
            r = self._counts.get(m, 0) / dt
            prev = self._ewma.get(m)
            if prev is None:
                self._ewma[m] = r
                continue
            diff = r - prev
            self._ewma[m] = prev + a * diff
            self._var[m] = (1 - a) * (self._var.get(m, 0.0) + a * diff * diff)
        self._counts.clear()
        self._last = now
        return {m: self._ewma[m] or 0.0 for m in self.models}

    def noise(self) -> dict[str, float]:
        """Each moving rate's standard error: its samples' spread, through the average."""
        a = self.alpha
        return {m: (self._var.get(m, 0.0) * a / (2 - a)) ** 0.5 for m in self.models}


@dataclass
class ReplanTrigger:
    """Re-plan when a rate drifts from the planned one, with hysteresis.

    A model drifts when |measured - planned| > drift * max(planned, floor_rps), and by more
    than NOISE_Z standard errors of the measured rate (`RateTracker.noise`). A rate that
    rose counts at once; one that fell only once it has drifted low for `down_hold_s`
    (scale-down stabilisation, as in Kubernetes' autoscaler, per model): a plan for a lull
    gives the model a smaller slice, and its next burst, or a closed loop that the smaller
    slice caps, finds it too small. So a plan is made for `plan_rates`: the measured rates,
    but the planned one of each model that is low for less than `down_hold_s`. A re-plan
    happens only after `confirm` consecutive drifting samples, one that counts now (a single
    burst does not flap the plan) and at least `hold_s` after the previous plan.
    """

    planned_rates: dict[str, float]
    drift: float = 0.25
    hold_s: float = 5.0
    confirm: int = 2
    floor_rps: float = 1.0
    down_hold_s: float = 60.0
    _last_plan: float | None = None
    _streak: int = 0
    _low_since: dict[str, float] = field(default_factory=dict)

    def drifting(self, rates: dict[str, float],
                 noise: dict[str, float] | None = None) -> list[str]:
        out = []
        for m, r in rates.items():
            planned = self.planned_rates.get(m, 0.0)
            bound = max(self.drift * max(planned, self.floor_rps),
                        NOISE_Z * (noise or {}).get(m, 0.0))
            if abs(r - planned) > bound:
                out.append(m)
        return out

    def _low_long(self, m: str, now: float) -> bool:
        since = self._low_since.get(m)
        return since is not None and now - since >= self.down_hold_s

    def should_replan(self, now: float, rates: dict[str, float],
                      noise: dict[str, float] | None = None) -> bool:
        if self._last_plan is None:
            self._last_plan = now
        drifting = self.drifting(rates, noise)
        for m in rates:
            if m in drifting and rates[m] < self.planned_rates.get(m, 0.0):
                self._low_since.setdefault(m, now)
            else:
                self._low_since.pop(m, None)
        counts = [m for m in drifting if rates[m] > self.planned_rates.get(m, 0.0)
                  or self._low_long(m, now)]
        self._streak = self._streak + 1 if drifting else 0
        return (bool(counts) and self._streak >= self.confirm
                and now - self._last_plan >= self.hold_s)

    def plan_rates(self, now: float, rates: dict[str, float]) -> dict[str, float]:
        """The rates to plan for: the measured ones, but the planned rate of each model
        whose rate has been low for less than `down_hold_s`."""
        out = dict(rates)
        for m, r in rates.items():
            planned = self.planned_rates.get(m, 0.0)
            if r < planned and not self._low_long(m, now):
                out[m] = planned
        return out

    def held(self, now: float) -> bool:
        """Whether the plan in force is `hold_s` old (a plan not yet recorded: from now)."""
        if self._last_plan is None:
            self._last_plan = now
        return now - self._last_plan >= self.hold_s

    def deferred(self, now: float) -> None:
        """A re-plan found a better plan not yet worth switching to: ask again `hold_s`
        from now, for the rates still planned."""
        self._last_plan = now
        self._streak = 0

    def planned(self, now: float, rates: dict[str, float]) -> None:
        """Record that a plan for `rates` took effect at `now`."""
        for m, r in rates.items():  # a rate planned anew is low no longer
            if r != self.planned_rates.get(m):
                self._low_since.pop(m, None)
        self.planned_rates = dict(rates)
        self._last_plan = now
        self._streak = 0


def tracker_for(cfg: DeployConfig) -> RateTracker:
    return RateTracker([m.name for m in cfg.models], alpha=cfg.adapt.ewma_alpha)


def trigger_for(cfg: DeployConfig) -> ReplanTrigger:
    """The trigger of `cfg.adapt`, starting from the configured rates."""
    return ReplanTrigger({m.name: m.rate_rps for m in cfg.models}, drift=cfg.adapt.drift,
                         hold_s=cfg.adapt.hold_s, down_hold_s=cfg.adapt.down_hold_s)
