"""Adapting to load: arrival rates measured online, and when to re-plan.

Both objects are pure (the clock is passed in), so the hysteresis is tested on a fake
clock. The runtime samples the rates every `adapt.sample_s` seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dstack.common.config import DeployConfig


@dataclass
class RateTracker:
    """Arrivals per model, turned into an exponentially weighted moving rate (req/s)."""

    models: list[str]
    alpha: float = 0.2
    _counts: dict[str, int] = field(default_factory=dict)
    _ewma: dict[str, float | None] = field(default_factory=dict)
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
        for m in self.models:
            r = self._counts.get(m, 0) / dt
            prev = self._ewma.get(m)
            self._ewma[m] = r if prev is None else prev + self.alpha * (r - prev)
        self._counts.clear()
        self._last = now
        return {m: self._ewma[m] or 0.0 for m in self.models}


@dataclass
class ReplanTrigger:
    """Re-plan when a rate drifts from the planned one, with hysteresis.

    A model drifts when |measured - planned| > drift * max(planned, floor_rps). A re-plan
    happens only after `confirm` consecutive drifting samples (a single burst does not
    flap the plan) and at least `hold_s` after the previous plan. When every drifting rate
    fell, the re-plan also waits until they have drifted for `down_hold_s` (scale-down
    stabilisation, as in Kubernetes' autoscaler): a plan for a lull gives the models smaller
    slices, and under closed-loop load a smaller slice caps the very rate that is measured.
    """

    planned_rates: dict[str, float]
    drift: float = 0.25
    hold_s: float = 5.0
    confirm: int = 2
    floor_rps: float = 1.0
    down_hold_s: float = 60.0
    _last_plan: float | None = None
    _streak: int = 0
    _down_since: float | None = None

    def drifting(self, rates: dict[str, float]) -> list[str]:
        out = []
        for m, r in rates.items():
            planned = self.planned_rates.get(m, 0.0)
            if abs(r - planned) > self.drift * max(planned, self.floor_rps):
                out.append(m)
        return out

    def should_replan(self, now: float, rates: dict[str, float]) -> bool:
        if self._last_plan is None:
            self._last_plan = now
        drifting = self.drifting(rates)
        self._streak = self._streak + 1 if drifting else 0
        up = any(rates[m] > self.planned_rates.get(m, 0.0) for m in drifting)
        if not drifting or up:
            self._down_since = None
        elif self._down_since is None:
            self._down_since = now
        if self._streak < self.confirm or now - self._last_plan < self.hold_s:
            return False
        return self._down_since is None or now - self._down_since >= self.down_hold_s

    def held(self, now: float) -> bool:
        """Whether the plan in force is `hold_s` old (a plan not yet recorded: from now)."""
        if self._last_plan is None:
            self._last_plan = now
        return now - self._last_plan >= self.hold_s

    def planned(self, now: float, rates: dict[str, float]) -> None:
        """Record that a plan for `rates` took effect at `now`."""
        self.planned_rates = dict(rates)
        self._last_plan = now
        self._streak = 0
        self._down_since = None


def tracker_for(cfg: DeployConfig) -> RateTracker:
    return RateTracker([m.name for m in cfg.models], alpha=cfg.adapt.ewma_alpha)


def trigger_for(cfg: DeployConfig) -> ReplanTrigger:
    """The trigger of `cfg.adapt`, starting from the configured rates."""
    return ReplanTrigger({m.name: m.rate_rps for m in cfg.models}, drift=cfg.adapt.drift,
                         hold_s=cfg.adapt.hold_s, down_hold_s=cfg.adapt.down_hold_s)
