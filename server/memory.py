"""Memory of request bodies: received into one buffer of their final size (`BodyBuffer`),
big ones given back to the OS once they are freed (`release_freed_memory`), and the
allocator's thresholds fixed for the server's process (`steady_server_heap`).

A body arrives as many chunks of up to 64 KiB. glibc serves those from its heap (below its
mmap threshold), and a heap page freed in the middle goes back to the OS only when
`malloc_trim` is called: without it, a burst of 20 x 19 MB JSON bodies left the server's
RSS 190 MB above where it started (docs/decisions.md). `malloc_trim(0)` returns every
whole free page of every arena (`madvise(MADV_DONTNEED)`); freed memory is otherwise
untouched, and the next allocation gets fresh pages from the OS as usual.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable

from dstack.common.heap import steady_heap

#: A body at least this big, once freed, has the allocator give free pages back to the OS;
#: and is mapped for itself (`steady_server_heap`), so freeing it unmaps it.
TRIM_AFTER_BYTES = 4 << 20
#: Free memory at the top of the server's heap that the allocator keeps for the next
#: requests' bodies instead of giving it back (and faulting it in again).
HEAP_TOP_KEPT_BYTES = 16 << 20


def steady_server_heap() -> bool:
    """Fixed malloc thresholds for this process (`dstack.common.heap.steady_heap`): what
    `dstack serve` runs with. False where malloc is not glibc's."""
    return steady_heap(TRIM_AFTER_BYTES, HEAP_TOP_KEPT_BYTES)


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        fn = ctypes.CDLL(None).malloc_trim  # glibc only (not musl, not macOS)
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_TRIM = _malloc_trim()


def release_freed_memory() -> bool:
    """Give the allocator's whole free pages back to the OS; False where that is not
    available (an allocator other than glibc's). A ctypes call does not hold the GIL, so
    it may run in a thread beside the event loop."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


def _bytes_api() -> tuple[Callable[..., bytes], Callable[[bytes], int]] | None:
    if sys.implementation.name != "cpython":
        return None
    new = ctypes.pythonapi.PyBytes_FromStringAndSize
    new.argtypes = [ctypes.c_char_p, ctypes.c_ssize_t]
    new.restype = ctypes.py_object
    data = ctypes.pythonapi.PyBytes_AsString
    data.argtypes = [ctypes.py_object]
    data.restype = ctypes.c_void_p
    return new, data


_BYTES = _bytes_api()


def unfilled_bytes(size: int) -> tuple[bytes, memoryview] | None:
    """A new `bytes` of `size` whose contents are not yet written, and a writable view of
    them, to fill before anyone else sees the object (which is then immutable to all); None
    elsewhere than CPython. Made as C code makes one (`PyBytes_FromStringAndSize(NULL,
    size)`): the OS gives its pages a few at a time, as they are written."""
    if _BYTES is None:
        return None
    body = _BYTES[0](None, size)
    view = memoryview((ctypes.c_char * size).from_address(_BYTES[1](body))).cast("B")
    return body, view


class BodyBuffer:
    """A request body received piece by piece, given whole by `result()` as one `bytes`.

    With an expected `size` (the Content-Length), a body that comes in more than one
    piece is copied, piece by piece, into one `bytes` of that size, the one handed to the
    app: no list of pieces joined at the end. That join was a copy of the whole body in
    one step of the event loop (27 ms for 19 MB, 30 ms for 60 MB, most of it the OS
    giving the new pages) and twice the body in memory at its end. The `bytes` is made
    unfilled (`unfilled_bytes`), so the OS gives its pages a few at a time, as the pieces
    are copied in; nobody else sees the object until `result()`.

    A body of one piece is that piece (no copy). Without a size (chunked), beyond it, or
    elsewhere than CPython, the pieces are kept and joined at the end, as before."""

    def __init__(self, size: int = 0) -> None:
        self.size = size
        self.filled = 0  # bytes written
        self._pieces: list[bytes] = []
        self._body: bytes | None = None  # the preallocated body, while being filled
        self._view: memoryview | None = None  # ... and a writable view of it

    def write(self, piece: bytes) -> None:
        n = len(piece)
        if not n:
            return
        if self._body is None and len(self._pieces) == 1 and self.filled + n <= self.size:
            made = unfilled_bytes(self.size)
            if made is not None:
                self._body, self._view = made
                self._view[:self.filled] = self._pieces.pop()
        if self._view is not None:
            if self.filled + n <= self.size:
                self._view[self.filled:self.filled + n] = piece
                self.filled += n
                return
            self._pieces = [self._written()]  # more than announced: keep pieces from here
            self._body = self._view = None
        self._pieces.append(piece)
        self.filled += n

    def result(self) -> bytes:
        """All bytes written, in order; the buffer is empty after."""
        if self._body is not None:
            body = self._body if self.filled == self.size else self._written()
        elif len(self._pieces) == 1:
            body = self._pieces[0]
        else:
            body = b"".join(self._pieces)
        self._body = self._view = None
        self._pieces, self.filled = [], 0
        return body

    def _written(self) -> bytes:
        assert self._view is not None
        return bytes(self._view[:self.filled])
