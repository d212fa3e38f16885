"""Typed messages between the dispatcher and its worker processes (never bare tuples).

Tensors never travel in these messages: they sit in the worker's shared-memory arena
(`dstack.runtime.shm`); a message only says which slot and how many items.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class MsgKind(StrEnum):
    READY = "ready"
    START_FAILED = "start_failed"
    RUN = "run"
    DONE = "done"
    FAILED = "failed"
    STOP = "stop"


@dataclass(frozen=True, slots=True)
class RunBatch:
    batch_id: int
    n: int  # items in the arena half's input rows [0, n)
    half: int = 0  # which half of the arena (`dstack.runtime.shm`)
    # The first input row the dispatcher wrote after the rows it had already staged (and
    # counted in the arena header): rows before it have not changed since they were
    # counted, so a worker that copied them to the device early need not copy them again.
    fresh_from: int = 0
    kind: MsgKind = MsgKind.RUN


@dataclass(frozen=True, slots=True)
class Stop:
    kind: MsgKind = MsgKind.STOP


@dataclass(frozen=True, slots=True)
class Ready:
    pid: int
    # Measured warm-up latency (ms) at batch 1 and at the largest batch: the first two
    # points of the dispatcher's linear latency model T(b) = k + t*b.
    warm_ms_batch1: float
    warm_ms_max: float
    max_batch: int
    kind: MsgKind = MsgKind.READY


@dataclass(frozen=True, slots=True)
class StartFailed:
    error: str
    kind: MsgKind = MsgKind.START_FAILED


@dataclass(frozen=True, slots=True)
class BatchDone:
    batch_id: int
    n: int
    start_s: float  # time.monotonic() in the worker when compute began (system-wide clock)
    compute_s: float
    kind: MsgKind = MsgKind.DONE


@dataclass(frozen=True, slots=True)
class BatchFailed:
    batch_id: int
    error: str
    kind: MsgKind = MsgKind.FAILED


ToWorker = RunBatch | Stop
FromWorker = Ready | StartFailed | BatchDone | BatchFailed
