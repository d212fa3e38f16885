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
    replay:FILE.csv[:compress=10][:superpose=2]
                            real arrivals' burst shape: FILE's first column holds one
                            timestamp per request (seconds, or dates such as
                            `2023-11-16 18:15:46.68`; a header line is allowed). Its counts
                            per second, over their mean, multiply each model's rate: every
                            model reads the trace from its own random offset (wrapping
                            round), `compress` trace seconds per second of the run (default
                            1), the mean of `superpose` offsets (default 1: many independent
                            users smooth the shape).
    bursty[:compress=10]    synthetic bursty arrivals, independent per model: heavy-tailed
                            on/off (Pareto periods, shape 1.5, of mean 20 s on and 30 s off,
                            in trace seconds), at a log-normal level (sigma 0.9) while on.
                            Counts per window vary with a coefficient of variation of about
                            2.0 at 1 s, 1.7 at 10 s and 1.1 at 60 s; 10-s windows peak at
                            about 12x the mean, their 90th percentile at 3x: the statistics
                            of a bursty production inference trace. `compress` as above.

Shaped workloads (`replay`, `bursty`) are Poisson at a piecewise-constant rate: the shape's
mean over the whole trace (or, for `bursty`, its expectation) maps to the model's rate, so a
run sees the trace's own level where it falls, above or below the mean. With `mean=run`
the shape is scaled over the run instead: each model's expected count is then exactly its
rate times the duration.

Times accept `ms`, `s` or `m` suffixes (a bare number is seconds). Each request carries one
item. Generation is deterministic for a seed: each model draws from its own stream
(`SeedSequence(seed).spawn`, in config order), so adding a model does not change the
arrivals of the others. Non-constant rates use thinning (Lewis & Shedler).
"""

from __future__ import annotations

import csv
import math
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
        f"unknown workload {spec!r}; use poisson, burst:x2@60s+30s[:model], ramp:0.5..2, "
        f"trace:FILE.csv, replay:FILE.csv[:compress=10][:superpose=2] or bursty[:compress=10]"
    )


def generate(spec: str, rates: dict[str, float], duration_s: float, seed: int) -> Arrivals:
    """Arrivals for `spec` (module docstring) over [0, duration_s)."""
    names = tuple(rates)
    if spec.startswith("trace:"):
        return read_trace(spec[len("trace:"):], names, duration_s)
    if spec.startswith(("replay:", "bursty")):
        return _shaped(spec, rates, duration_s, seed)
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


#: The `bursty` generator (trace seconds): heavy-tailed on/off, Pareto(shape) periods of
#: these means, and while on a log-normal level of this sigma.
BURSTY_ON_S, BURSTY_OFF_S, BURSTY_SHAPE, BURSTY_SIGMA = 20.0, 30.0, 1.5, 0.9


def _options(spec: str, kind: str, parts: list[str]) -> tuple[float, int, bool]:
    """`compress=C`, `superpose=K` and `mean=trace|run` of a shaped spec's trailing parts."""
    compress, superpose, mean = 1.0, 1.0, "trace"
    for part in parts:
        key, eq, value = part.partition("=")
        if not eq or key not in ("compress", "superpose", "mean") or (
                kind == "bursty" and key == "superpose"):
            allowed = "compress=C, " + ("" if kind == "bursty" else "superpose=K, ") + "mean=run"
            raise WorkloadError(f"{spec}: {part!r} is not an option of {kind} ({allowed})")
        if key == "mean":
            if value not in ("trace", "run"):
                raise WorkloadError(f"{spec}: mean={value!r}: use mean=trace or mean=run")
            mean = value
            continue
        try:
            number = float(value)
        except ValueError:
            raise WorkloadError(f"{spec}: {key}={value!r} is not a number") from None
        if key == "compress":
            compress = number
        else:
            superpose = number
    if compress <= 0 or superpose < 1 or superpose % 1:
        raise WorkloadError(f"{spec}: compress must be positive and superpose a whole "
                            "number >= 1")
    return compress, int(superpose), mean == "run"


def _timestamp(cell: str) -> float | None:
    """A trace cell as seconds (a number, or a date such as `2023-11-16 18:15:46.68`)."""
    try:
        return float(cell)
    except ValueError:
        pass
    try:
        return float(np.datetime64(cell.replace(" ", "T"), "ns").astype(np.int64)) / 1e9
    except ValueError:
        return None


