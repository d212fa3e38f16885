"""The FastAPI app: KServe v2 / Triton HTTP routes over an `InferenceBackend`.

Only HTTP lives here: the wire format is `server.codec`, scheduling is the backend's.
Every error reaches the client as `{"error": "..."}`: a `DStackError` with its own status
code, an unexpected exception as 500 (and logged with its traceback).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dstack.common.backend import InferenceBackend
from dstack.common.errors import (
    DStackError,
    ModelNotFound,
    PayloadTooLarge,
    RequestError,
    Unavailable,
)
from dstack.common.types import ModelSpec
from server import codec
from server.api import (  # noqa: F401 - model_metadata and triton_stats: imported from here
    EXTENSIONS,
    MODEL_VERSION,
    PLATFORM,
    SERVER_NAME,
    ServingApi,
    model_metadata,
    triton_stats,
    version,
)
from server.connection import RECEIVED_AT
from server.dashboard import install_dashboard
from server.early import HELD, INFER_PATH
from server.limits import error_json, header, retry_after
from server.metrics import CONTENT_TYPE, Metrics
from server.shm import SharedMemory
from server.shm_http import install_shm_routes

log = logging.getLogger("dstack.server")

def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _internal(e: Exception) -> str:
    """What an unexpected exception is answered with (500)."""
    return f"internal error: {type(e).__name__}: {e}"


class _CatchAll:
    """Innermost safety net: an exception no handler took becomes 500 `{"error"}`.

    Starlette's own `Exception` handler re-raises after answering (so servers log it
    twice and test clients raise); this answers once and logs once.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracking(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracking)
        except Exception as e:
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise
            resp = _error(500, _internal(e))
            await resp(scope, receive, send)


async def read_body(scope: Scope, receive: Receive, max_body_bytes: int) -> bytes:
    """The whole body, refused with 413 as soon as it is known to exceed the limit:
    from Content-Length before reading anything, else while streaming (chunked)."""
    value = header(scope, b"content-length")
    declared = None if value is None else value.decode("latin-1")
    if declared is not None:
        try:
            n = int(declared)
        except ValueError:
            raise RequestError(f"Content-Length {declared!r} is not an integer") from None
        if n > max_body_bytes:
            raise PayloadTooLarge(
                f"request body of {n} bytes exceeds the limit of {max_body_bytes}"
            )
    chunks: list[bytes] = []
    total = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            # Nobody is left to answer; a 400 keeps it out of the unhandled-error log.
            raise RequestError(f"client disconnected after {total} bytes of the body")
        chunk = msg.get("body", b"")
        total += len(chunk)
        if total > max_body_bytes:
            raise PayloadTooLarge(f"request body exceeds the limit of {max_body_bytes} bytes")
        if chunk:
            chunks.append(chunk)
        if not msg.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


#: The scope key `infer` sets once a request's body has been read: a refusal after that is
#: timed under the stage "body" (`server.metrics.Metrics.failed`), or "queue" (`refusal_stage`).
BODY_READ = "dstack.body_read"


def refusal_stage(e: DStackError, scope: Scope) -> str:
    """Where an infer request's refusal `e` was decided (`server.metrics.REFUSAL_STAGES`):
    at its header, once its body was read, or after it waited queued (`expired`)."""
    if not scope.get(BODY_READ):
        return "header"
    return "queue" if e.queued else "body"


#: The binary extension's header, as ASGI has it.
HEADER_LENGTH = codec.HEADER_LENGTH.lower().encode()


def _error_answer(e: DStackError) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """What a `DStackError` is answered with: its status, `Retry-After` when it has one,
    and `{"error": ..., "reason": RULE}` (the rule, for a refusal)."""
    if e.status_code >= 500 and not e.logged:  # else logged once for its event
        log.warning("%s: %s", type(e).__name__, e.message)
    return e.status_code, retry_after(e), error_json(e.message, e.rule)


async def _answer(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes,
                  content_type: bytes = b"application/json") -> None:
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-length", str(len(body)).encode()), (b"content-type", content_type),
        *headers]})
    await send({"type": "http.response.body", "body": body})


