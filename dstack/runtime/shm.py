"""Shared-memory tensor arena: how batches cross the process boundary without pickling.

One arena per worker: a single shared block holding two *halves*, each with room for
`max_batch` items of every input and output tensor of the model. The dispatcher writes a
batch's inputs into a half and reads the outputs back from it; the worker wraps the same
bytes as torch tensors (zero-copy). With double buffering the batches alternate between
the halves, so the next batch's inputs are written into one while the current batch
computes from the other (`dstack.runtime.staging`); without it every batch uses half 0.

A small header before the halves holds, per half, how many input rows the dispatcher has
written so far for the next batch from it (`staged_rows`): a CUDA worker copies those rows
to the device while the batch before it computes (`dstack.runtime.upload`).

The block is a memory file of the process that makes it (`memfd_create`), which a worker
opens by its path in /proc and maps: it has no name in /dev/shm, so however the processes
end (a kill -9 of the server's process group, a Ray node removed) its memory is the OS's
again once the last of them is gone. (A `multiprocessing.shared_memory` block, named in
/dev/shm, stayed there whenever its maker and its resource tracker were killed together:
one per such model on every removed Ray node in the cluster test.)
"""

from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass

import numpy as np

from dstack.common.types import DType, ModelSpec, TensorSpec

NUMPY_DTYPE: dict[DType, np.dtype] = {
    DType.BOOL: np.dtype(np.bool_),
    DType.UINT8: np.dtype(np.uint8),
    DType.INT8: np.dtype(np.int8),
    DType.INT16: np.dtype(np.int16),
    DType.INT32: np.dtype(np.int32),
    DType.INT64: np.dtype(np.int64),
    DType.FP16: np.dtype(np.float16),
    DType.FP32: np.dtype(np.float32),
    DType.FP64: np.dtype(np.float64),
}

_ALIGN = 64
HALVES = 2
_HEADER = _ALIGN  # one int64 per half: rows staged for its next batch


@dataclass(frozen=True, slots=True)
class Region:
    name: str
    dtype: str  # numpy dtype string
    item_shape: tuple[int, ...]
    offset: int

    @property
    def item_nbytes(self) -> int:
        return math.prod(self.item_shape) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True, slots=True)
class ArenaLayout:
    max_batch: int
    inputs: tuple[Region, ...]
    outputs: tuple[Region, ...]
    nbytes: int  # of one half (region offsets are within a half)

    @property
    def total_nbytes(self) -> int:
        return _HEADER + HALVES * self.nbytes

    @classmethod
    def for_spec(cls, spec: ModelSpec) -> ArenaLayout:
        offset = 0

        def regions(tensors: tuple[TensorSpec, ...]) -> tuple[Region, ...]:
            nonlocal offset
            out = []
            for t in tensors:
                r = Region(t.name, NUMPY_DTYPE[t.datatype].str, tuple(t.shape[1:]), offset)
                out.append(r)
                offset += -(-r.item_nbytes * spec.max_batch_size // _ALIGN) * _ALIGN
            return tuple(out)

        ins = regions(spec.inputs)
        outs = regions(spec.outputs)
        return cls(spec.max_batch_size, ins, outs, max(offset, _ALIGN))


def memory_file(name: str, size: int) -> tuple[int, str]:
    """A new memory file (`memfd_create`) of `size` bytes: its descriptor, and the path in
    /proc another process of this host opens it by while this one keeps the descriptor."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    return fd, f"/proc/{os.getpid()}/fd/{fd}"


class Arena:
    """A shared block laid out by `ArenaLayout` (module docstring). Made without `name`: a
    new memory file of this process, `name` the path another process opens it by while
    this one keeps it; with `name`: that block, mapped."""

    def __init__(self, layout: ArenaLayout, name: str | None = None) -> None:
        self.layout = layout
        self._fd: int | None = None  # the maker's memory file, open while the arena lives
        if name is None:
            fd, name = memory_file("dstack-arena", layout.total_nbytes)
            self._fd = fd
        else:
            fd = os.open(name, os.O_RDWR | os.O_CLOEXEC)
        try:
            self.buf = mmap.mmap(fd, layout.total_nbytes)
        except BaseException:
            os.close(fd)
            raise
        if self._fd is None:
            os.close(fd)  # the mapping keeps the block
        self.name = name
        self._staged = np.ndarray((HALVES,), dtype=np.int64, buffer=self.buf)
        # Per half, each region's whole view (max_batch rows), made once: a batch's views
        # are slices of them (every batch asks for its inputs and outputs, in both
        # processes; a view made from the buffer each time cost several us).
        self._ins = [self._views(layout.inputs, h) for h in range(HALVES)]
        self._outs = [self._views(layout.outputs, h) for h in range(HALVES)]

    def _views(self, regions: tuple[Region, ...], half: int) -> list[tuple[str, np.ndarray]]:
        return [(r.name, np.ndarray((self.layout.max_batch, *r.item_shape),
                                    dtype=np.dtype(r.dtype), buffer=self.buf,
                                    offset=_HEADER + half * self.layout.nbytes + r.offset))
                for r in regions]

    @staticmethod
    def _half(half: int) -> int:
        if not 0 <= half < HALVES:
            raise ValueError(f"arena half {half} (there are {HALVES})")
        return half

    def inputs(self, n: int, half: int = 0, first: int = 0) -> dict[str, np.ndarray]:
        """Views of input rows [first, n) of `half`."""
        return {name: v[first:n] for name, v in self._ins[self._half(half)]}

    def outputs(self, n: int, half: int = 0) -> dict[str, np.ndarray]:
        return {name: v[:n] for name, v in self._outs[self._half(half)]}

    def staged_rows(self, half: int) -> int:
        """Input rows of `half` written so far for its next batch (see the module
        docstring)."""
        return int(self._staged[half])

    def set_staged_rows(self, half: int, rows: int) -> None:
        # Written after the rows themselves: a reader in another process that sees the
        # count sees the rows (x86-64 keeps stores in order; the CUDA path is x86 here).
        self._staged[half] = rows

    def close(self) -> None:
        # Drop the views of the block (close() fails while one lives); a count stays.
        self._staged = np.zeros(HALVES, dtype=np.int64)
        self._ins = self._outs = []
        if self._fd is not None:  # no new process can open it now
            os.close(self._fd)
            self._fd = None
        try:
            self.buf.close()
        except BufferError:  # a view is still alive somewhere; unmapped at exit
            pass
