"""Giving the memory of big request bodies back to the OS once they are freed.

A body arrives as many chunks of up to 64 KiB. glibc serves those from its heap (below its
mmap threshold), and a heap page freed in the middle goes back to the OS only when
`malloc_trim` is called: without it, a burst of 20 x 19 MB JSON bodies left the server's
RSS 190 MB above where it started (docs/reliability.md). `malloc_trim(0)` returns every
whole free page of every arena (`madvise(MADV_DONTNEED)`); freed memory is otherwise
untouched, and the next allocation gets fresh pages from the OS as usual.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable


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
