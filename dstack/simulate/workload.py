"""Workloads: when requests arrive, and for which model.

SPEC (the `--workload` flag); rates come from each model's `rate_rps` in the config:

    poisson                 Poisson arrivals per model at its rate, for the whole run.
    burst:x2@60s+30s        Poisson; every rate is multiplied by 2 from t = 60 s for 30 s.
    burst:x3@10s+5s:resnet50
                            the same, for one model only.
    ramp:0.5..2             Poisson whose rates go linearly from 0.5x to 2x over the run.
    trace:FILE.csv          replay a trace: rows `arrival_s,model` (a header line is
                            allowed; rows need not be sorted; arrivals at or after the
                            duration are dropped).

Times accept `ms`, `s` or `m` suffixes (a bare number is seconds). Each request carries one
item. Generation is deterministic for a seed: each model draws from its own stream
(`SeedSequence(seed).spawn`, in config order), so adding a model does not change the
arrivals of the others. Non-constant rates use thinning (Lewis & Shedler).
"""

from __future__ import annotations

import csv
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class WorkloadError(ValueError):
    """A workload spec or trace file that cannot be used (the message says why)."""


@dataclass(frozen=True, slots=True)
class Arrivals:
    """Requests sorted by time: `times[i]` (s) for model `models[i]` (an index into
    `names`)."""

    names: tuple[str, ...]
    times: np.ndarray
    models: np.ndarray

    def count(self, model: str) -> int:
        return int(np.count_nonzero(self.models == self.names.index(model)))

    def times_of(self, model: str) -> np.ndarray:
        """The arrival times of `model` (sorted; empty when the workload never names it)."""
        if model not in self.names:
            return np.empty(0)
        return self.times[self.models == self.names.index(model)]


def parse_duration(text: str) -> float:
    """'600s', '10m', '250ms' or '42' (seconds) -> seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s|m)?\s*", text)
    if not m:
        raise WorkloadError(f"{text!r} is not a duration (e.g. 600s, 10m, 250ms)")
    value = float(m.group(1))
    return value * {"ms": 1e-3, "s": 1.0, "m": 60.0, None: 1.0}[m.group(2)]


@dataclass(frozen=True, slots=True)
class _Shape:
    """Rate multiplier over time: piecewise linear, given by its knots."""

    knots_t: tuple[float, ...]
    knots_x: tuple[float, ...]
    model: str | None = None  # None: every model

    def peak(self) -> float:
        return max(self.knots_x)

    def at(self, t: np.ndarray) -> np.ndarray:
        return np.interp(t, self.knots_t, self.knots_x)


def _shape(spec: str, duration_s: float, names: Sequence[str]) -> _Shape:
    if spec == "poisson":
        return _Shape((0.0, duration_s), (1.0, 1.0))
    m = re.fullmatch(r"burst:x([0-9.]+)@([^+]+)\+([^:]+)(?::(.+))?", spec)
    if m:
        factor = float(m.group(1))
        start, length = parse_duration(m.group(2)), parse_duration(m.group(3))
        model = m.group(4)
        if model is not None and model not in names:
            raise WorkloadError(f"burst for {model!r}: not a served model ({', '.join(names)})")
        if factor <= 0 or length <= 0:
            raise WorkloadError(f"{spec}: the factor and the length must be positive")
        end = start + length
        # A step, as a piecewise-linear function with vertical edges.
        return _Shape((0.0, start, start, end, end, max(end, duration_s)),
                      (1.0, 1.0, factor, factor, 1.0, 1.0), model)
    m = re.fullmatch(r"ramp:([0-9.]+)\.\.([0-9.]+)", spec)
    if m:
        return _Shape((0.0, duration_s), (float(m.group(1)), float(m.group(2))))
    raise WorkloadError(
        f"unknown workload {spec!r}; use poisson, burst:x2@60s+30s[:model], ramp:0.5..2 or "
        f"trace:FILE.csv"
    )


def generate(spec: str, rates: dict[str, float], duration_s: float, seed: int) -> Arrivals:
    """Arrivals for `spec` (module docstring) over [0, duration_s)."""
    names = tuple(rates)
    if spec.startswith("trace:"):
        return read_trace(spec[len("trace:"):], names, duration_s)
    shape = _shape(spec, duration_s, names)
    streams = np.random.SeedSequence(seed).spawn(len(names))
    times: list[np.ndarray] = []
    idx: list[np.ndarray] = []
    for i, (name, ss) in enumerate(zip(names, streams, strict=True)):
        rng = np.random.default_rng(ss)
        applies = shape.model is None or shape.model == name
        peak = rates[name] * (shape.peak() if applies else 1.0)
        if peak <= 0:
            continue
        # Draw gaps in chunks at the peak rate; thin to the rate at each instant.
        chunks = []
        t = 0.0
        n = int(peak * duration_s * 1.1) + 16
        while t < duration_s:
            ts = t + np.cumsum(rng.exponential(1.0 / peak, n))
            chunks.append(ts)
            t = float(ts[-1])
        ts = np.concatenate(chunks)
        ts = ts[ts < duration_s]
        if applies and shape.peak() != min(shape.knots_x):
            keep = rng.random(ts.size) * shape.peak() < shape.at(ts)
            ts = ts[keep]
        times.append(ts)
        idx.append(np.full(ts.size, i, dtype=np.int32))
    return _merge(names, times, idx)


def _merge(names: tuple[str, ...], times: list[np.ndarray], idx: list[np.ndarray]) -> Arrivals:
    if not times:
        return Arrivals(names, np.zeros(0), np.zeros(0, dtype=np.int32))
    t = np.concatenate(times)
    m = np.concatenate(idx)
    order = np.lexsort((m, t))  # by time, ties by model index: deterministic
    return Arrivals(names, t[order], m[order])


def read_trace(path: str | Path, names: Sequence[str], duration_s: float) -> Arrivals:
    """Read a CSV trace of `arrival_s,model` rows (see the module docstring)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise WorkloadError(f"{path}: no such trace file") from None
    index = {n: i for i, n in enumerate(names)}
    ts: list[float] = []
    ms: list[int] = []
    for lineno, row in enumerate(csv.reader(text.splitlines()), start=1):
        if not row or not "".join(row).strip() or row[0].lstrip().startswith("#"):
            continue
        if len(row) < 2:
            raise WorkloadError(f"{path}:{lineno}: expected `arrival_s,model`, got {row!r}")
        try:
            t = float(row[0])
        except ValueError:
            if lineno == 1:
                continue  # a header
            raise WorkloadError(f"{path}:{lineno}: {row[0]!r} is not a time in seconds") from None
        model = row[1].strip()
        if model not in index:
            raise WorkloadError(
                f"{path}:{lineno}: model {model!r} is not served ({', '.join(names)})"
            )
        if t < 0:
            raise WorkloadError(f"{path}:{lineno}: negative arrival time {t}")
        if t < duration_s:
            ts.append(t)
            ms.append(index[model])
    return _merge(tuple(names), [np.asarray(ts, dtype=float)], [np.asarray(ms, dtype=np.int32)])


def write_trace(arrivals: Arrivals, path: str | Path) -> None:
    """Write arrivals as a trace CSV (with a header) that `read_trace` reads back."""
    with Path(path).open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["arrival_s", "model"])
        for t, m in zip(arrivals.times.tolist(), arrivals.models.tolist(), strict=True):
            w.writerow([repr(t), arrivals.names[m]])
