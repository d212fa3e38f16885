"""Typed messages between the dispatcher and its worker processes (never bare tuples).

Tensors never travel in these messages: they sit in the worker's shared-memory arena
(`dstack.runtime.shm`), or in a client's device memory (`DeviceRows`); a message only says
which slot and how many items. They go over the worker's pipe as `encode` makes them: the
two of every batch (`RunBatch`, `BatchDone`) as fixed-size structs, the rest (and a
`RunBatch` with device rows) pickled. (With both pickled, the dispatcher's process
spent 290 us per request at batches of one, against 248 us with the structs: the
removed bench.frontend_cost, three pairs; docs/decisions.md.)
"""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass
from enum import StrEnum


class MsgKind(StrEnum):
    READY = "ready"
    START_FAILED = "start_failed"
    RUN = "run"
    DONE = "done"
    FAILED = "failed"
    STOP = "stop"
    FORGET = "forget"


@dataclass(frozen=True, slots=True)
class DeviceRows:
    """Rows [row, row + n) of a batch's input `index` are not in the arena: they are
    `nbytes` bytes at `offset` of another process's device allocation, shared by its
    `cudaIpcMemHandle_t` `handle` (a client's CUDA shared-memory region). A CUDA worker
    copies them on the device (`dstack.runtime.upload.DeviceReader`)."""

    index: int
    row: int
    handle: bytes
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class RunBatch:
    batch_id: int
    n: int  # items in the arena half's input rows [0, n)
    half: int = 0  # which half of the arena (`dstack.runtime.shm`)
    # The first input row the dispatcher wrote after the rows it had already staged (and
    # counted in the arena header): rows before it have not changed since they were
    # counted, so a worker that copied them to the device early need not copy them again.
    fresh_from: int = 0
    device_rows: tuple[DeviceRows, ...] = ()
    kind: MsgKind = MsgKind.RUN


@dataclass(frozen=True, slots=True)
class ForgetMemory:
    """A client's device allocation is no longer registered (and no request uses it):
    close it if it was opened (`DeviceRows.handle`). No answer."""

    handle: bytes
    kind: MsgKind = MsgKind.FORGET


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
    # The worker could not open a client's device memory (`DeviceRows`): send it such rows
    # through the host from now on.
    device_memory: bool = False
    kind: MsgKind = MsgKind.FAILED


ToWorker = RunBatch | Stop | ForgetMemory
FromWorker = Ready | StartFailed | BatchDone | BatchFailed


# A pickle (protocol 2 or later) starts with 0x80: these tags cannot be mistaken for one.
_RUN = struct.Struct("<Bqqqq")  # tag, batch_id, n, half, fresh_from
_DONE = struct.Struct("<Bqqdd")  # tag, batch_id, n, start_s, compute_s
_RUN_TAG, _DONE_TAG = 1, 2


def encode(msg: ToWorker | FromWorker) -> bytes:
    """`msg` as the bytes that go over a worker's pipe (`decode` reads them back)."""
    if type(msg) is RunBatch and not msg.device_rows:
        return _RUN.pack(_RUN_TAG, msg.batch_id, msg.n, msg.half, msg.fresh_from)
    if type(msg) is BatchDone:
        return _DONE.pack(_DONE_TAG, msg.batch_id, msg.n, msg.start_s, msg.compute_s)
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> ToWorker | FromWorker:
    """The message `encode` made `data` of."""
    if data[0] == _RUN_TAG:
        return RunBatch(*_RUN.unpack(data)[1:])
    if data[0] == _DONE_TAG:
        return BatchDone(*_DONE.unpack(data)[1:])
    msg: ToWorker | FromWorker = pickle.loads(data)  # noqa: S301 - our own child's pipe
    return msg
