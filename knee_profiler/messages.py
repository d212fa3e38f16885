"""Typed messages between the sweep (parent) and a measuring child process.

The parent writes one `MeasureRequest` as JSON on the child's stdin; the child writes one
JSON object per line on its stdout: a `CellResult` per batch size as it finishes it (so the
progress bar moves), then one `ChildDone`, or a `ChildError` if it cannot go on.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any


class MsgKind(StrEnum):
    CELL = "cell"
    DONE = "done"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class MeasureRequest:
    """Measure `model` at each of `batch_sizes` inside one slice of `percent`%."""

    model: str
    device: str  # "cpu" | "cuda"
    mechanism: str
    percent: float
    units: int | None
    batch_sizes: tuple[int, ...]
    warmup: int
    repeats: int
    seed: int = 0
    slice_args: dict[str, Any] = field(default_factory=dict)  # mechanism-specific
    # Several models in one child (one child per slice): {model: batch sizes}. Empty:
    # just `model` at `batch_sizes`.
    per_model: dict[str, list[int]] = field(default_factory=dict)
    timing: str = "eager"  # "graph" | "eager" (see knee_profiler.timing)
    dtype: str = "fp32"  # "fp32" | "fp16"
    min_time_s: float = 0.0  # graph timing: take more samples until they span this long
    max_repeats: int = 0  # ... but no more than this many (0: repeats)

    def work(self) -> list[tuple[str, tuple[int, ...]]]:
        """(model, batch sizes) in the order the child measures them."""
        if self.per_model:
            return [(m, tuple(bs)) for m, bs in self.per_model.items()]
        return [(self.model, self.batch_sizes)]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> MeasureRequest:
        d = json.loads(text)
        d["batch_sizes"] = tuple(int(b) for b in d["batch_sizes"])
        if "per_model" in d:
            d["per_model"] = {m: [int(b) for b in bs] for m, bs in d["per_model"].items()}
        return cls(**d)


@dataclass(frozen=True, slots=True)
class CellResult:
    """One batch size measured, or failed (`error` set, e.g. out of memory)."""

    batch: int
    p50_ms: float = 0.0
    p95_ms: float = 0.0
    mean_ms: float = 0.0
    memory_mb: float = 0.0
    samples: int = 0
    error: str = ""
    units: int | None = None  # cores / SMs the slice really had, as the child saw them
    model: str = ""  # which model (multi-model children); "" = the request's `model`
    method: str = ""  # how it was timed ("graph", "eager", ...)
    kind: MsgKind = MsgKind.CELL


@dataclass(frozen=True, slots=True)
class ChildDone:
    """The child measured what it was asked; what it saw of its device and slice.
    `units_total` is the whole device's count where the child can know it, else 0 (a
    CUDA child under MPS sees only its slice's SMs)."""

    device_name: str
    units_total: int
    unit_kind: str
    slice_info: dict[str, Any] = field(default_factory=dict)
    weights_mb: float = 0.0
    torch_version: str = ""
    kind: MsgKind = MsgKind.DONE


@dataclass(frozen=True, slots=True)
class ChildError:
    """The child could not measure at all (bad slice, MPS not really active, ...)."""

    message: str
    kind: MsgKind = MsgKind.ERROR


Message = CellResult | ChildDone | ChildError


def encode(msg: Message) -> str:
    """One line of JSON, no newline."""
    return json.dumps(asdict(msg))


def decode(line: str) -> Message:
    """Parse one line written by `encode`; raises ValueError on anything else."""
    try:
        d = json.loads(line)
        kind = MsgKind(d.pop("kind"))
    except (json.JSONDecodeError, KeyError, ValueError, AttributeError, TypeError) as e:
        raise ValueError(f"not a child message: {line[:200]!r}") from e
    cls = {MsgKind.CELL: CellResult, MsgKind.DONE: ChildDone, MsgKind.ERROR: ChildError}[kind]
    return cls(**d)  # type: ignore[no-any-return]