class _InferFirst:
    """ASGI middleware: `POST .../infer` goes straight to `endpoint(scope, receive, send,
    model, version)`, past FastAPI's and Starlette's layers (their error middlewares,
    router, request and response objects: a fifth of the server's CPU per request),
    which serve every other request. The endpoint answers its own errors."""

    def __init__(self, app: ASGIApp, endpoint: Callable[..., Any]) -> None:
        self.app = app
        self.endpoint = endpoint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            m = INFER_PATH.match(scope["path"])
            if m is not None:
                await self.endpoint(scope, receive, send, m.group(1), m.group(2))
                return
        await self.app(scope, receive, send)


def create_app(
    backend: InferenceBackend,
    *,
    max_body_bytes: int,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None = None,
    title: str = "dstack",
    allow_client_shm: bool = False,
) -> FastAPI:
    """Build the app. `lifespan` starts and stops the backend (see `server.main`);
    tests pass a ready fake backend and none. `allow_client_shm`: serve the system and
    CUDA shared-memory extensions to clients on this host (`server.shm`)."""
    app = FastAPI(title=title, version=version(), lifespan=lifespan)
    app.add_middleware(_CatchAll)
    metrics = Metrics(backend, MODEL_VERSION)
    app.state.metrics = metrics
    dashboard = install_dashboard(app, backend, metrics, MODEL_VERSION)  # GET /dashboard
    shm = SharedMemory(allow_client_shm)
    shm.registry.forget_device_memory = backend.forget_device_memory
    api = ServingApi(backend, metrics, dashboard.latency.observe, shm)
    app.state.api = api  # what the gRPC endpoint serves (server.grpc_server)
    server_meta = api.server_meta

    @app.exception_handler(DStackError)
    async def _dstack_error(_: Request, e: DStackError) -> Response:
        status, headers, body = _error_answer(e)
        return Response(body, status, {k.decode(): v.decode() for k, v in headers},
                        media_type="application/json")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        msg = str(e.detail)
        if e.status_code == 404:
            msg = f"no route {request.method} {request.url.path}"
        return _error(e.status_code, msg)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return _error(400, f"bad request: {e.errors()}")

    spec_of = api.spec_of
    check_admission = api.check_admission
    observe_body = api.observe_body
    release = api.release

    # ------------------------------------------------------------------ server

    @app.get("/v2")
    async def server_metadata() -> dict[str, Any]:
        return server_meta

    @app.get("/v2/health/live")
    async def live() -> dict[str, bool]:
        return {"live": True}

    @app.get("/v2/health/ready")
    async def ready() -> dict[str, bool]:
        if not backend.is_ready():
            raise Unavailable("server is not ready: some models are not ready")
        return {"ready": True}

    # ------------------------------------------------------------------ repository

    async def repository_body(request: Request) -> dict[str, Any]:
        body = await read_body(request.scope, request.receive, max_body_bytes)
        if not body.strip():
            return {}
        try:
            obj = json.loads(body)
        except ValueError as e:
            raise RequestError(f"request body is not JSON: {e}") from None
        if not isinstance(obj, dict):
            raise RequestError("request body must be a JSON object")
        return obj

    @app.post("/v2/repository/index")
    async def repository_index(request: Request) -> list[dict[str, str]]:
        return api.repository_index((await repository_body(request)).get("ready") is True)

    repository = api.repository

    @app.post("/v2/repository/models/{model}/load")
    async def load_model(model: str, request: Request) -> dict[str, Any]:
        """Triton's load: `{"parameters": {"config": "<the model's config as JSON>"}}`
        (optional: without it, the config the model was known by)."""
        params = (await repository_body(request)).get("parameters", {})
        if not isinstance(params, dict):
            raise RequestError("parameters must be a JSON object")
        await repository("load")(model, api.load_config(params.get("config")))
        return {}

    @app.post("/v2/repository/models/{model}/unload")
    async def unload_model(model: str, request: Request) -> dict[str, Any]:
        await repository_body(request)  # parameters (unload_dependents) change nothing here
        await repository("unload")(model)
        return {}

    # ------------------------------------------------------------------ models

    async def metadata(model: str, version: str | None = None) -> dict[str, Any]:
        return model_metadata(spec_of(model, version))

    async def model_ready(model: str, version: str | None = None) -> dict[str, Any]:
        spec_of(model, version)
        api.require_ready(model)
        return {"name": model, "ready": True}

    async def stats(model: str, version: str | None = None) -> dict[str, Any]:
        return {"model_stats": [api.model_stats(model, version)]}

    async def config(model: str, version: str | None = None) -> dict[str, Any]:
        return api.model_config(model, version)

    install_shm_routes(app, shm, max_body_bytes)

    latency = dashboard.latency

    async def infer(scope: Scope, receive: Receive, send: Send, model: str,
                    version: str | None) -> None:
        """POST /v2/models/{model}[/versions/{version}]/infer, as a bare ASGI endpoint
        (`_InferFirst`) that answers its own errors as the app's handlers do. Answered 200:
        timed into the dashboard's latency histogram, from here (the body read) on."""
        t0 = time.perf_counter()
        try:
            spec = spec_of(model, version)  # 404: no label for it
            try:
                payload, hlen = await _infer(scope, receive, model, spec)
            except DStackError as e:
                metrics.failed(model, e, refusal_stage(e, scope), scope.get(RECEIVED_AT))
                raise
            except Exception:
                metrics.failures.add(model, "backend")
                raise
        except DStackError as e:
            if e.hold_s > 0:  # a refusal, paced: `Runtime.hold_s`
                await asyncio.sleep(e.hold_s)
            await _answer(send, *_error_answer(e))
            return
        except Exception as e:
            log.exception("unhandled error on POST %s", scope["path"])
            await _answer(send, 500, [], error_json(_internal(e)))
            return
        latency.observe(model, time.perf_counter() - t0)
        if hlen is None:
            await _answer(send, 200, [], payload)
        else:
            await _answer(send, 200, [(HEADER_LENGTH, str(hlen).encode())], payload,
                          b"application/octet-stream")

    async def _infer(scope: Scope, receive: Receive, model: str,
                     spec: ModelSpec) -> tuple[bytes, int | None]:
        # the deadline counts from the request's first byte, the body's reading included
        received = scope.get(RECEIVED_AT) or time.monotonic()
        check_admission(model)  # before the body is read
        body = await read_body(scope, receive, max_body_bytes)
        scope[BODY_READ] = True
        if observe_body is not None:
            observe_body(model, time.monotonic() - received)
        hlen = header(scope, HEADER_LENGTH)
        client = scope.get("client")
        head = codec.parse_request(body, None if hlen is None else hlen.decode("latin-1"), spec,
                                   shm.access(client[0] if client else None))
        held = scope.pop(HELD, None)
        if held is not None and release is not None:
            release(*held)
        # refused by its batch size before its numbers are parsed, else parsed and run
        req, outputs = await api.run(model, head, received)
        return codec.encode_response(model, req, outputs, spec)

    class InferRoute:
        """The routes' endpoint (the router answers 405 to other methods; POST is taken
        by `_InferFirst` before the router)."""

        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            params = scope["path_params"]
            await infer(scope, receive, send, params["model"], params.get("version"))

    for i, prefix in enumerate(("/v2/models/{model}", "/v2/models/{model}/versions/{version}")):
        app.add_api_route(prefix, metadata, methods=["GET"])
        app.add_api_route(prefix + "/ready", model_ready, methods=["GET"])
        app.add_api_route(prefix + "/stats", stats, methods=["GET"])
        app.add_api_route(prefix + "/config", config, methods=["GET"])
        app.router.routes.insert(i, Route(prefix + "/infer", InferRoute(), methods=["POST"],
                                          include_in_schema=False))

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    # ------------------------------------------------------------------ dstack views

    @app.get("/v1/plan")
    async def plan() -> dict[str, Any]:
        p = backend.plan()
        if p is None:
            raise ModelNotFound(f"policy {backend.policy_name()} makes no plan")
        return p.to_dict()

    @app.get("/v1/schedule")
    async def schedule() -> dict[str, Any]:
        s = backend.schedule()
        if s is None:
            raise ModelNotFound(f"policy {backend.policy_name()} has no schedule")
        return s.to_dict()

    app.add_middleware(_InferFirst, endpoint=infer)
    app.state.infer_endpoint = infer  # what front ends in other processes call (server.frontends)
    return app

