"""Core types shared by every package: the leaf of the import graph.

This module imports nothing from `models`, `knee_profiler`, `optimizer`, `server` or the rest
of `dstack`, and only the standard library, so that the profiler can run on a bare machine
that has torch and nothing else, and so that arrows point one way:
server -> dstack -> optimizer -> types <- knee_profiler.

Every type is a frozen, slotted dataclass; the JSON forms are plain dicts built by
`to_dict` / `from_dict`.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

PROFILE_SCHEMA = "dstack.profile/1"


class DType(StrEnum):
    """KServe v2 tensor datatypes the server accepts."""

    BOOL = "BOOL"
    UINT8 = "UINT8"
    INT8 = "INT8"
    INT16 = "INT16"
    INT32 = "INT32"
    INT64 = "INT64"
    FP16 = "FP16"
    FP32 = "FP32"
    FP64 = "FP64"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One input or output tensor. `shape` has -1 for the batch dimension (first)."""

    name: str
    datatype: DType
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What the zoo knows of a model: its tensors and the largest batch it accepts."""

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch_size: int


class Priority(StrEnum):
    HIGH = "high"
    NORMAL = "normal"
    LOW = "low"

    @property
    def weight(self) -> float:
        return {"high": 4.0, "normal": 1.0, "low": 0.25}[self.value]


@dataclass(frozen=True, slots=True)
class ModelSLO:
    """A model's latency objective and the load it is expected to carry."""

    model: str
    slo_ms: float
    rate_rps: float = 0.0
    priority: Priority = Priority.NORMAL


# --------------------------------------------------------------------------- profiles


class ProfileError(ValueError):
    """A profile file is missing, malformed, of another schema version, or incomplete."""


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """The device a profile was measured on. `units` is SMs (CUDA) or cores (CPU)."""

    kind: str  # "cpu" | "cuda" | "reference"
    name: str
    units: int
    unit_kind: str  # "cores" | "SMs"


@dataclass(frozen=True, slots=True)
class Cell:
    """One measured (batch, percent) point.

    `percent` is the slice the latency belongs to; `requested_percent` what was asked for,
    which differs when the device could not express it and it was rounded up; `units` the
    cores or SMs the slice really had (None where unknown, e.g. MPS thread percentage).
    """

    batch: int
    percent: float
    p50_ms: float
    p95_ms: float
    requested_percent: float | None = None
    units: int | None = None


