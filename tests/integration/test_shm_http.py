"""The shared-memory extension over the HTTP app in-process (httpx over ASGI, the fake
backend): off unless allowed, refused to a client not on this host, and a region
unregistered while a request uses it answered cleanly, the server serving on; a CUDA
region (a fake handle) is closed, and the backend's workers told, only when its last
request is done."""

from __future__ import annotations

import asyncio
import base64
import os
from collections.abc import Iterator
from multiprocessing import shared_memory
from typing import Any

import httpx
import numpy as np
import pytest

from server import shm
from server.app import create_app
from tests.integration.fakes import FakeBackend
from tests.unit.test_shm import FakeMapping


class _Held(FakeBackend):
    """Holds each infer call until `go` is set (a request in flight, on demand)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = asyncio.Event()
        self.go = asyncio.Event()

    async def infer(self, model: str, inputs: dict[str, np.ndarray],
                    since_received_s: float = 0.0) -> dict[str, np.ndarray]:
        self.entered.set()
        await self.go.wait()
        return await super().infer(model, inputs, since_received_s)


def _client(app: Any, host: str = "127.0.0.1") -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, client=(host, 5000))
    return httpx.AsyncClient(transport=transport, base_url="http://t")


@pytest.fixture
def region() -> Iterator[shared_memory.SharedMemory]:
    obj = shared_memory.SharedMemory(f"dstack_it_{os.getpid()}", create=True, size=4096)
    yield obj
    obj.close()
    obj.unlink()


def _infer_body(region: str) -> dict[str, Any]:
    shm = {"shared_memory_region": region, "shared_memory_byte_size": 24}
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 3], "parameters": shm}],
            "outputs": [{"name": "y", "parameters": {**shm, "shared_memory_offset": 64}}]}


def test_off_unless_allowed_and_local_only(region) -> None:  # noqa: ANN001
    asyncio.run(_off_unless_allowed_and_local_only(region))


async def _off_unless_allowed_and_local_only(region: shared_memory.SharedMemory) -> None:
    key = {"key": "/" + region.name, "byte_size": 4096}
    async with _client(create_app(FakeBackend(), max_body_bytes=4096)) as off:
        assert "system_shared_memory" not in (await off.get("/v2")).json()["extensions"]
        r = await off.post("/v2/systemsharedmemory/region/r/register", json=key)
        assert r.status_code == 400 and "allow_client_shm" in r.json()["error"]
        r = await off.post("/v2/models/double/infer", json=_infer_body("r"))
        assert r.status_code == 400 and "not enabled" in r.json()["error"]
    app = create_app(FakeBackend(), max_body_bytes=4096, allow_client_shm=True)
    async with _client(app, "10.0.0.5") as remote:
        assert "system_shared_memory" in (await remote.get("/v2")).json()["extensions"]
        r = await remote.post("/v2/systemsharedmemory/region/r/register", json=key)
        assert r.status_code == 403 and "10.0.0.5" in r.json()["error"]
        r = await remote.post("/v2/models/double/infer", json=_infer_body("r"))
        assert r.status_code == 403
    async with _client(app) as local:
        assert (await local.post("/v2/systemsharedmemory/region/r/register",
                                 json=key)).status_code == 200
        assert (await local.get("/v2/systemsharedmemory/status")).json() == [
            {"name": "r", "key": "/" + region.name, "offset": 0, "byte_size": 4096}]
        r = await local.get("/v2/cudasharedmemory/status")
        assert r.status_code == 400 and "CUDA shared memory is not available" in r.json()["error"]
        await local.post("/v2/systemsharedmemory/unregister")


def test_region_unregistered_during_a_request(region) -> None:  # noqa: ANN001
    asyncio.run(_region_unregistered_during_a_request(region))


async def _region_unregistered_during_a_request(region: shared_memory.SharedMemory) -> None:
    backend = _Held()
    app = create_app(backend, max_body_bytes=4096, allow_client_shm=True)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    region.buf[:24] = x.tobytes()
    async with _client(app) as http:
        await http.post("/v2/systemsharedmemory/region/r/register",
                        json={"key": region.name, "byte_size": 4096})
        pending = asyncio.create_task(http.post("/v2/models/double/infer",
                                                json=_infer_body("r")))
        await backend.entered.wait()
        assert (await http.post("/v2/systemsharedmemory/region/r/unregister")).status_code == 200
        backend.go.set()
        r = await pending
        # its input was read from the region it held; its answer is not written into a
        # region its client gave up, and says so
        assert r.status_code == 400, r.text
        assert "region 'r' was unregistered while the request used it" in r.json()["error"]
        assert backend.calls["double"] == [2]
        # serving on: the region again, and a request through it end to end
        await http.post("/v2/systemsharedmemory/region/r/register",
                        json={"key": region.name, "byte_size": 4096})
        r = await http.post("/v2/models/double/infer", json=_infer_body("r"))
        assert r.status_code == 200, r.text
        out = r.json()["outputs"][0]
        assert out["parameters"] == {"shared_memory_region": "r", "shared_memory_offset": 64,
                                     "shared_memory_byte_size": 24}
        np.testing.assert_array_equal(np.frombuffer(region.buf, np.float32, 6, 64), 2 * x.ravel())
        await http.post("/v2/systemsharedmemory/unregister")


def test_cuda_region_unregistered_during_a_request(monkeypatch: pytest.MonkeyPatch) -> None:
    mapping = FakeMapping(256)
    monkeypatch.setattr(shm, "cuda_opener", lambda: (lambda *args: mapping, ""))
    asyncio.run(_cuda_region_unregistered_during_a_request(mapping))


async def _cuda_region_unregistered_during_a_request(mapping: FakeMapping) -> None:
    backend = _Held()
    app = create_app(backend, max_body_bytes=4096, allow_client_shm=True)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    mapping.write(0, x)
    handle = bytes([3]) * 64
    register = {"raw_handle": {"b64": base64.b64encode(handle).decode()}, "device_id": 0,
                "byte_size": 256}
    async with _client(app) as http:
        assert "cuda_shared_memory" in (await http.get("/v2")).json()["extensions"]
        r = await http.post("/v2/cudasharedmemory/region/c/register", json=register)
        assert r.status_code == 200, r.text
        pending = asyncio.create_task(http.post("/v2/models/double/infer",
                                                json=_infer_body("c")))
        await backend.entered.wait()
        assert (await http.post("/v2/cudasharedmemory/region/c/unregister")).status_code == 200
        assert not mapping.closed and backend.forgotten == []  # its request still reads it
        backend.go.set()
        r = await pending
        assert r.status_code == 400, r.text
        assert "region 'c' was unregistered while the request used it" in r.json()["error"]
        assert backend.calls["double"] == [2]
        assert mapping.closed and backend.forgotten == [handle]
        # serving on: registered again, a request reads its input and writes its answer
        mapping.closed = False
        await http.post("/v2/cudasharedmemory/region/c/register", json=register)
        backend.go.set()
        r = await http.post("/v2/models/double/infer", json=_infer_body("c"))
        assert r.status_code == 200, r.text
        np.testing.assert_array_equal(mapping.mem[64:88].view(np.float32), 2 * x.ravel())
        await http.post("/v2/cudasharedmemory/unregister")
        assert backend.forgotten == [handle, handle]
