"""Keep CPython's garbage collector from walking a serving process's start-up objects.

A process that has imported torch, numpy and the server holds about 370,000 objects that
live until it exits, and CPython's full collection (generation 2) walks every one of them:
157 ms in the HTTP process and 151 ms in a model worker, measured on the 2-core machine of
`docs/reliability.md`. In the server those are 157 ms in which the event loop reads,
refuses and answers nothing; in a worker, a batch 151 ms late and every request queued
behind it with it. `freeze_startup_objects()` moves every object alive at the end of
start-up into the permanent generation (`gc.freeze`), which collections skip: a full
collection after it walks only what was made since (well under 1 ms then). Frozen objects
are still freed by reference counting when dropped; only a cycle among them would never be
collected, and start-up objects live until the process exits anyway.

The server calls it when its workers are up, just before it says ready; each worker, after
its warm-up, just before it reports ready; the benchmark's load generators before each
measured window, so that their own pauses are not counted as the server's.
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> int:
    """Collect what is garbage now, then exempt every object still alive from later
    collections. Returns how many objects are frozen (all calls so far together)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


__all__ = ["freeze_startup_objects"]
