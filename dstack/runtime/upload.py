"""How a worker hands a batch's inputs to its model: the child side of double buffering.

CPU: the arena's rows are the model's input tensors (zero-copy); the dispatcher has
already written the next batch's rows into the other half while this one computes
(`dstack.runtime.staging`), so nothing here is left to overlap.

CUDA (Zhang et al.'s overlapped upload): the arena is registered as pinned host memory, so
host-to-device copies are real DMA that runs beside the kernels; each half has its own
device buffers; copies run on a second stream. While a batch computes, the worker copies
the rows the dispatcher has staged so far for the next batch (the count in the arena
header) into the other half's device buffers; when that batch is sent, only the rows
staged after that (or rewritten at launch, `RunBatch.fresh_from`) are copied. Rows in a
client's device memory (`RunBatch.device_rows`: CUDA shared memory) are copied device to
device on the same stream after those, never through the host (`DeviceReader`).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dstack.runtime.cuda_ipc import CudaRuntime, load
from dstack.runtime.messages import DeviceRows
from dstack.runtime.shm import HALVES, Arena

#: How often a CUDA worker looks for newly staged rows while a batch computes (s).
PREFETCH_POLL_S = 0.0002


def first_row_to_copy(copied: int, fresh_from: int) -> int:
    """The batch's rows [0, copied) reached the device early; the dispatcher has written
    rows from `fresh_from` on since it counted them. Rows from the smaller of the two on
    must be copied now (pure: the part of the protocol that a CPU test can check)."""
    return max(0, min(copied, fresh_from))


class DeviceMemoryError(RuntimeError):
    """A client's device memory cannot be opened in this worker: its batch fails, and the
    dispatcher sends this worker such rows through the host from then on."""


class DeviceReader:
    """A CUDA worker's reads of clients' device memory (`DeviceRows`): each allocation is
    opened once, at the first batch that reads from it, and closed when the server says
    it is no longer registered (`forget`); rows are copied device to device on the
    worker's copy stream. `runtime`: libcudart (`dstack.runtime.cuda_ipc.load`), asked
    for at the first read."""

    def __init__(self, runtime: Callable[[], CudaRuntime]) -> None:
        self._runtime = runtime
        self._rt: CudaRuntime | None = None
        self._opened: dict[bytes, int] = {}  # handle -> its pointer in this process

    def _ptr(self, rt: CudaRuntime, handle: bytes) -> int:
        ptr = self._opened.get(handle)
        if ptr is None:
            try:
                ptr = self._opened[handle] = rt.open(handle)
            except Exception as e:  # noqa: BLE001 - said as one kind, whatever CUDA said
                raise DeviceMemoryError(str(e)) from e
        return ptr

    def copy(self, rows: Sequence[DeviceRows], dst: Sequence[Any], stream: int) -> None:
        """Queue each of `rows` into its input's tensor of `dst` (contiguous, a row per
        item) on `stream`."""
        if self._rt is None:
            try:
                self._rt = self._runtime()
            except Exception as e:  # noqa: BLE001
                raise DeviceMemoryError(str(e)) from e
        rt = self._rt
        for r in rows:
            d = dst[r.index]
            start = r.row * (d.nbytes // d.shape[0])
            if start + r.nbytes > d.nbytes:
                raise RuntimeError(f"input {r.index}: {r.nbytes} bytes of device memory at "
                                   f"row {r.row} run past its {d.shape[0]} rows")
            rt.copy_async(d.data_ptr() + start, self._ptr(rt, r.handle) + r.offset,
                          r.nbytes, stream)

    def forget(self, handle: bytes) -> None:
        ptr = self._opened.pop(handle, None)
        if ptr is not None and self._rt is not None:
            self._rt.close(ptr)

    def close(self) -> None:
        for handle in list(self._opened):
            self.forget(handle)


class HostInputs:
    """CPU: the arena rows themselves (device memory is never a CPU worker's: the
    dispatcher writes such rows into the arena)."""

    def __init__(self, arena: Arena) -> None:
        import torch

        self._torch = torch
        self.arena = arena

    def batch(self, half: int, n: int, fresh_from: int = 0,
              device_rows: Sequence[DeviceRows] = ()) -> list[Any]:
        if device_rows:
            raise RuntimeError("a CPU worker was sent rows in device memory")
        return [self._torch.from_numpy(a) for a in self.arena.inputs(n, half).values()]

    def overlap(self, half: int) -> None:
        """Nothing to do while a CPU batch computes (it computes in this thread)."""

    def forget(self, handle: bytes) -> None:
        """Nothing of device memory is opened here."""

    def close(self) -> None:
        return None


class CudaInputs:
    """CUDA: pinned arena, device buffers per half, a copy stream (module docstring)."""

    def __init__(self, arena: Arena, device: Any) -> None:
        import torch

        self._torch = torch
        self.arena = arena
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.reader = DeviceReader(lambda: load((torch.version.cuda or "12").split(".")[0]))
        lay = arena.layout
        dtypes = [torch.from_numpy(np.empty(0, np.dtype(r.dtype))).dtype for r in lay.inputs]
        self.dev = [[torch.empty((lay.max_batch, *r.item_shape), dtype=dt, device=device)
                     for r, dt in zip(lay.inputs, dtypes, strict=True)]
                    for _ in range(HALVES)]
        self.copied = [0] * HALVES  # rows of each half already on the device
        self._ptr = 0
        c = ctypes.c_char.from_buffer(arena.buf)
        ptr = ctypes.addressof(c)
        del c  # its export of the buffer would keep the arena from closing
        err = torch.cuda.cudart().cudaHostRegister(ptr, lay.total_nbytes, 0)
        if int(err) == 0:  # else pageable: still right, only the copies do not overlap
            self._ptr = ptr

    @property
    def pinned(self) -> bool:
        return self._ptr != 0

    def _copy(self, half: int, lo: int, hi: int) -> None:
        torch = self._torch
        with torch.cuda.stream(self.stream):
            for d, a in zip(self.dev[half], self.arena.inputs(hi, half, lo).values(),
                            strict=True):
                d[lo:hi].copy_(torch.from_numpy(a), non_blocking=True)

    def prefetch(self, half: int) -> None:
        """Copy the rows staged for `half`'s next batch since the last look."""
        rows = min(self.arena.staged_rows(half), self.arena.layout.max_batch)
        if rows > self.copied[half]:
            self._copy(half, self.copied[half], rows)
            self.copied[half] = rows

    def batch(self, half: int, n: int, fresh_from: int = 0,
              device_rows: Sequence[DeviceRows] = ()) -> list[Any]:
        lo = first_row_to_copy(self.copied[half], fresh_from)
        self.copied[half] = 0  # the half's next batch is staged from row 0 again
        if n > lo:
            self._copy(half, lo, n)
        if device_rows:  # after the arena's rows, on the same stream: these win
            self.reader.copy(device_rows, self.dev[half], self.stream.cuda_stream)
        self._torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return [d[:n] for d in self.dev[half]]

    def overlap(self, half: int) -> None:
        """The batch from `half` has been queued on the device: until it is done, copy
        what is staged for the other half."""
        torch = self._torch
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        other = (half + 1) % HALVES
        while not done.query():
            self.prefetch(other)
            time.sleep(PREFETCH_POLL_S)

    def forget(self, handle: bytes) -> None:
        """A client's allocation is no longer registered: close it (every batch that read
        from it has ended: the worker synchronizes at the end of each)."""
        self.reader.forget(handle)

    def close(self) -> None:
        self._torch.cuda.synchronize(self.device)
        self.reader.close()
        if self._ptr:
            self._torch.cuda.cudart().cudaHostUnregister(self._ptr)
            self._ptr = 0


def inputs_for(arena: Arena, device: Any) -> HostInputs | CudaInputs:
    return CudaInputs(arena, device) if device.type == "cuda" else HostInputs(arena)


__all__ = ["CudaInputs", "DeviceMemoryError", "DeviceReader", "HostInputs", "first_row_to_copy",
           "inputs_for"]
