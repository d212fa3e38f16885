"""The server's HTTP connections: socket-level limits uvicorn does not have (header and body
read timeouts, a cap on open connections that closes the longest-idle one first, uploads
that do not hold up shutdown), refusals answered from a request's header before any ASGI
task runs, refused bodies dropped in the kernel, and bodies read whole.

This module is the interface the rest of the server uses: `server_config` (uvicorn's
settings for an app under a `ServerConfig`), `raise_fd_limit`, `ConnectionLimits`, the ASGI
scope keys (`RECEIVED_AT`, `ASKED_AT_HEADER`, `ANSWER_LATER`), `LATER` and the
`HeaderCheck` / `BodyStore` / `Answer` types. How it is done lives behind it, in
`server.httptools_protocol` (`LimitedHttpToolsProtocol`, `SizedReads`) and
`server.connection_parts`.

Why a subclass of uvicorn's private `HttpToolsProtocol`, not a maintained server's own
limits: uvicorn 0.54 offers a keep-alive timeout and `limit_concurrency` (a 503 to every
newcomer at the cap), but no timeout on reading a header or a body, no eviction of idle
connections at the cap, no hook between a request's header and its body, and no way to
drop a refused body unread; those are what keep the server answering under slowloris and
refusal storms. The subclass is pinned with uvicorn (constraints.txt), and
`tests/unit/test_uvicorn_protocol_pin.py` fails, naming what changed, when the pinned
uvicorn no longer has what it overrides or relies on.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, ClassVar

import uvicorn
from starlette.types import ASGIApp

from dstack.common.config import ServerConfig
from server.connection_parts import (
    ANSWER_LATER,
    ASKED_AT_HEADER,
    LATER,
    MALFORMED,
    RECEIVED_AT,
    WHOLE_BODY_BYTES,
    Answer,
    BodyStore,
    ConnectionLimits,
    HeaderCheck,
    SizedReads,
    error_response,
    server_timing,
)
from server.httptools_protocol import (
    BODY_READ_BYTES,
    DROP_AFTER_BYTES,
    HEADER_READ_BYTES,
    LINGER_S,
    LimitedHttpToolsProtocol,
)

__all__ = [
    "ANSWER_LATER", "ASKED_AT_HEADER", "BODY_READ_BYTES", "DROP_AFTER_BYTES",
    "HEADER_READ_BYTES", "LATER", "LINGER_S", "MALFORMED", "RECEIVED_AT", "WHOLE_BODY_BYTES",
    "Answer", "BodyStore", "ConnectionLimits", "HeaderCheck", "LimitedHttpToolsProtocol",
    "SizedReads", "error_response", "raise_fd_limit", "server_config", "server_timing",
]

log = logging.getLogger("dstack.server")


def raise_fd_limit(max_connections: int, headroom: int = 256) -> int:
    """Raise this process's soft limit on open files (often 1024) to hold `max_connections`
    client sockets, each with the duplicate its refused bodies are dropped through
    (`LimitedHttpToolsProtocol._duplicate`), and `headroom` more (the listening socket,
    worker pipes, logs, model files), up to the hard limit; warn when the hard limit is
    lower. Without it, accept() fails with EMFILE below the cap and asyncio stops
    accepting for a second at a time. Returns the soft limit now (-1 where there are no
    such limits)."""
    try:
        import resource
    except ImportError:  # not POSIX
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 2 * max_connections + headroom
    if soft != resource.RLIM_INFINITY and soft < want:
        soft = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft != resource.RLIM_INFINITY and soft < want:
        log.warning("open files limited to %d (hard limit): fewer than 2 x "
                    "server.max_connections (%d) + %d; connections beyond it fail to be "
                    "accepted (raise `ulimit -Hn`)", soft, max_connections, headroom)
    return int(soft)



try:
    import uvloop
except ImportError:  # not on this platform: asyncio's loop, its handshakes unbounded here
    uvloop = None

if uvloop is not None:
    class HandshakeBoundLoop(uvloop.Loop):  # type: ignore[misc,name-defined]
        """uvloop's loop, with a TLS server's handshakes bounded by `handshake_timeout_s`
        (`server.header_timeout_s`, set by `server_config`). The default, 60 s in asyncio
        and uvloop alike, held a connection that never began its handshake for six times
        the header timeout, and such connections are not counted by the connection cap
        (they reach the protocol only once the handshake is done). uvicorn makes the loop
        from its `loop` setting, an import string: hence a class and a class attribute."""

        handshake_timeout_s: ClassVar[float] = 10.0

        async def create_server(self, *args: Any, **kwargs: Any) -> asyncio.Server:
            if kwargs.get("ssl") is not None and kwargs.get("ssl_handshake_timeout") is None:
                kwargs["ssl_handshake_timeout"] = self.handshake_timeout_s
            return await super().create_server(*args, **kwargs)  # type: ignore[no-any-return]


def server_config(app: ASGIApp, cfg: ServerConfig | None = None, *,
                  log_level: str | None = None, header_check: HeaderCheck | None = None,
                  body_store: BodyStore | None = None) -> uvicorn.Config:
    """uvicorn's settings for `app` under `cfg`'s limits, timeouts and TLS files; its
    connections answer refusals from the header with `header_check`, by default
    `app.state.header_refusal` (set by `server.main.build_app`), and read bodies whole
    into what `body_store` gives (else new `bytes`)."""
    cfg = cfg or ServerConfig()
    limits = ConnectionLimits(cfg.header_timeout_s, cfg.body_timeout_s, cfg.max_connections,
                              drop_bytes_per_s=cfg.dropped_body_bytes_per_s,
                              max_header_bytes=cfg.max_header_bytes,
                              send_timeout_s=cfg.send_timeout_s)
    if header_check is None:
        header_check = getattr(getattr(app, "state", None), "header_refusal", None)
    loop = "auto"
    if uvloop is not None:
        HandshakeBoundLoop.handshake_timeout_s = cfg.header_timeout_s
        loop = f"{__name__}:HandshakeBoundLoop"
    return uvicorn.Config(
        app,
        loop=loop,
        # a BufferedProtocol, which uvicorn's annotation (asyncio.Protocol) leaves out
        http=LimitedHttpToolsProtocol.with_limits(  # type: ignore[arg-type]
            limits, header_check, body_store),
        log_level=log_level or cfg.log_level,
        ws="none",  # no WebSocket routes: an upgrade request is answered as plain HTTP
        access_log=False,  # one log line per request would cost more than decoding it
        timeout_graceful_shutdown=cfg.shutdown_grace_s,  # type: ignore[arg-type]
        timeout_keep_alive=cfg.keep_alive_s,  # type: ignore[arg-type]
        ssl_certfile=cfg.tls_certfile,
        ssl_keyfile=cfg.tls_keyfile,
    )
