"""Shared-memory tensor arena: how batches cross the process boundary without pickling.

One arena per worker: a single shared block holding, for every input and output tensor of
the model, room for `max_batch` items. The dispatcher writes a batch's inputs into it and
reads the outputs back; the worker wraps the same bytes as torch tensors (zero-copy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from multiprocessing import shared_memory

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
    nbytes: int

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


class Arena:
    """A shared block laid out by `ArenaLayout`. The creator owns (unlinks) it."""

    def __init__(self, layout: ArenaLayout, name: str | None = None) -> None:
        self.layout = layout
        self._owner = name is None
        if name is None:
            self.shm = shared_memory.SharedMemory(create=True, size=layout.nbytes)
        else:
            self.shm = shared_memory.SharedMemory(name=name)
        self.name = self.shm.name

    def _view(self, r: Region, n: int) -> np.ndarray:
        return np.ndarray((n, *r.item_shape), dtype=np.dtype(r.dtype), buffer=self.shm.buf,
                          offset=r.offset)

    def inputs(self, n: int) -> dict[str, np.ndarray]:
        return {r.name: self._view(r, n) for r in self.layout.inputs}

    def outputs(self, n: int) -> dict[str, np.ndarray]:
        return {r.name: self._view(r, n) for r in self.layout.outputs}

    def close(self) -> None:
        try:
            self.shm.close()
        except BufferError:  # a view is still alive somewhere; the OS reclaims at exit
            return
        if self._owner:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass
