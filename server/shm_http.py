"""The shared-memory extensions' HTTP routes, as Triton's HTTP server has them
(`v2/systemsharedmemory/...`, `v2/cudasharedmemory/...`) and tritonclient.http calls them:
register (a JSON body), unregister one region or all, status of one region or all. Every
call is answered by `server.shm.SharedMemory.check` first: off (400) or from a client not
on this host (403)."""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from fastapi import FastAPI, Request

from dstack.common.errors import PayloadTooLarge, RequestError
from server.shm import SharedMemory, ShmRegistry


def _peer(request: Request) -> str | None:
    client = request.scope.get("client")
    return client[0] if client else None


async def _json(request: Request, max_body_bytes: int) -> dict[str, Any]:
    body = await request.body()
    if len(body) > max_body_bytes:
        raise PayloadTooLarge(f"request body exceeds the limit of {max_body_bytes} bytes")
    try:
        obj = json.loads(body) if body.strip() else {}
    except ValueError as e:
        raise RequestError(f"request body is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise RequestError("request body must be a JSON object")
    return obj


def raw_handle(body: dict[str, Any]) -> bytes:
    """The `cudaIpcMemHandle_t` of a CUDA register body: `{"raw_handle": {"b64": ...}}`."""
    handle = body.get("raw_handle")
    b64 = handle.get("b64") if isinstance(handle, dict) else None
    if not isinstance(b64, str):
        raise RequestError('raw_handle must be {"b64": "<the cudaIpcMemHandle_t in base64>"}')
    try:
        return base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RequestError(f"raw_handle.b64 is not base64: {e}") from None


def install_shm_routes(app: FastAPI, shm: SharedMemory, max_body_bytes: int) -> None:
    def registry(request: Request) -> ShmRegistry:
        return shm.check(_peer(request))

    # ------------------------------------------------------------------ system

    @app.post("/v2/systemsharedmemory/region/{name}/register")
    async def system_register(name: str, request: Request) -> dict[str, Any]:
        reg = registry(request)
        body = await _json(request, max_body_bytes)
        reg.register_system(name, body.get("key"), body.get("offset", 0),
                            body.get("byte_size"))
        return {}

    @app.post("/v2/systemsharedmemory/region/{name}/unregister")
    async def system_unregister(name: str, request: Request) -> dict[str, Any]:
        registry(request).unregister_system(name)
        return {}

    @app.post("/v2/systemsharedmemory/unregister")
    async def system_unregister_all(request: Request) -> dict[str, Any]:
        registry(request).unregister_system()
        return {}

    @app.get("/v2/systemsharedmemory/status")
    async def system_status_all(request: Request) -> list[dict[str, Any]]:
        return registry(request).system_status()

    @app.get("/v2/systemsharedmemory/region/{name}/status")
    async def system_status(name: str, request: Request) -> list[dict[str, Any]]:
        return registry(request).system_status(name)

    # ------------------------------------------------------------------ CUDA

    @app.post("/v2/cudasharedmemory/region/{name}/register")
    async def cuda_register(name: str, request: Request) -> dict[str, Any]:
        reg = registry(request)
        body = await _json(request, max_body_bytes)
        reg.register_cuda(name, raw_handle(body), body.get("device_id", 0),
                          body.get("byte_size"))
        return {}

    @app.post("/v2/cudasharedmemory/region/{name}/unregister")
    async def cuda_unregister(name: str, request: Request) -> dict[str, Any]:
        registry(request).unregister_cuda(name)
        return {}

    @app.post("/v2/cudasharedmemory/unregister")
    async def cuda_unregister_all(request: Request) -> dict[str, Any]:
        registry(request).unregister_cuda()
        return {}

    @app.get("/v2/cudasharedmemory/status")
    async def cuda_status_all(request: Request) -> list[dict[str, Any]]:
        return registry(request).cuda_status()

    @app.get("/v2/cudasharedmemory/region/{name}/status")
    async def cuda_status(name: str, request: Request) -> list[dict[str, Any]]:
        return registry(request).cuda_status(name)
