"""The KServe v2 / Triton gRPC endpoint: `inference.GRPCInferenceService`, as Triton
publishes it (grpc_service.proto, model_config.proto), served with grpcio's asyncio
server on the HTTP server's own event loop and process (`server.grpc_port`).

The messages and the servicer's base class are the ones tritonclient ships, generated
from Triton's proto (`tritonclient.grpc.service_pb2`, `service_pb2_grpc`,
`model_config_pb2`): an unmodified `tritonclient.grpc` client (sync, aio, streaming) talks
to it as to Triton. Every RPC is a thin layer over `server.api.ServingApi`, the same calls
the HTTP routes make: admission, refusals, the infer path, statistics and the counts
behind `/metrics` are one.

Errors are answered as Triton's gRPC server answers its own (its TRITONSERVER_Error codes
mapped to `grpc::StatusCode` in its grpc_utils.cc), by the HTTP status dstack gives them:

- 400 bad request -> INVALID_ARGUMENT (Triton's INVALID_ARG);
- 401 no token -> UNAUTHENTICATED (Triton has no authentication);
- 404 unknown model or version -> NOT_FOUND (Triton's "Request for unknown model: ... is
  not found"; some of its older paths said INVALID_ARG or UNAVAILABLE);
- 413 over `max_body_bytes` -> RESOURCE_EXHAUSTED (grpc's own for a message over its
  limit, which is set to `max_body_bytes`);
- 429 refused (queue full, unplanned, work ahead, expired) -> UNAVAILABLE, as Triton
  answers a full queue ("Exceeds maximum queue size"), not RESOURCE_EXHAUSTED: it is the
  code gRPC clients and retry policies take for "try again later";
- 503 not ready, unloading, restarting -> UNAVAILABLE;
- 500 internal, a worker's fault -> INTERNAL.

A refusal keeps its rule and its time to retry in the trailing metadata (`dstack-reason`,
`retry-after`), as HTTP has them in its body and header. `ModelStreamInfer` answers each
request of the stream as it is done (they run side by side, as separate calls would), an
error as the stream response's `error_message`, which tritonclient hands to the callback.

The system and CUDA shared-memory RPCs and the shared-memory tensors of ModelInfer are
`server.shm`'s, as over HTTP: off unless `server.allow_client_shm` (INVALID_ARGUMENT), for
clients on this host only (PERMISSION_DENIED, HTTP's 403).

With `server.frontends` > 1 the front ends serve the port (`FrontEndGrpc`) and the
dispatch process answers their calls with the same servicer. Not yet: trace and log
settings answer UNIMPLEMENTED.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from functools import wraps
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import grpc
from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from dstack.common.config import ServerConfig
from dstack.common.errors import DStackError, RequestError
from server import grpc_codec
from server.api import MODEL_VERSION, ServingApi, model_metadata
from server.auth import has_token, is_open
from server.shm import ShmRegistry

if TYPE_CHECKING:
    from server.link import Link

log = logging.getLogger("dstack.server")

#: The service's descriptor (`inference.GRPCInferenceService`).
SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]

#: A `DStackError`'s HTTP status -> the gRPC status it is answered with (module docstring).
STATUS_CODES: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    # Triton answers a full queue UNAVAILABLE ("Exceeds maximum queue size"), the code
    # gRPC clients and retry policies take for "try again later": so is every refusal.
    429: grpc.StatusCode.UNAVAILABLE,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
}


def status_code(e: DStackError) -> grpc.StatusCode:
    """The gRPC status `e` is answered with (`STATUS_CODES`; another 4xx is
    INVALID_ARGUMENT, another 5xx INTERNAL)."""
    code = STATUS_CODES.get(e.status_code)
    if code is None:
        code = (grpc.StatusCode.INVALID_ARGUMENT if e.status_code < 500
                else grpc.StatusCode.INTERNAL)
    return code


def trailing_metadata(e: DStackError) -> tuple[tuple[str, str], ...]:
    """A refusal's rule and time to retry after (whole seconds, at least 1)."""
    meta: list[tuple[str, str]] = []
    if e.rule is not None:
        meta.append(("dstack-reason", e.rule))
    if e.retry_after_s is not None:
        meta.append(("retry-after", str(max(1, -int(-e.retry_after_s // 1)))))
    return tuple(meta)


class Unauthenticated(DStackError):
    status_code = 401
    reason = "unauthorized"


class Malformed:
    """A request whose bytes are not its message (grpc answers its own deserializer's
    failure UNKNOWN): each RPC answers it INVALID_ARGUMENT, as HTTP answers bad JSON 400."""

    def __init__(self, kind: str, error: Exception) -> None:
        self.message = f"malformed {kind} message: {error}"


def _lenient(cls: type[Message]) -> Callable[[bytes], Any]:
    """`cls`'s deserializer, a `Malformed` for bytes that are not one; ModelInferRequest's
    is `grpc_codec.read_infer_request` (its tensors not copied): an `InferMessage`."""
    read: Callable[[bytes], Any] = (grpc_codec.read_infer_request
                                    if cls is pb.ModelInferRequest else cls.FromString)

    def parse(data: bytes) -> Any:
        try:
            return read(data)
        except DecodeError as e:
            return Malformed(cls.DESCRIPTOR.name, e)

    return parse


def _methods(servicer: pb_grpc.GRPCInferenceServiceServicer
             ) -> Iterable[tuple[Any, Callable[[bytes], Any], Any, Callable[[Any], bytes]]]:
    """Each RPC of the service (its descriptor), with its requests' deserializer
    (`_lenient`), `servicer`'s method and its responses' serializer."""
    for m in SERVICE.methods:
        yield (m, _lenient(getattr(pb, m.input_type.name)), getattr(servicer, m.name),
               getattr(pb, m.output_type.name).SerializeToString)


def service_handler(servicer: pb_grpc.GRPCInferenceServiceServicer) -> grpc.GenericRpcHandler:
    """`servicer`'s RPCs, as `add_GRPCInferenceServiceServicer_to_server` registers them,
    but for the requests' deserializer (`Malformed`); taken from the proto's descriptor."""
    handlers = {}
    for m, read, method, write in _methods(servicer):
        make = (grpc.stream_stream_rpc_method_handler if m.client_streaming
                else grpc.unary_unary_rpc_method_handler)
        handlers[m.name] = make(method, request_deserializer=read, response_serializer=write)
    return grpc.method_handlers_generic_handler(SERVICE.full_name, handlers)


Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Any]]


def _rpc(path: Callable[[Any], str]) -> Callable[[Handler], Handler]:
    """A unary RPC: authorized as HTTP's `path(request)` would be, its `DStackError`s
    and unexpected exceptions answered with their status (`status_code`)."""

    def wrap(fn: Handler) -> Handler:
        @wraps(fn)
        async def handler(self: InferenceServicer, request: Any,
                          context: grpc.aio.ServicerContext) -> Any:
            try:
                if isinstance(request, Malformed):
                    raise RequestError(request.message)
                self.authorize(context, path(request))
                return await fn(self, request, context)
            except DStackError as e:
                await _abort(context, e)
            except Exception as e:  # noqa: BLE001 - answered INTERNAL, as HTTP's 500
                log.exception("unhandled error in gRPC %s", fn.__name__)
                await context.abort(grpc.StatusCode.INTERNAL, _internal(e))

        return handler

    return wrap


async def _abort(context: grpc.aio.ServicerContext, e: DStackError) -> None:
    if e.status_code >= 500 and not e.logged:
        log.warning("%s: %s", type(e).__name__, e.message)
    await context.abort(status_code(e), e.message, trailing_metadata(e))


def _internal(e: BaseException) -> str:
    return f"internal error: {type(e).__name__}: {e}"


def _model_path(request: Any) -> str:
    return f"/v2/models/{request.name}"


T = TypeVar("T")
R = TypeVar("R")


async def answers_as_done(requests: AsyncIterator[T], answer: Callable[[T], Awaitable[R]]
                          ) -> AsyncIterator[R]:
    """A bidirectional stream's answers: each request taken as it comes and `answer`ed
    (which never raises) side by side with the others, each answer yielded when done."""
    answers: asyncio.Queue[R | None] = asyncio.Queue()
    running: set[asyncio.Task[None]] = set()

    async def one(request: T) -> None:
        await answers.put(await answer(request))

    async def read() -> None:
        try:
            async for request in requests:
                task = asyncio.create_task(one(request))
                running.add(task)
                task.add_done_callback(running.discard)
            if running:  # asyncio.wait, not gather: a cancel here leaves them running
                await asyncio.wait(set(running))
        finally:
            await answers.put(None)

    reader = asyncio.create_task(read())
    try:
        while (resp := await answers.get()) is not None:
            yield resp
    finally:
        # The client went away or closed its side: stop reading. Requests in flight run
        # to their end (every request's future is resolved by the runtime); their answers
        # are dropped.
        reader.cancel()


class Aborted(Exception):
    """`LinkedContext.abort`: the call ends with `code`."""

    def __init__(self, code: grpc.StatusCode, details: str,
                 trailing_metadata: Iterable[tuple[str, str]]) -> None:
        super().__init__(details)
        self.code, self.details = code, details
        self.trailing_metadata = tuple(trailing_metadata)


class LinkedContext:
    """The servicer's context for a call a front end received: its peer and metadata, as
    the front end saw them, and when it had the call (`received`, `time.monotonic()`,
    which the processes of one host share); `abort` raises `Aborted`."""

    def __init__(self, peer: str | None, metadata: Iterable[tuple[str, str]],
                 received: float) -> None:
        self._peer = peer
        self._metadata = tuple((k, v) for k, v in metadata)
        self.received = received

    def peer(self) -> str | None:
        return self._peer

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    async def abort(self, code: grpc.StatusCode, details: str = "",
                    trailing_metadata: Iterable[tuple[str, str]] = ()) -> NoReturn:
        raise Aborted(code, details, trailing_metadata)


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """`inference.GRPCInferenceService` over `api`. `token`: the bearer token every RPC
    must send in its `authorization` metadata, but those whose HTTP path is in
    `open_paths` (None: no authentication)."""

    def __init__(self, api: ServingApi, token: str | None = None,
                 open_paths: Iterable[str] = ()) -> None:
        self.api = api
        self.token = None if token is None else token.encode()
        self.open_paths = tuple(open_paths)
        self._linked: dict[str, tuple[Callable[[Any], Any], Any, Callable[[Any], bytes]]
                           ] | None = None

    def authorize(self, context: grpc.aio.ServicerContext, path: str) -> None:
        """Unauthenticated unless the call sends `authorization: Bearer <token>`
        (checked as `server.auth.BearerAuth` checks the HTTP header)."""
        if self.token is None or is_open(path, self.open_paths):
            return
        meta = [(k.encode(), v.encode() if isinstance(v, str) else v)
                for k, v in context.invocation_metadata() or ()]
        if not has_token(meta, self.token):
            raise Unauthenticated("unauthorized: send the server's token as the metadata "
                                  "`authorization: Bearer <token>`")

    # ------------------------------------------------------------------ server

    @_rpc(lambda r: "/v2/health/live")
    async def ServerLive(self, request: pb.ServerLiveRequest, context: Any) -> Any:
        return pb.ServerLiveResponse(live=True)

    @_rpc(lambda r: "/v2/health/ready")
    async def ServerReady(self, request: pb.ServerReadyRequest, context: Any) -> Any:
        return pb.ServerReadyResponse(ready=self.api.backend.is_ready())

    @_rpc(lambda r: "/v2")
    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: Any) -> Any:
        return pb.ServerMetadataResponse(**self.api.server_meta)

    # ------------------------------------------------------------------ models

    @_rpc(lambda r: _model_path(r) + "/ready")
    async def ModelReady(self, request: pb.ModelReadyRequest, context: Any) -> Any:
        # An unknown model is not ready (Triton answers ready: false, not an error).
        backend = self.api.backend
        try:
            self.api.spec_of(request.name, request.version)
        except DStackError:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=backend.is_model_ready(request.name))

    @_rpc(_model_path)
    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Any) -> Any:
        meta = model_metadata(self.api.spec_of(request.name, request.version))
        meta.pop("max_batch_size")  # not in Triton's message (the config has it)
        return json_format.ParseDict(meta, pb.ModelMetadataResponse())

    @_rpc(lambda r: _model_path(r) + "/config")
    async def ModelConfig(self, request: pb.ModelConfigRequest, context: Any) -> Any:
        config = self.api.model_config(request.name, request.version)
        return pb.ModelConfigResponse(config=json_format.ParseDict(config, mc.ModelConfig()))

    @_rpc(lambda r: _model_path(r) + "/stats")
    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context: Any) -> Any:
        names = [request.name] if request.name else self.api.backend.model_names()
        stats = {"model_stats": [self.api.model_stats(m, request.version) for m in names]}
        # `dstack`'s own counters have no field in Triton's message: HTTP has them.
        return json_format.ParseDict(stats, pb.ModelStatisticsResponse(),
                                     ignore_unknown_fields=True)

    # ------------------------------------------------------------------ repository

    @_rpc(lambda r: "/v2/repository/index")
    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context: Any) -> Any:
        entries = self.api.repository_index(request.ready)
        return pb.RepositoryIndexResponse(
            models=[pb.RepositoryIndexResponse.ModelIndex(**e) for e in entries])

    @_rpc(lambda r: f"/v2/repository/models/{r.model_name}/load")
    async def RepositoryModelLoad(self, request: pb.RepositoryModelLoadRequest,
                                  context: Any) -> Any:
        param = request.parameters.get("config")
        config = None if param is None else self.api.load_config(
            param.string_param or param.bytes_param.decode(errors="replace"))
        await self.api.repository("load")(request.model_name, config)
        return pb.RepositoryModelLoadResponse()

    @_rpc(lambda r: f"/v2/repository/models/{r.model_name}/unload")
    async def RepositoryModelUnload(self, request: pb.RepositoryModelUnloadRequest,
                                    context: Any) -> Any:
        await self.api.repository("unload")(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    # ------------------------------------------------------------------ infer

    @_rpc(lambda r: f"/v2/models/{r.msg.model_name}/infer")
    async def ModelInfer(self, request: grpc_codec.InferMessage, context: Any) -> Any:
        return await self.infer(request, context)

    async def infer(self, request: grpc_codec.InferMessage,
                    context: Any) -> pb.ModelInferResponse:
        """One infer request through the HTTP route's path (`ServingApi`): admitted,
        refused by its batch before its values are converted, run, answered; a failure
        counted as HTTP counts it and raised (a refusal after its hold, as HTTP's)."""
        # grpc has the whole message by now: its deadline counts from here (a little
        # later than HTTP's first byte), or from when a front end had it.
        received = (context.received if isinstance(context, LinkedContext)
                    else time.monotonic())
        t0 = time.perf_counter()
        api = self.api
        msg = request.msg
        model = msg.model_name
        spec = api.spec_of(model, msg.model_version)  # NOT_FOUND: no label for it
        try:
            api.check_admission(model)
            head = grpc_codec.parse_request(msg, spec, api.shm.access(context.peer()),
                                        request.raw)
            req, outputs = await api.run(model, head, received)
            resp = grpc_codec.encode_response(model, req, outputs, spec, MODEL_VERSION)
        except DStackError as e:
            api.count_failure(model, e, "queue" if e.queued else "body", received)
            if e.hold_s > 0:  # a refusal, paced: `Runtime.hold_s`
                await asyncio.sleep(e.hold_s)
            raise
        except Exception as e:
            api.count_failure(model, e, "", None)
            raise
        api.observe_latency(model, time.perf_counter() - t0)
        return resp

    async def ModelStreamInfer(self, request_iterator: AsyncIterator[grpc_codec.InferMessage],
                               context: grpc.aio.ServicerContext
                               ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Each request of the stream runs as it comes, side by side with the others
        (batched together as separate calls would be), and is answered when done
        (`stream_answer`)."""
        async for resp in answers_as_done(request_iterator,
                                          lambda r: self.stream_answer(r, context)):
            yield resp

    async def stream_answer(self, request: grpc_codec.InferMessage | Malformed,
                            context: Any) -> pb.ModelStreamInferResponse:
        """One request of a stream answered: its response, or its error in
        `error_message` (with the request's id). Never raises."""
        if isinstance(request, Malformed):
            return pb.ModelStreamInferResponse(error_message=request.message)
        msg = request.msg
        try:
            self.authorize(context, f"/v2/models/{msg.model_name}/infer")
            return pb.ModelStreamInferResponse(
                infer_response=await self.infer(request, context))
        except Exception as e:  # noqa: BLE001 - every request of the stream is answered
            if isinstance(e, DStackError):
                message = e.message
            else:
                log.exception("unhandled error in gRPC ModelStreamInfer")
                message = _internal(e)
            return pb.ModelStreamInferResponse(
                error_message=message, infer_response=pb.ModelInferResponse(
                    model_name=msg.model_name, model_version=msg.model_version, id=msg.id))

    async def answer_linked(self, rpc: str, data: bytes | memoryview, peer: str | None,
                            metadata: Iterable[tuple[str, str]], received: float
                            ) -> tuple[int, str, list[tuple[str, str]], bytes]:
        """A call a front end received (`server.frontends`), answered as this servicer
        answers its own: `rpc` (a method's name; `ModelStreamInfer`: one request of a
        stream) on the request's bytes, from `peer` with `metadata`, had by the front end
        at `received`. Returns the status code's number, its details, the trailing
        metadata and the response's bytes."""
        if self._linked is None:
            self._linked = {m.name: (read, method, write)
                            for m, read, method, write in _methods(self)}
        entry = self._linked.get(rpc)
        if entry is None:
            return grpc.StatusCode.UNIMPLEMENTED.value[0], f"no method {rpc!r}", [], b""
        read, method, write = entry
        context = LinkedContext(peer, metadata, received)
        if rpc == "ModelStreamInfer":
            answer = await self.stream_answer(self._linked["ModelInfer"][0](data), context)
            return 0, "", [], answer.SerializeToString()
        try:
            resp = await method(read(data if rpc == "ModelInfer" else bytes(data)), context)
        except Aborted as a:
            return a.code.value[0], a.details, list(a.trailing_metadata), b""
        return 0, "", [], write(resp)

    # ------------------------------------------------------------------ shared memory

    def registry(self, context: Any) -> ShmRegistry:
        return self.api.shm.check(context.peer())

    @_rpc(lambda r: "/v2/systemsharedmemory/status")
    async def SystemSharedMemoryStatus(self, request: pb.SystemSharedMemoryStatusRequest,
                                       context: Any) -> Any:
        regions = self.registry(context).system_status(request.name or None)
        Status = pb.SystemSharedMemoryStatusResponse.RegionStatus
        return pb.SystemSharedMemoryStatusResponse(
            regions={r["name"]: Status(**r) for r in regions})

    @_rpc(lambda r: f"/v2/systemsharedmemory/region/{r.name}/register")
    async def SystemSharedMemoryRegister(self, request: pb.SystemSharedMemoryRegisterRequest,
                                         context: Any) -> Any:
        self.registry(context).register_system(request.name, request.key, request.offset,
                                               request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    @_rpc(lambda r: "/v2/systemsharedmemory/unregister")
    async def SystemSharedMemoryUnregister(
            self, request: pb.SystemSharedMemoryUnregisterRequest, context: Any) -> Any:
        self.registry(context).unregister_system(request.name or None)
        return pb.SystemSharedMemoryUnregisterResponse()

    @_rpc(lambda r: "/v2/cudasharedmemory/status")
    async def CudaSharedMemoryStatus(self, request: pb.CudaSharedMemoryStatusRequest,
                                     context: Any) -> Any:
        regions = self.registry(context).cuda_status(request.name or None)
        Status = pb.CudaSharedMemoryStatusResponse.RegionStatus
        return pb.CudaSharedMemoryStatusResponse(
            regions={r["name"]: Status(**r) for r in regions})

    @_rpc(lambda r: f"/v2/cudasharedmemory/region/{r.name}/register")
    async def CudaSharedMemoryRegister(self, request: pb.CudaSharedMemoryRegisterRequest,
                                       context: Any) -> Any:
        self.registry(context).register_cuda(request.name, request.raw_handle,
                                             request.device_id, request.byte_size)
        return pb.CudaSharedMemoryRegisterResponse()

    @_rpc(lambda r: "/v2/cudasharedmemory/unregister")
    async def CudaSharedMemoryUnregister(self, request: pb.CudaSharedMemoryUnregisterRequest,
                                         context: Any) -> Any:
        self.registry(context).unregister_cuda(request.name or None)
        return pb.CudaSharedMemoryUnregisterResponse()


class GrpcEndpoint:
    """The gRPC endpoint of a server: `bind()` (in the event loop that will serve it,
    before the slow start of the runtime: a port in use fails fast), `start()` once the
    runtime is ready, `stop(grace_s)` to drain. `servicer` answers its calls, and those
    of the front ends (`answer_linked`)."""

    reuse_port = 0  # else a second server binds the port too

    def __init__(self, api: ServingApi | None, cfg: ServerConfig, host: str, port: int,
                 token: str | None = None) -> None:
        self.cfg = cfg
        self.host = host
        self.port = port
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.servicer = (None if api is None
                         else InferenceServicer(api, token, cfg.auth_open_paths))
        self.server: grpc.aio.Server | None = None

    def handler(self) -> grpc.GenericRpcHandler:
        assert self.servicer is not None
        return service_handler(self.servicer)

    def bind(self) -> int:
        """Bind the port; returns it. OSError, or RuntimeError (grpcio's), when it cannot
        be bound."""
        if not self.reuse_port:
            self._probe()
        cfg = self.cfg
        server = grpc.aio.server(
            options=[
                ("grpc.so_reuseport", self.reuse_port),
                ("grpc.max_receive_message_length", cfg.max_body_bytes),
                ("grpc.max_send_message_length", -1),
            ],
            # One more RPC is answered RESOURCE_EXHAUSTED, as HTTP's connection cap 503s.
            maximum_concurrent_rpcs=cfg.max_connections,
        )
        server.add_generic_rpc_handlers((self.handler(),))
        if cfg.tls_certfile is not None:  # the HTTP server's certificate and key
            cert = cfg.tls_certfile.read_bytes()
            key = (cfg.tls_keyfile or cfg.tls_certfile).read_bytes()
            self.port = server.add_secure_port(
                self.address, grpc.ssl_server_credentials([(key, cert)]))
        else:
            self.port = server.add_insecure_port(self.address)
        self.server = server
        return self.port

    def _probe(self) -> None:
        """OSError when the port is taken: found before grpcio, whose C core would also
        write a line of its own to stderr beside the server's one-line error or warning."""
        if not self.port:
            return
        family, _, _, _, addr = socket.getaddrinfo(self.host, self.port,
                                                   type=socket.SOCK_STREAM)[0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)

    async def start(self) -> None:
        assert self.server is not None, "bind() first"
        await self.server.start()

    async def stop(self, grace_s: float) -> None:
        """Stop taking calls; those in flight get `grace_s` to end."""
        if self.server is not None:
            await self.server.stop(grace_s)
            self.server = None


# ---------------------------------------------------------------------- in a front end

#: A request this big crosses the link in the front end's shared memory (`SharedBodies`).
SHARED_FROM_BYTES = 64 << 10

_CODES = {c.value[0]: c for c in grpc.StatusCode}


class FrontEndGrpc(GrpcEndpoint):
    """A front end's gRPC endpoint (`server.frontends` > 1): every front end listens on
    the port (SO_REUSEPORT: the kernel spreads the connections), and each call's bytes
    cross the link (`g`) to the dispatch process's servicer (`answer_linked`), which
    decides and answers it as it answers its own; a big request crosses in the front
    end's shared memory. The front end parses nothing: grpcio's own work per call (most
    of what a gRPC call costs) stays in the front ends."""

    reuse_port = 1

    def __init__(self, link: Link, cfg: ServerConfig, host: str, port: int) -> None:
        super().__init__(None, cfg, host, port)
        self.link = link

    def handler(self) -> grpc.GenericRpcHandler:
        handlers = {}
        for m in SERVICE.methods:
            if m.client_streaming:
                handlers[m.name] = grpc.stream_stream_rpc_method_handler(self._stream)
            else:
                handlers[m.name] = grpc.unary_unary_rpc_method_handler(
                    self._unary(m.name))
        return grpc.method_handlers_generic_handler(SERVICE.full_name, handlers)

    def _unary(self, rpc: str) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[bytes]]:
        async def call(data: bytes, context: grpc.aio.ServicerContext) -> bytes:
            code, details, trailing, out = await self._call(rpc, data, context)
            if code:
                await context.abort(_CODES.get(code, grpc.StatusCode.UNKNOWN), details,
                                    trailing)
            return out

        return call

    async def _stream(self, requests: AsyncIterator[bytes],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        async def one(data: bytes) -> bytes:
            code, details, _, out = await self._call("ModelStreamInfer", data, context)
            return (pb.ModelStreamInferResponse(error_message=details).SerializeToString()
                    if code else out)

        async for out in answers_as_done(requests, one):
            yield out

    async def _call(self, rpc: str, data: bytes, context: grpc.aio.ServicerContext
                    ) -> tuple[int, str, tuple[tuple[str, str], ...], bytes]:
        """`rpc` on `data` across the link: (code, details, trailing metadata, bytes)."""
        link = self.link
        meta: dict[str, Any] = {
            "k": "g", "i": next(link.ids), "r": rpc, "P": context.peer(), "t": time.monotonic(),
            "A": [(k, v) for k, v in context.invocation_metadata() or ()
                  if k == "authorization"]}
        shared = link.shared
        body = (shared.take(len(data)) if shared is not None and shared.enabled
                and len(data) >= SHARED_FROM_BYTES else None)
        if body is not None:
            body.view[:] = data
            meta["o"], meta["n"], data = body.at, body.size, b""
        try:
            reply, out = await link.call(meta, data, None if body is None else body.free)
        except DStackError as e:  # the dispatch process is gone
            if body is not None:
                body.free()
            return status_code(e).value[0], e.message, trailing_metadata(e), b""
        return (reply["c"], reply.get("e", ""),
                tuple((k, v) for k, v in reply.get("T", ())), out)
