"""`dstack serve`: load the config, build the runtime, serve it over HTTP with uvicorn.

`serve` starts the runtime's workers before the socket accepts anything and says "ready"
only then; a start-up failure is one line on stderr and exit code 2. SIGINT and SIGTERM
both drain: requests in flight get `server.shutdown_grace_s` to finish, then the workers
stop and the process exits 0. `docs/limits.md` describes every limit.
"""

from __future__ import annotations

import asyncio
import fcntl
import ipaddress
import logging
import shutil
import signal
import socket
import ssl
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Protocol

import uvicorn
from fastapi import FastAPI

from dstack.common.backend import InferenceBackend
from dstack.common.config import DeployConfig, ServerConfig, frontend_processes, load_config
from dstack.common.errors import DStackError
from dstack.common.pauses import freeze_startup_objects, prompt_gil_handoffs
from dstack.common.slices import available_cores, pin_threads
from server.app import MODEL_VERSION, create_app
from server.auth import BearerAuth, header_allows, load_token
from server.connection import raise_fd_limit, server_config
from server.early import EarlyRefusal, HeaderRefusal
from server.limits import BodyBudget, BodyLimits
from server.memory import steady_server_heap

if TYPE_CHECKING:
    from dstack.runtime.serving import Runtime
    from server.grpc_server import GrpcEndpoint

log = logging.getLogger("dstack.server")