def trace_counts(path: str | Path) -> np.ndarray:
    """Requests per second of a timestamp trace (its first column: seconds, or dates)."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise WorkloadError(f"{path}: no such trace file") from None
    cells = [row[0].strip() for row in csv.reader(lines) if row and row[0].strip()
             and not row[0].lstrip().startswith("#")]
    if cells and _timestamp(cells[0]) is None:
        cells = cells[1:]  # a header
    if not cells:
        raise WorkloadError(f"{path}: no timestamps in its first column")
    stamps = [_timestamp(c) for c in cells]
    bad = next((c for c, t in zip(cells, stamps, strict=True) if t is None), None)
    if bad is not None:
        raise WorkloadError(f"{path}: its first column is neither seconds nor dates "
                            f"({bad!r})")
    secs = np.asarray(stamps, dtype=float)
    secs = secs - secs.min()
    return np.bincount(secs.astype(np.int64)).astype(float)


def _on_off(rng: np.random.Generator, length: float) -> tuple[np.ndarray, np.ndarray]:
    """The `bursty` rate multiplier over [0, length): its change points and values."""
    scale = (BURSTY_SHAPE - 1) / BURSTY_SHAPE  # a Pareto of mean m has its minimum m * scale
    starts: list[float] = []
    values: list[float] = []
    t = -rng.random() * BURSTY_OFF_S  # a random phase
    while t < length:
        starts.append(max(t, 0.0))
        values.append(0.0)
        t += BURSTY_OFF_S * scale * (1 + rng.pareto(BURSTY_SHAPE))
        starts.append(max(t, 0.0))
        values.append(float(np.exp(BURSTY_SIGMA * rng.standard_normal())))
        t += BURSTY_ON_S * scale * (1 + rng.pareto(BURSTY_SHAPE))
    return np.asarray(starts), np.asarray(values)


def _shape_pieces(kind: str, counts: np.ndarray | None, superpose: int, length: float,
                  rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One model's rate multiplier over [0, length) trace seconds, piecewise constant:
    (start of each piece, its value)."""
    if kind == "bursty":
        return _on_off(rng, length)
    assert counts is not None
    n = counts.size
    bins = int(math.ceil(length)) + 1
    value = np.zeros(bins)
    for _ in range(superpose):
        offset = int(rng.integers(0, n))
        value += counts[(offset + np.arange(bins)) % n]
    return np.arange(bins, dtype=float), value / superpose


def _shaped(spec: str, rates: dict[str, float], duration_s: float, seed: int) -> Arrivals:
    """`replay:` and `bursty` arrivals (module docstring)."""
    names = tuple(rates)
    if spec.startswith("replay:"):
        kind = "replay"
        path, *parts = spec[len("replay:"):].split(":")
        counts = trace_counts(path)
        if counts.sum() <= 0:
            raise WorkloadError(f"{spec}: the trace has no requests")
    elif spec == "bursty" or spec.startswith("bursty:"):
        kind, counts = "bursty", None
        parts = spec.split(":")[1:]
    else:
        raise WorkloadError(f"unknown workload {spec!r}")
    compress, superpose, per_run = _options(spec, kind, parts)
    # the shape's mean over the whole trace (`bursty`: its expectation)
    mean = (float(counts.mean()) if counts is not None else BURSTY_ON_S
            * float(np.exp(BURSTY_SIGMA ** 2 / 2)) / (BURSTY_ON_S + BURSTY_OFF_S))
    length = duration_s * compress  # trace seconds the run covers
    streams = np.random.SeedSequence(seed).spawn(len(names))
    times: list[np.ndarray] = []
    idx: list[np.ndarray] = []
    for i, (name, ss) in enumerate(zip(names, streams, strict=True)):
        rng = np.random.default_rng(ss)
        starts, value = _shape_pieces(kind, counts, superpose, length, rng)
        # pieces in run seconds, cut at the duration
        lo = starts / compress
        hi = np.append(lo[1:], np.inf).clip(max=duration_s)
        keep = lo < duration_s
        lo, hi, value = lo[keep], hi[keep], value[keep]
        mass = float(np.sum(value * (hi - lo))) if per_run else duration_s * mean
        if rates[name] <= 0 or mass <= 0:
            continue
        lam = value * (rates[name] * duration_s / mass) * (hi - lo)  # expected per piece
        k = rng.poisson(lam)
        ts = np.repeat(lo, k) + rng.random(int(k.sum())) * np.repeat(hi - lo, k)
        ts.sort()
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
