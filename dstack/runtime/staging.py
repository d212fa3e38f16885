"""Double buffering, the dispatcher's side: requests' inputs are written into the worker's
arena as they are admitted, into the half the *next* batch will use, while the current
batch computes from the other half (Zhang et al.'s overlapped upload, on shared memory).

A `Stager` per worker keeps the requests admitted to its queue, in queue order, and writes
them one after another into rows 0, 1, ... of the next half until it is full. When that
batch is launched its requests are the queue's first ones, so usually their rows are
already in place and only the rest are written; a head refused while it waited (its rows
are there, the batch's are not where it expects) means the batch's rows are written from
that point on. Then the halves swap: the requests still queued are written into the other
half at once, while the new batch computes.

An input in a client's device memory (`DeviceInput`, a CUDA shared-memory region) is not
written into a CUDA worker's arena: the batch names its rows (`DeviceRows`) and the worker
copies them on the device. Any other worker gets it through the host, as numpy reads it.

Invariant: the worker computes at most one batch at a time, and only ever from the half
the last launch named; the next half is never one the worker reads. Batches alternate
halves strictly, which a CUDA worker relies on to copy the next batch's rows early
(`dstack.runtime.upload`). Staging only saves copying at launch: whatever it missed,
`launch` writes, so an error here costs speed, never a wrong row.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dstack.runtime.dispatch import Ticket
from dstack.runtime.messages import DeviceRows
from dstack.runtime.shm import HALVES, Arena

log = logging.getLogger("dstack.runtime.staging")


class DeviceInput:
    """An input tensor in another process's device memory: `nbytes` bytes at `offset` of
    the allocation its `cudaIpcMemHandle_t` `handle` shares (a client's CUDA shared-memory
    region), read as `dtype` of `shape`. A CUDA worker reads its rows on the device; for
    anything else that takes it as an array (numpy's `__array__`: a CPU worker's arena, a
    single-buffered batch; pickle: a node of a cluster), `read()` copies it to the host."""

    __slots__ = ("__weakref__", "dtype", "handle", "nbytes", "offset", "read", "shape")

    def __init__(self, handle: bytes, offset: int, shape: tuple[int, ...], dtype: np.dtype,
                 read: Callable[[], np.ndarray]) -> None:
        self.handle, self.offset, self.shape, self.dtype = handle, offset, shape, dtype
        self.nbytes = math.prod(shape) * dtype.itemsize
        self.read = read

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        a = self.read()
        return a if dtype is None else a.astype(dtype, copy=False)

    def __reduce__(self) -> tuple[Any, ...]:
        return np.asarray, (self.read(),)


Inputs = dict[str, np.ndarray | DeviceInput]


class Stager:
    """The dispatcher's view of one double-buffered worker arena (module docstring).

    `inputs_of(ticket)`: the request's input arrays. `gone(ticket)`: the request was
    answered without running (refused while queued, failed): it will be in no batch.
    `on_device`: a CUDA worker, which reads `DeviceInput`s itself."""

    def __init__(self, arena: Arena, inputs_of: Callable[[Ticket], Inputs],
                 gone: Callable[[Ticket], bool], on_device: bool = False) -> None:
        self.arena = arena
        self.inputs_of = inputs_of
        self.gone = gone
        self.on_device = on_device
        self._device_seen = False  # a DeviceInput was left out of the arena
        self._names = [r.name for r in arena.layout.inputs]  # `DeviceRows.index` order
        self.half = 0  # the half the next batch goes into
        self._pending: list[Ticket] = []  # admitted, not launched; in queue order
        self._staged = 0  # how many of `_pending` are in `half`, from row 0
        self._rows = 0  # rows they fill
        self.rows_ahead = 0  # rows written before their batch was launched (for tests)
        self.rows_at_launch = 0  # rows written at launch
        self.rows_on_device = 0  # rows the worker was sent to read from device memory
        for h in range(HALVES):
            arena.set_staged_rows(h, 0)

    def through_host(self) -> None:
        """The worker cannot read device memory after all: from now on every row goes
        through the arena, those staged without their device rows too (written at launch,
        as after a failed staging)."""
        self.on_device = self._device_seen = False
        self._staged = self._rows = 0
        self.arena.set_staged_rows(self.half, 0)

    def add(self, ticket: Ticket) -> None:
        """A request was admitted to this worker's queue."""
        self._pending.append(ticket)
        self._guarded(self._stage_more)

    def restage(self) -> None:
        """After a launch: write the requests still queued into the new next half."""
        self._guarded(self._stage_more)

    def launch(self, tickets: Sequence[Ticket], n: int
               ) -> tuple[int, int, tuple[DeviceRows, ...]]:
        """Rows [0, n) of the next half get `tickets`' inputs, in order (only those not
        staged there already are written); the halves swap. Returns the batch's half, the
        first row written now (`RunBatch.fresh_from`) and the rows the worker reads from
        device memory instead."""
        half = self.half
        k = row = 0
        while (k < len(tickets) and k < self._staged
               and self._pending[k] is tickets[k]):
            row += tickets[k].n
            k += 1
        fresh_from = row
        if k < len(tickets):
            dst = self.arena.inputs(n, half)
            for t in tickets[k:]:
                self._write(dst, self.inputs_of(t), row, row + t.n)
                row += t.n
            del dst
            self.rows_at_launch += row - fresh_from
        self.rows_ahead += fresh_from
        # The other half is the next one now: the batch that used it has ended. Its count
        # starts from zero before the worker hears of this batch (a CUDA worker reads it
        # while this batch computes).
        self.half = (half + 1) % HALVES
        self.arena.set_staged_rows(self.half, 0)
        taken = {id(t) for t in tickets}
        self._pending = [t for t in self._pending if id(t) not in taken and not self.gone(t)]
        self._staged = self._rows = 0
        return half, fresh_from, self._device_rows(tickets) if self._device_seen else ()

    def _write(self, dst: dict[str, np.ndarray], x: Inputs, lo: int, hi: int) -> None:
        for name, a in dst.items():
            v = x[name]
            if self.on_device and type(v) is DeviceInput:
                self._device_seen = True
            else:
                a[lo:hi] = v

    def _device_rows(self, tickets: Sequence[Ticket]) -> tuple[DeviceRows, ...]:
        out = []
        row = 0
        for t in tickets:
            x = self.inputs_of(t)
            for i, name in enumerate(self._names):
                v = x[name]
                if type(v) is DeviceInput:
                    out.append(DeviceRows(i, row, v.handle, v.offset, v.nbytes))
                    self.rows_on_device += t.n
            row += t.n
        return tuple(out)

    def _stage_more(self) -> None:
        cap = self.arena.layout.max_batch
        while self._staged < len(self._pending):
            t = self._pending[self._staged]
            if self.gone(t):
                del self._pending[self._staged]  # in no batch: not worth a row
                continue
            if self._rows + t.n > cap:
                return
            x = self.inputs_of(t)
            dst = self.arena.inputs(self._rows + t.n, self.half, self._rows)
            for name, a in dst.items():
                v = x[name]
                if self.on_device and type(v) is DeviceInput:
                    self._device_seen = True
                else:
                    a[...] = v
            del dst
            self._staged += 1
            self._rows += t.n
            self.arena.set_staged_rows(self.half, self._rows)

    def _guarded(self, step: Callable[[], None]) -> None:
        try:
            step()
        except Exception:  # noqa: BLE001 - staging only saves work: launch writes the rest
            log.exception("staging inputs for %s failed; the launch writes them",
                          self.arena.name)
            self._staged = self._rows = 0
            self.arena.set_staged_rows(self.half, 0)


__all__ = ["DeviceInput", "Stager"]