class Startable(InferenceBackend, Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def build_app(cfg: DeployConfig, runtime: Startable | None = None, *,
              auth_token: str | None = None, start_runtime: bool = True) -> FastAPI:
    """The app over `runtime` (default: a `dstack.runtime.serving.Runtime` for `cfg`), with
    the body limits and, given `auth_token`, bearer authentication. `start_runtime`: the
    app's lifespan starts and stops the runtime (False: the caller does, as `serve` does)."""
    if runtime is None:
        from dstack.runtime.serving import Runtime  # heavy (torch): imported only when serving

        runtime = Runtime(cfg)
    rt = runtime

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await rt.start()
        try:
            yield
        finally:
            await rt.stop()

    app = create_app(runtime, max_body_bytes=cfg.server.max_body_bytes,
                     lifespan=lifespan if start_runtime else None,
                     allow_client_shm=cfg.server.allow_client_shm)
    return guard(app, runtime, cfg.server, auth_token)


def guard(app: FastAPI, backend: object, s: ServerConfig, auth_token: str | None) -> FastAPI:
    """`app` behind the server's limits: the body limits and budget, the refusals that
    `backend` decides before a body is read (where it has `refuse_early`) and, given
    `auth_token`, bearer authentication, outermost."""
    app.add_middleware(BodyLimits, max_body_bytes=s.max_body_bytes,
                       budget=BodyBudget(s.body_budget_bytes))
    refuse_early = getattr(backend, "refuse_early", None)
    if refuse_early is not None:  # outside the body limits: refused before the body is read
        release = getattr(backend, "release", None)
        app.add_middleware(EarlyRefusal, refuse_early=refuse_early,
                           failed=app.state.metrics.failed, version=MODEL_VERSION,
                           release=release)
        # asked by the connection itself (server_config), before any task or app runs
        app.state.header_refusal = HeaderRefusal(
            refuse_early=refuse_early, failed=app.state.metrics.failed,
            version=MODEL_VERSION, max_body_bytes=s.max_body_bytes,
            allowed=header_allows(auth_token, s.auth_open_paths), hold=release is not None)
    if auth_token is not None:  # outermost: no body is read for a request without the token
        app.add_middleware(BearerAuth, token=auth_token, open_paths=s.auth_open_paths)
    return app


def bind(host: str, port: int) -> socket.socket:
    """Bind the listening socket ourselves, so that port 0 resolves to a real port
    that can be logged (and read by tests) before the workers start."""
    sock = _bound(host, port, socket.SO_REUSEADDR)
    sock.set_inheritable(True)
    return sock


def _bound(host: str, port: int, option: int) -> socket.socket:
    """A TCP socket with the socket-level `option` set, bound to (`host`, `port`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on sockets that say TCP,
    # and without it every response waits ~40 ms for the client's delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, option, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


@contextmanager
def port_lock(port: int) -> Iterator[None]:
    """This host's `dstack serve` processes, one at a time, between trying `port` and
    binding it (an exclusive lock on a file in the temp folder; none where that file
    cannot be opened, e.g. another user's)."""
    try:
        f = open(Path(tempfile.gettempdir()) / f"dstack-port-{port}.lock", "a")  # noqa: SIM115
    except OSError:
        f = None
    if f is None:
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield  # (closing the file releases the lock)


def reserve(host: str, port: int) -> socket.socket:
    """A socket bound to `port` with SO_REUSEPORT and never listening: it takes no
    connection, and keeps the port from every other bind but those of this user's
    processes that set SO_REUSEPORT too (the front ends' gRPC servers)."""
    return _bound(host, port, socket.SO_REUSEPORT)


def make_server(app: FastAPI, cfg: ServerConfig | None = None, *,
                log_level: str | None = None) -> uvicorn.Server:
    """A uvicorn server for `app`; run it with `server.run(sockets=[bind(host, port)])`."""
    return uvicorn.Server(server_config(app, cfg, log_level=log_level))


class StartupError(Exception):
    """Serving cannot start; the message says why (one line)."""


class _Serving(uvicorn.Server):
    """uvicorn's server with the runtime started before the socket listens (so that a
    failed start raises out of `run` before anything says ready) and stopped after the
    connections drained."""

    def __init__(self, config: uvicorn.Config, runtime: Startable,
                 on_ready: Callable[[], None], grpc: GrpcPort | None = None) -> None:
        super().__init__(config)
        self.runtime = runtime
        self.on_ready = on_ready
        self.grpc = grpc

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if self.should_exit:  # stopped before it started
            return
        if self.grpc is not None:
            self.grpc.bind()  # before the workers start: a port in use fails fast
        try:
            await self.runtime.start()
            if self.should_exit:  # a signal while the workers were starting
                await self.runtime.stop()
                if self.grpc is not None:
                    await self.grpc.stop(0)
                return
            try:
                await super().startup(sockets)
                if self.grpc is not None:
                    await self.grpc.start()
            except BaseException:
                await self.runtime.stop()
                raise
        except BaseException:
            if self.grpc is not None:
                await self.grpc.stop(0)
            raise
        freeze_startup_objects()  # a full collection must not stop the loop for ~150 ms
        self.on_ready()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            if self.grpc is None:
                await super().shutdown(sockets)
            else:  # both drain together, within the same grace
                await asyncio.gather(super().shutdown(sockets),
                                     self.grpc.stop(self.config.timeout_graceful_shutdown))
        finally:
            await self.runtime.stop()


class GrpcPort:
    """The gRPC endpoint `dstack serve` runs beside HTTP, in its event loop
    (`server.grpc_server`): bound before the workers start, serving once they are ready.
    `explicit`: the port was asked for (the config or `--grpc-port`), and one that cannot
    be bound fails the start; else (the default port) gRPC is off with a warning."""

    def __init__(self, endpoint: GrpcEndpoint, explicit: bool) -> None:
        self.endpoint = endpoint
        self.explicit = explicit
        self.bound = False
        self.held: socket.socket | None = None

    def bind(self, listen: bool = True) -> None:
        """`listen`: False where the front ends will listen (`server.frontends` > 1): the
        port is held for them (`reserve`) until `stop`."""
        try:
            # Tried with a socket of our own first: grpcio's failure also logs a line of
            # its own on stderr, and a start-up error is one line. (A plain bind fails
            # where another server's front ends hold the port: `reserve` alone would not.)
            # Other servers started at the same time wait: between the try and grpcio's
            # bind, one of them could take the port (`port_lock`).
            with port_lock(self.endpoint.port):
                bind(self.endpoint.host, self.endpoint.port).close()
                if listen:
                    self.endpoint.bind()
                else:
                    self.held = reserve(self.endpoint.host, self.endpoint.port)
        except (OSError, OverflowError, RuntimeError):  # grpcio: "Failed to bind to ..."
            where = self.endpoint.address
            if self.explicit:
                raise StartupError(f"cannot listen for gRPC on {where}: the port is in use "
                                   "or the address is not this host's (server.grpc_port, "
                                   "--grpc-port; 0 turns gRPC off)") from None
            log.warning("gRPC off: cannot listen on %s, server.grpc_port's default (set it "
                        "or --grpc-port to a free port, 0 to turn gRPC off)", where)
            return
        self.bound = True

    async def start(self) -> None:
        if self.bound:
            await self.endpoint.start()
            log.info("gRPC (KServe v2 / Triton) on %s", self.endpoint.address)

    async def stop(self, grace_s: float | None) -> None:
        await self.endpoint.stop(grace_s or 0.0)
        if self.held is not None:
            self.held.close()
            self.held = None


class _Dispatching:
    """`server.frontends: N > 1`: this process keeps the runtime and answers its front-end
    processes (`server.frontends`), which serve the socket; `run` as `_Serving.run`."""

    def __init__(self, app: FastAPI, runtime: Startable, cfg: DeployConfig, config_path: Path,
                 frontend_cores: tuple[int, ...] | None, on_ready: Callable[[], None],
                 grpc: GrpcPort | None = None) -> None:
        self.app = app
        self.grpc = grpc
        self.runtime = runtime
        self.cfg = cfg
        self.config_path = config_path
        self.frontend_cores = frontend_cores
        self.on_ready = on_ready
        self.should_exit = False
        self.started = False

    def run(self, sockets: list[socket.socket]) -> None:
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(self._main(sockets[0]))

    async def _main(self, sock: socket.socket) -> None:
        from server.frontends import FrontEnds
        from server.link import Dispatch

        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if self.should_exit:
            return
        # gRPC: the front ends listen, this process answers their calls (its servicer)
        grpc = self.grpc
        if grpc is not None:
            grpc.bind(listen=False)
            if not grpc.bound:
                grpc = None
        try:
            await self.runtime.start()
        except BaseException:
            if grpc is not None:
                await grpc.stop(0)  # the port held for the front ends
            raise
        folder = Path(tempfile.mkdtemp(prefix="dstack-link-"))
        try:
            dispatch = Dispatch(self.app, self.runtime, MODEL_VERSION,
                                None if grpc is None else grpc.endpoint.servicer)
            listening = await dispatch.listen(folder / "link")
            s = self.cfg.server
            fronts = FrontEnds(s.frontends, self.config_path, sock.fileno(), folder,
                               self.frontend_cores,
                               None if grpc is None else grpc.endpoint.address)
            try:
                await fronts.start(dispatch.hello, timeout_s=120)
                if grpc is not None:
                    log.info("gRPC (KServe v2 / Triton) on %s, served by the %d front ends",
                             grpc.endpoint.address, s.frontends)
                if not stop.is_set():
                    freeze_startup_objects()
                    self.started = True
                    self.on_ready()
                    watch = loop.create_task(fronts.watch())
                    await stop.wait()
                    watch.cancel()
            finally:
                await fronts.stop(s.shutdown_grace_s)  # each drains its requests in flight
                if grpc is not None:
                    await grpc.stop(0)  # the port held for the front ends
                listening.close()
        finally:
            shutil.rmtree(folder, ignore_errors=True)
            await self.runtime.stop()


class Runnable(Protocol):
    """A server `run_until_stopped` runs (`_Serving`, `_Dispatching`)."""

    should_exit: bool
    started: bool

    def run(self, sockets: list[socket.socket]) -> None: ...


def run_until_stopped(prepare: Callable[[], tuple[Runnable, socket.socket]],
                      name: str) -> int:
    """What `dstack serve` and `dstack cluster serve` share: SIGINT and SIGTERM are caught
    from the start (before "ready" a stop is acted on when start-up gets there; after it,
    both drain), `prepare()` builds the server and its socket, and `run` serves until
    stopped. Returns the exit code: 0 after a clean shutdown ("NAME stopped" logged), 2
    with one line on stderr when serving could not start."""
    stop_signals: list[int] = []

    def remember(sig: int, _: FrameType | None) -> None:
        # Before uvicorn runs: a stop request is acted on when start-up gets there. After:
        # uvicorn re-raises the signal it shut down for, which must not kill us now.
        stop_signals.append(sig)

    def catch() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, remember)

    catch()
    server: Runnable | None = None
    try:
        server, sock = prepare()
        catch()  # again: a library may have set its own meanwhile (ray.init: SIGTERM exits 15)
        server.should_exit = bool(stop_signals)
        try:
            server.run(sockets=[sock])
        finally:
            sock.close()
    except Exception as e:  # noqa: BLE001 - any failure before "ready" is a start-up error
        if server is not None and server.started:
            raise  # not a start-up error: let it show its traceback
        log.debug("start-up failed", exc_info=True)
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    log.info("%s stopped", name)
    return 0


def listen(host: str, port: int, cfg: ServerConfig, token: str | None) -> socket.socket:
    """The listening socket for `cfg`, checked before anything slow starts: the file
    descriptor limit raised for its connection cap, the address bound (a `StartupError`
    naming it when it cannot be), a warning when it is not loopback and no token is set
    (or when a setting for front ends is set without them), and the TLS files loaded
    once."""
    raise_fd_limit(cfg.max_connections)
    try:
        sock = bind(host, port)
    except (OSError, OverflowError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else e
        raise StartupError(f"cannot listen on {host}:{port}: {why}") from None
    _warn_if_exposed(sock.getsockname()[0], token)
    if cfg.decision_timeout_ms is not None and cfg.frontends == 1:
        log.warning("server.decision_timeout_ms is for front ends (server.frontends > 1); "
                    "one process decides at the header itself, without it")
    _check_tls_files(cfg)  # before the slow imports: fail fast
    return sock


def serve(config_path: str | Path, host: str | None = None, port: int | None = None,
          grpc_port: int | None = None, allow_client_shm: bool | None = None) -> int:
    """Serve until SIGINT or SIGTERM. Returns the exit code: 0 after a clean shutdown,
    2 (with one line on stderr, a bad config file included) when serving could not start.
    `host`, `port`, `grpc_port`, `allow_client_shm`: instead of the config's
    `server.host`, `port`, `grpc_port`, `allow_client_shm`."""

    def prepare() -> tuple[Runnable, socket.socket]:
        cfg = load_config(config_path)
        if allow_client_shm is not None:
            cfg = cfg.model_copy(update={"server": cfg.server.model_copy(
                update={"allow_client_shm": allow_client_shm})})
        logging.basicConfig(level=cfg.server.log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        host_cores = available_cores()
        cfg = _with_frontends(cfg, len(host_cores))
        at = host if host is not None else cfg.server.host
        token = load_token(cfg.server)
        steady_server_heap()
        prompt_gil_handoffs(cfg.server.switch_interval_ms / 1000)
        sock = listen(at, port if port is not None else cfg.server.port, cfg.server, token)
        bound_port = sock.getsockname()[1]

        from dstack.runtime.serving import Runtime  # heavy (torch)

        runtime = Runtime(cfg)  # checks every model against the zoo
        _pin_front_end(cfg.server, runtime)  # after Runtime: its workers start on the cores before
        scheme = "https" if cfg.server.tls_certfile else "http"
        shown = f"[{at}]" if ":" in at else at
        names = ", ".join(m.name for m in cfg.models)

        def ready() -> None:
            log.info("dstack serving %s://%s:%d (policy %s, models %s); ready at "
                     "/v2/health/ready", scheme, shown, bound_port, cfg.policy.value, names)

        def grpc_of(app: FastAPI) -> GrpcPort | None:
            at_port = grpc_port if grpc_port is not None else cfg.server.grpc_port
            if not 0 <= at_port <= 65535:
                raise StartupError(f"--grpc-port {at_port}: give a port in 0..65535 (0: off)")
            if at_port == 0:
                return None
            from server.grpc_server import GrpcEndpoint

            explicit = grpc_port is not None or "grpc_port" in cfg.server.model_fields_set
            return GrpcPort(GrpcEndpoint(app.state.api, cfg.server, at, at_port, token),
                            explicit)

        if cfg.server.frontends > 1:  # the front ends check the token
            app = build_app(cfg, runtime, start_runtime=False)
            # the front ends on the cores the server's own process leaves, if it was given any
            pinned = cfg.server.cores
            rest = (tuple(c for c in host_cores if c not in pinned) or None) if pinned else None
            return _Dispatching(app, runtime, cfg, Path(config_path), rest, ready,
                                grpc_of(app)), sock
        app = build_app(cfg, runtime, auth_token=token, start_runtime=False)
        return _Serving(server_config(app, cfg.server), runtime, ready, grpc_of(app)), sock

    return run_until_stopped(prepare, "dstack")


def _with_frontends(cfg: DeployConfig, cores: int) -> DeployConfig:
    """`cfg` with `server.frontends` as the number `dstack serve` runs
    (`frontend_processes`), said once in the log when `auto` chose it."""
    n = frontend_processes(cfg, cores)
    if cfg.server.frontends == "auto":
        log.info("server.frontends auto: %s (device %s, %d cores, %d models)",
                 f"{n} front-end processes" if n > 1 else "this process serves HTTP",
                 cfg.device.value, cores, len(cfg.models))
    return cfg.model_copy(update={"server": cfg.server.model_copy(update={"frontends": n})})


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    plain = isinstance(e, StartupError | ValueError | DStackError)  # says what went wrong
    return text if plain else f"{type(e).__name__}: {text}"


def _check_tls_files(cfg: ServerConfig) -> None:
    if cfg.tls_certfile is None:
        return
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cfg.tls_certfile, cfg.tls_keyfile)
    except OSError as e:  # ssl.SSLError is one
        raise StartupError(f"cannot load server.tls_certfile / tls_keyfile: {e}") from None


def _pin_front_end(cfg: ServerConfig, runtime: Runtime) -> None:
    if cfg.cores is None:  # where each plan's workers leave it
        runtime.on_plan = _QuietCores(available_cores())
        return
    have = available_cores()
    missing = sorted(set(cfg.cores) - set(have))
    if missing:
        raise StartupError(f"server.cores: {missing} not among the cores this process may use "
                           f"({list(have)})")
    pin_threads(cfg.cores)
    log.info("the server's own process on cores %s", sorted(set(cfg.cores)))


class _QuietCores:
    """`server.cores` unset: keeps this process (and the front ends it starts, which
    inherit its cores) on the cores where it costs the plan's workers least
    (`Runtime.quiet_cores`), moving it when a re-plan moves them."""

    def __init__(self, host: tuple[int, ...]) -> None:
        self.cores = host

    def __call__(self, cores: tuple[int, ...]) -> None:
        if cores == self.cores:
            return
        pin_threads(cores)
        self.cores = cores
        log.info("the server's own process on cores %s: those the plan's workers leave free "
                 "or whose models have the longest SLO (server.cores unset)", list(cores))


def _warn_if_exposed(address: str, token: str | None) -> None:
    if token is None and not ipaddress.ip_address(address.split("%")[0]).is_loopback:
        log.warning("listening on %s without authentication: anyone who can reach it may use "
                    "it (set server.auth_token_file or DSTACK_AUTH_TOKEN)", address)
