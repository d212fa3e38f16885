"""Freed request-body memory goes back to the OS (server.memory), and the body limits ask
for it after a big body (server.limits)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import pytest

from server import limits
from server.memory import release_freed_memory

# Bodies arrive as 64 KiB chunks: glibc keeps them in its heap, and a freed page below a
# live allocation stays in the process until malloc_trim.
_CHILD = """
import os
from server.memory import release_freed_memory
page = os.sysconf("SC_PAGE_SIZE")
def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * page / 2**20
chunks = [b"x" * (65536 - 64) for _ in range(1600)]  # ~100 MB, as a body's chunks
pin = bytes(65536 - 64)  # a live allocation above them: free() alone cannot shrink the heap
before = rss_mb()
del chunks
freed = rss_mb()
ok = release_freed_memory()
print(before, freed, rss_mb(), ok)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim")
def test_released_memory_goes_back_to_the_os() -> None:
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                         check=True).stdout.split()
    before, freed, after = (float(v) for v in out[:3])
    if out[3] != "True":
        pytest.skip("not glibc: nothing to release")
    assert before - after > 60, (before, freed, after)  # most of ~100 MB given back
    assert freed - after > 0.8 * (before - after)  # by the release, not by free()


def test_a_big_body_has_its_memory_released_after_the_answer() -> None:
    released: list[int] = []

    async def app(scope, receive, send) -> None:  # noqa: ANN001
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    mw = limits.BodyLimits(app, max_body_bytes=16 << 20, budget=limits.BodyBudget(64 << 20),
                           release=lambda: released.append(1))

    async def go() -> None:
        transport = httpx.ASGITransport(app=mw)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            assert (await c.post("/", content=b"x" * 1000)).status_code == 200
            for _ in range(10):
                await asyncio.sleep(0.01)
            assert released == []  # small bodies: nothing to give back
            for _ in range(3):
                r = await c.post("/", content=b"x" * limits.TRIM_AFTER_BYTES)
                assert r.status_code == 200
            for _ in range(100):
                if mw.trims.done and not mw.trims.running:
                    break
                await asyncio.sleep(0.01)
            assert 1 <= len(released) <= 3 and not mw.trims.running

    asyncio.run(go())
    assert release_freed_memory() in (True, False)
