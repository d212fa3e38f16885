"""`dstack serve`: load the config, build the runtime, serve it over HTTP with uvicorn.

The runtime's workers start in the app's lifespan (before the first request is
accepted) and stop when uvicorn shuts down (SIGINT / SIGTERM), on every path.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Protocol

import uvicorn
from fastapi import FastAPI

from dstack.common.backend import InferenceBackend
from dstack.common.config import DeployConfig, load_config
from server.app import create_app

log = logging.getLogger("dstack.server")


class Startable(InferenceBackend, Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def build_app(cfg: DeployConfig, runtime: Startable | None = None) -> FastAPI:
    """The app over `runtime` (default: a `dstack.runtime.serving.Runtime` for `cfg`), started
    and stopped by the app's lifespan."""
    if runtime is None:
        from dstack.runtime.serving import Runtime  # heavy (torch): imported only when serving

        runtime = Runtime(cfg)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await runtime.start()
        try:
            yield
        finally:
            await runtime.stop()

    return create_app(runtime, max_body_bytes=cfg.server.max_body_bytes, lifespan=lifespan)


def bind(host: str, port: int) -> socket.socket:
    """Bind the listening socket ourselves, so that port 0 resolves to a real port
    that can be logged (and read by tests) before the workers start."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on sockets that say TCP,
    # and without it every response waits ~40 ms for the client's delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def make_server(app: FastAPI, *, log_level: str = "info") -> uvicorn.Server:
    """A uvicorn server for `app`; run it with `server.run(sockets=[bind(host, port)])`."""
    config = uvicorn.Config(
        app,
        log_level=log_level,
        access_log=False,  # one log line per request would cost more than decoding it
        timeout_graceful_shutdown=10,
    )
    return uvicorn.Server(config)


def serve(config_path: str | Path, host: str | None = None, port: int | None = None) -> int:
    """Serve until interrupted. Returns the process exit code (0 after a clean
    shutdown, 1 when start-up failed). Raises ConfigError for a bad config file."""
    cfg = load_config(config_path)
    host = host if host is not None else cfg.server.host
    port = port if port is not None else cfg.server.port
    logging.basicConfig(
        level=cfg.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = build_app(cfg)  # checks every model against the zoo before anything listens
    try:
        sock = bind(host, port)
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", host, port, e)
        return 1
    bound_port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    names = ", ".join(m.name for m in cfg.models)
    log.info(
        "dstack serving http://%s:%d (policy %s, models %s); ready at /v2/health/ready",
        shown,
        bound_port,
        cfg.policy.value,
        names,
    )
    server = make_server(app, log_level=cfg.server.log_level)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        # uvicorn shuts down gracefully (lifespan included), then re-raises Ctrl-C.
        pass
    finally:
        sock.close()
    log.info("dstack stopped")
    return 0 if server.started else 1
