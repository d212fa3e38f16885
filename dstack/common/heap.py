"""Keep freed memory for the next batch, or the next request (glibc's malloc).

A forward pass allocates its activations anew on every call, megabytes per tensor.
glibc's defaults give blocks that size back to the kernel when they are freed (mmap above
a threshold that adapts as it goes, and trimming of the heap's top), so batch after batch
the same pages are faulted in and zeroed again, more or less depending on the process's
first allocations (resnet18 workers here: 1,654 or 154 faults per item from one start to
the next; a process running b4 alone: ~2,500 per item, 9.5% of its CPU in the kernel).
`keep_heap()` has malloc serve every block from the heap and never trim it; the pages
then stay mapped after the first batches, as a caching allocator keeps them: a process
so tuned faulted 12x less and ran 6% faster, in windows alternating with an untuned one.
The price: the process keeps its peak heap until it exits, which a worker needs again for
its next batch anyway. `DSTACK_KEEP_HEAP=0` in the server's environment leaves glibc's
defaults alone (here and in `steady_heap`, the server's own bounded variant).

Workers call it first thing, and so do the knee profiler's measuring children and the
benchmark's in-process ceiling, so that all of them run a model the same way. The server
calls `steady_heap` instead (`server.memory.steady_server_heap`): its heap stays bounded.
"""

from __future__ import annotations

import ctypes
import os
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_NEVER = 2**31 - 1


def _glibc() -> ctypes.CDLL | None:
    if os.environ.get("DSTACK_KEEP_HEAP", "1") == "0" or not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version"):
        return None  # musl and others: their mallopt is not glibc's
    return libc


def keep_heap() -> bool:
    """Tune this process's malloc; False where it is not glibc's (nothing changed)."""
    libc = _glibc()
    return (libc is not None and libc.mallopt(_M_MMAP_MAX, 0) == 1
            and libc.mallopt(_M_TRIM_THRESHOLD, _NEVER) == 1)


def steady_heap(mmap_threshold: int, trim_threshold: int) -> bool:
    """Fixed malloc thresholds for the server's process, which allocates and frees blocks
    of one size request after request (a 600 KB body, the buffers it is read into).

    glibc's thresholds adapt: both start at 128 KB, and each rises when a bigger mapped
    block is freed (the mmap threshold to its size, the trim threshold to twice that). So
    whether each body's pages are faulted in anew depended on what the process had freed
    before: over the same front end, 150-220 page faults per 600 KB request (about 510 us
    of CPU a request, two thirds in the kernel) when nothing big had been freed, none
    (about 200 us) after one 16 MB block had (the removed `bench.frontend_cost`). Fixed
    here: blocks under `mmap_threshold` come from the heap, whose top goes back to the OS
    only past `trim_threshold` free; bigger blocks are mapped, and unmapped when freed.
    False where malloc is not glibc's (nothing changed)."""
    libc = _glibc()
    return (libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1
            and libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1)


__all__ = ["keep_heap", "steady_heap"]