@dataclass(frozen=True, slots=True)
class Profile:
    """Latency of one model on one device over batch sizes x slice percentages."""

    model: str
    device: DeviceInfo
    mechanism: str  # "cpu-affinity" | "mps" | "green-context" | "table"
    batch_sizes: tuple[int, ...]
    percentages: tuple[float, ...]
    cells: tuple[Cell, ...]
    epsilon: float = 0.10
    knee: dict[int, float] = field(default_factory=dict)  # batch -> knee percent
    memory_mb: dict[int, float] = field(default_factory=dict)  # batch -> peak memory
    measured: dict[str, Any] = field(default_factory=dict)  # how: repeats, tool, date, ...
    provenance: str = ""

    def cell(self, batch: int, percent: float) -> Cell:
        for c in self.cells:
            if c.batch == batch and math.isclose(c.percent, percent):
                return c
        raise KeyError(f"{self.model}: no cell for batch {batch} at {percent}%")

    def latency_ms(self, batch: int, percent: float, *, stat: str = "p50") -> float:
        """Latency at a profiled batch and any percent.

        Percentages between measured ones use the next measured percentage *below* (a
        slice never runs faster than the largest measured slice it contains: conservative);
        a percent under the smallest measured one is an error.
        """
        measured = sorted(p for p in self.percentages)
        i = bisect.bisect_right(measured, percent + 1e-9) - 1
        if i < 0:
            raise KeyError(f"{self.model}: {percent}% is below the profiled {measured[0]}%")
        c = self.cell(batch, measured[i])
        return c.p50_ms if stat == "p50" else c.p95_ms

    def interpolated_ms(self, batch: int, percent: float) -> float:
        """Latency (p50) at any batch and any percent, as the simulator and the planner
        model it (`dstack.simulate.latency` has the rules): the percent rounds down to a
        measured one, and below the smallest scales as work-conserving; the batch
        interpolates linearly between profiled ones, extrapolates from the last two above
        the largest (never below its latency), and takes the smallest's below it."""
        measured = sorted(self.percentages)
        scale = 1.0
        if percent < measured[0] - 1e-9:
            scale = measured[0] / max(percent, 1e-9)
            p = measured[0]
        else:
            p = measured[bisect.bisect_right(measured, percent + 1e-9) - 1]
        bs = sorted(self.batch_sizes)
        ys = [self.latency_ms(b, p) for b in bs]
        if len(bs) == 1:
            y = ys[0] * max(1.0, batch / bs[0])
        elif batch <= bs[0]:
            y = ys[0]
        else:
            i = min(bisect.bisect_left(bs, batch), len(bs) - 1)  # segment (i-1, i)
            b0, b1, y0, y1 = bs[i - 1], bs[i], ys[i - 1], ys[i]
            y = y0 + (y1 - y0) * (batch - b0) / (b1 - b0)
            if batch > bs[-1]:
                y = max(y, ys[-1])
        return y * scale

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d = {"schema": PROFILE_SCHEMA, **d}
        d["knee"] = {str(k): v for k, v in self.knee.items()}
        d["memory_mb"] = {str(k): v for k, v in self.memory_mb.items()}
        d["batch_sizes"] = list(self.batch_sizes)
        d["percentages"] = list(self.percentages)
        return d

    def on_cores(self, n: int) -> Profile:
        """This CPU profile as a server with only `n` of the profiled device's cores sees
        it: the cells of slices of at most `n` cores, each at its share of those `n`
        (a 1-core cell of a 2-core profile is 100% of a 1-core server; the 2-core cells go).
        Without it a server pinned to one core planned its 100% lane with the latencies of
        two cores: half what its batches took (measured in docs/decisions.md). Itself
        for a non-CPU profile, or for `n` at or above the profiled cores (the cells then
        reach only part of the device, and what is beyond the largest is read as it)."""
        total = self.device.units
        if self.device.kind != "cpu" or n >= total or n < 1:
            return self

        def units(percent: float, c: Cell | None = None) -> int:
            if c is not None and c.units:
                return c.units
            return max(1, math.ceil(percent * total / 100 - 1e-6))

        kept = tuple(replace(c, percent=100.0 * units(c.percent, c) / n,
                             requested_percent=None, units=units(c.percent, c))
                     for c in self.cells if units(c.percent, c) <= n)
        if not kept:
            return self
        return replace(
            self, device=replace(self.device, units=n), cells=kept,
            percentages=tuple(sorted({c.percent for c in kept})),
            knee={b: 100.0 * min(n, units(p)) / n for b, p in self.knee.items()},
            provenance=f"{self.provenance} (on {n} of its {total} cores)".strip())

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "profile") -> Profile:
        schema = d.get("schema")
        if schema != PROFILE_SCHEMA:
            raise ProfileError(
                f"{source}: schema is {schema!r}, this dstack reads {PROFILE_SCHEMA!r}; "
                "re-run knee-profiler to regenerate it"
            )
        try:
            dev = DeviceInfo(**d["device"])
            cells = tuple(Cell(**c) for c in d["cells"])
            prof = cls(
                model=str(d["model"]),
                device=dev,
                mechanism=str(d["mechanism"]),
                batch_sizes=tuple(int(b) for b in d["batch_sizes"]),
                percentages=tuple(float(p) for p in d["percentages"]),
                cells=cells,
                epsilon=float(d.get("epsilon", 0.10)),
                knee={int(k): float(v) for k, v in d.get("knee", {}).items()},
                memory_mb={int(k): float(v) for k, v in d.get("memory_mb", {}).items()},
                measured=dict(d.get("measured", {})),
                provenance=str(d.get("provenance", "")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ProfileError(f"{source}: malformed profile ({type(e).__name__}: {e})") from e
        missing = [
            (b, p)
            for b in prof.batch_sizes
            for p in prof.percentages
            if not any(c.batch == b and math.isclose(c.percent, p) for c in cells)
        ]
        if missing:
            shown = ", ".join(f"batch {b} at {p:g}%" for b, p in missing[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ProfileError(f"{source}: missing cells: {shown}{more}")
        bad = [c for c in cells if not (c.p50_ms > 0 and c.p95_ms >= c.p50_ms)]
        if bad:
            c = bad[0]
            raise ProfileError(
                f"{source}: cell batch {c.batch} at {c.percent:g}% has p50 {c.p50_ms} ms, "
                f"p95 {c.p95_ms} ms (need 0 < p50 <= p95)"
            )
        return prof

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        tmp.replace(path)  # atomic: an interrupted sweep never leaves half a file


def scaled(profile: Profile, factor: float) -> Profile:
    """`profile` with every cell's p50 and p95 latency multiplied by `factor` (> 0): a
    profile measured on another machine, corrected by how much slower (factor > 1) or
    faster this one runs the model. Pure: the knee (a ratio of latencies) and the memory
    are unchanged; the provenance says what was done."""
    if not (factor > 0 and math.isfinite(factor)):
        raise ValueError(f"scale factor must be a finite number > 0, got {factor!r}")
    if factor == 1.0:
        return profile
    cells = tuple(replace(c, p50_ms=c.p50_ms * factor, p95_ms=c.p95_ms * factor)
                  for c in profile.cells)
    return replace(profile, cells=cells,
                   provenance=f"{profile.provenance} (latencies scaled x{factor:.4g})".strip())


def load_profile(path: str | Path) -> Profile:
    """Read and validate one profile file; raises ProfileError naming the file."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise ProfileError(f"{path}: no such profile file") from e
    except json.JSONDecodeError as e:
        raise ProfileError(f"{path}: not valid JSON (truncated?): {e}") from e
    if not isinstance(raw, dict):
        raise ProfileError(f"{path}: expected a JSON object")
    return Profile.from_dict(raw, source=str(path))


def load_profiles(directory: str | Path) -> dict[str, Profile]:
    """Every `*.json` profile in a directory, keyed by model name."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ProfileError(f"{directory}: no such profile directory")
    out: dict[str, Profile] = {}
    for f in sorted(directory.glob("*.json")):
        p = load_profile(f)
        if p.model in out:
            raise ProfileError(f"{f}: a second profile for model {p.model!r} in {directory}")
        out[p.model] = p
    if not out:
        raise ProfileError(f"{directory}: contains no *.json profiles")
    return out


# --------------------------------------------------------------------------- plans


class SolverStatus(StrEnum):
    OPTIMAL = "optimal"  # every model served at its expected rate
    PARTIAL = "partial"  # best plan found, but some models fall short of their rate
    INFEASIBLE = "infeasible"  # some model cannot meet its SLO at all


@dataclass(frozen=True, slots=True)
class ModelPlan:
    """One model's share of a plan: run `batch` items on `percent`% once per cycle."""

    model: str
    batch: int
    percent: float
    latency_ms: float  # predicted L(batch, percent)
    throughput_rps: float  # batch / cycle_ms
    expected_rps: float
    served_rps: float  # min(throughput, expected)
    slo_ms: float
    runs_per_cycle: int = 1
    offset_ms: float = 0.0  # where in the cycle its batch starts (its shelf's start)


@dataclass(frozen=True, slots=True)
class Shortfall:
    """A model that cannot be served as asked, and why, with the numbers."""

    model: str
    reason: str


@dataclass(frozen=True, slots=True)
class Plan:
    models: tuple[ModelPlan, ...]
    cycle_ms: float
    objective: float
    status: SolverStatus
    solve_time_s: float = 0.0
    shortfalls: tuple[Shortfall, ...] = ()
    #: False when the solver stopped at its time limit, or the instance was too large for
    #: the exact MILP, so the plan is the best found rather than a proven optimum.
    proven_optimal: bool = True

    def for_model(self, name: str) -> ModelPlan:
        for m in self.models:
            if m.model == name:
                return m
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        return cls(
            models=tuple(ModelPlan(**m) for m in d["models"]),
            cycle_ms=float(d["cycle_ms"]),
            objective=float(d["objective"]),
            status=SolverStatus(d["status"]),
            solve_time_s=float(d.get("solve_time_s", 0.0)),
            shortfalls=tuple(Shortfall(**s) for s in d.get("shortfalls", ())),
            proven_optimal=bool(d.get("proven_optimal", True)),
        )


# --------------------------------------------------------------------------- schedules


@dataclass(frozen=True, slots=True)
class Slot:
    """A time x percent rectangle in the cycle. `units` are concrete cores where the
    backend has them (CPU), else empty."""

    model: str
    start_ms: float
    duration_ms: float
    percent: float
    units: tuple[int, ...] = ()

    @property
    def end_ms(self) -> float:
        return self.start_ms + self.duration_ms


@dataclass(frozen=True, slots=True)
class Schedule:
    cycle_ms: float
    slots: tuple[Slot, ...]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Schedule:
        return cls(
            cycle_ms=float(d["cycle_ms"]),
            slots=tuple(
                Slot(**{**s, "units": tuple(s.get("units", ()))}) for s in d["slots"]
            ),
        )
