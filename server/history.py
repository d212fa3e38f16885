"""What the dashboard plots: the backend's counters sampled into a bounded ring buffer.

Nothing here is per request. `LatencyHistogram` keeps, per model, one count per fixed
latency bucket (the HTTP layer feeds it); `History` reads the backend's cumulative
counters (`InferenceBackend.stats`, the optional `refusals` and `current_batch_cap`) and
the histogram's counts once per `sample(now)` into a deque of bounded length, and
`series()` turns consecutive samples into rates. The clock is passed in: tests drive it
by hand; `server.dashboard` calls `sample` once a second.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from dstack.common.backend import InferenceBackend
from dstack.common.errors import DStackError

# Upper bounds (seconds) of the latency buckets, then +Inf: 1-2-3-5-7.5 steps, so an
# estimate inside one is off by at most half its width.
LATENCY_BUCKETS_S = (
    0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0,
)


class LatencyHistogram:
    """Per model, how many answered requests took how long: a count per bucket of
    `bounds` (upper bounds, seconds; the last bucket is +Inf) and their total time.
    Fixed memory per model. Used on the event loop only."""

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        self.bounds = bounds
        self._counts: dict[str, list[int]] = {}
        self._sum_s: dict[str, float] = {}

    def observe(self, model: str, seconds: float) -> None:
        counts = self._counts.get(model)
        if counts is None:
            counts = self._counts[model] = [0] * (len(self.bounds) + 1)
            self._sum_s[model] = 0.0
        i = 0
        while i < len(self.bounds) and seconds > self.bounds[i]:
            i += 1
        counts[i] += 1
        self._sum_s[model] += seconds

    def counts(self, model: str) -> tuple[int, ...]:
        """Non-cumulative counts per bucket (zeros for a model never observed)."""
        c = self._counts.get(model)
        return tuple(c) if c is not None else (0,) * (len(self.bounds) + 1)

    def sum_s(self, model: str) -> float:
        return self._sum_s.get(model, 0.0)

    def models(self) -> list[str]:
        return list(self._counts)


def quantile(q: float, bounds: tuple[float, ...], counts: tuple[int, ...]) -> float | None:
    """The q-quantile of non-cumulative bucket `counts` as Prometheus' histogram_quantile
    estimates it: linear inside the bucket that holds it (from 0 for the first), the last
    finite bound when it falls in +Inf. None without observations."""
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for i, c in enumerate(counts):
        if c and seen + c >= rank:
            if i == len(bounds):
                return bounds[-1]
            lo = bounds[i - 1] if i > 0 else 0.0
            return lo + (bounds[i] - lo) * (rank - seen) / c
        seen += c
    return bounds[-1]


@dataclass(frozen=True, slots=True)
class ModelSample:
    """One model's cumulative counters at one instant (gauges: `pending`, `batch_cap`)."""

    success: int
    failure: int  # refusals included, as the backend counts them
    slo_met: int
    refused: dict[str, int]  # by rule; empty when the backend does not say
    items: int
    batches: int
    pending: int
    batch_cap: int | None
    latency: tuple[int, ...]  # LatencyHistogram.counts


@dataclass(frozen=True, slots=True)
class Sample:
    t: float
    models: dict[str, ModelSample]


def _rate(d: float, dt: float) -> float:
    return round(d / dt, 3)


class History:
    """The last `window_s` of samples taken every `interval_s`, at most
    `window_s / interval_s + 1` of them (a deque with that maxlen)."""

    def __init__(self, backend: InferenceBackend, latency: LatencyHistogram, *,
                 interval_s: float = 1.0, window_s: float = 300.0,
                 p99_window_s: float = 10.0) -> None:
        self.backend = backend
        self.latency = latency
        self.interval_s = interval_s
        self.window_s = window_s
        self.p99_window_s = p99_window_s
        self.samples: deque[Sample] = deque(maxlen=int(window_s / interval_s) + 1)

    def sample(self, now: float) -> None:
        b = self.backend
        rules_of = getattr(b, "refusals", None)
        cap_of = getattr(b, "current_batch_cap", None)
        models: dict[str, ModelSample] = {}
        for m in b.model_names():
            try:  # a model unloaded meanwhile is left out of this sample
                s = b.stats(m)
                rules = dict(rules_of(m)) if rules_of is not None else {}
                cap = int(cap_of(m)) if cap_of is not None else None
            except DStackError:
                continue
            models[m] = ModelSample(s.request_success, s.request_failure, s.slo_met, rules,
                                    s.inference_count, s.execution_count, s.pending, cap,
                                    self.latency.counts(m))
        self.samples.append(Sample(now, models))

    def series(self) -> dict[str, Any]:
        """Per model, one value per interval between consecutive samples, oldest first;
        `t` is each interval's end in seconds before the newest sample (<= 0). Rates are
        per second; `attainment` and `batch` are None in an interval with nothing to
        divide; `p99_ms` covers the `p99_window_s` ending there. `totals` are the newest
        sample's cumulative counts."""
        ss = list(self.samples)
        if not ss:
            return {"t": [], "models": []}
        last = ss[-1]
        lag = max(1, round(self.p99_window_s / self.interval_s))
        out = []
        for name, now in last.models.items():
            rules = sorted({r for s in ss if name in s.models for r in s.models[name].refused})
            ser: dict[str, Any] = {
                "goodput_rps": [], "answered_rps": [], "attainment": [], "p99_ms": [],
                "queue": [], "batch": [], "batch_cap": [],
                "refused_rps": {r: [] for r in rules},
            }
            for i in range(1, len(ss)):
                a, b = ss[i - 1].models.get(name), ss[i].models.get(name)
                if a is None or b is None:
                    for k, v in ser.items():
                        if k == "refused_rps":
                            for r in rules:
                                v[r].append(None)
                        else:
                            v.append(None)
                    continue
                dt = ss[i].t - ss[i - 1].t
                done = b.success + b.failure - a.success - a.failure
                nb = b.batches - a.batches
                ser["goodput_rps"].append(_rate(b.slo_met - a.slo_met, dt))
                ser["answered_rps"].append(_rate(b.success - a.success, dt))
                ser["attainment"].append(round((b.slo_met - a.slo_met) / done, 4)
                                         if done else None)
                ser["queue"].append(b.pending)
                ser["batch"].append(round((b.items - a.items) / nb, 2) if nb else None)
                ser["batch_cap"].append(b.batch_cap)
                for r in rules:
                    ser["refused_rps"][r].append(
                        _rate(b.refused.get(r, 0) - a.refused.get(r, 0), dt))
                old = ss[max(0, i - lag)].models.get(name)
                base = old.latency if old is not None else (0,) * len(b.latency)
                p99 = quantile(0.99, self.latency.bounds,
                               tuple(x - y for x, y in zip(b.latency, base, strict=True)))
                ser["p99_ms"].append(round(p99 * 1000, 2) if p99 is not None else None)
            ser["totals"] = {
                "success": now.success, "failure": now.failure, "slo_met": now.slo_met,
                "refused": dict(now.refused), "items": now.items, "batches": now.batches,
                "answered_timed": sum(now.latency),
            }
            out.append({"name": name, **ser})
        return {"t": [round(s.t - last.t, 3) for s in ss[1:]], "models": out}
