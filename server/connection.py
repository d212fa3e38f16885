"""Socket-level limits uvicorn does not have: header and body read timeouts, a cap on open
connections, and uploads that do not hold up shutdown.

uvicorn closes idle kept-alive connections (`timeout_keep_alive`), but nothing bounds a
client that connects and sends half a header, or stops in the middle of a body: each holds
a socket (and a task) for ever, and stalled uploads hold graceful shutdown for its whole
timeout. `LimitedHttpToolsProtocol` is uvicorn's httptools protocol with a timer per
connection: armed when a request's header starts, reset by every body chunk, cancelled
when the request has been read.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("dstack.server")


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int
    retry_after_s: int = 1


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> bytes:
    """A whole HTTP/1.1 response `{"error": message}` that closes the connection."""
    body = json.dumps({"error": message}).encode()
    head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
            "content-type: application/json", f"content-length: {len(body)}",
            "connection: close", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with `limits` (use `with_limits` to set them)."""

    limits: ClassVar[ConnectionLimits]
    _last_cap_warning: ClassVar[float] = 0.0

    @classmethod
    def with_limits(cls, limits: ConnectionLimits) -> type[LimitedHttpToolsProtocol]:
        return type(cls.__name__, (cls,), {"limits": limits})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._reading_body = False  # from the end of a header to the end of its body
        self._last_body_at = 0.0

    # -- connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        cap = self.limits.max_connections
        if len(self.connections) > cap:
            now = time.monotonic()
            if now - LimitedHttpToolsProtocol._last_cap_warning > 10:
                LimitedHttpToolsProtocol._last_cap_warning = now
                log.warning("refusing connections: %d open (server.max_connections)", cap)
            self.transport.write(error_response(
                503, f"too many open connections (limit {cap}); retry later",
                {"retry-after": str(self.limits.retry_after_s)}))
            self.transport.close()
            return
        self._arm(self.limits.header_timeout_s, self._header_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        # What httptools cannot parse (a bad request line, header, Content-Length or chunk
        # framing): uvicorn answers plain text; our clients read `{"error": ...}`.
        self._disarm()
        self.transport.write(error_response(
            400, "malformed HTTP request: the request line, a header, the Content-Length "
                 "or the chunked framing could not be parsed"))
        self.transport.close()

    def shutdown(self) -> None:
        if self._reading_body:  # an upload still arriving: refuse it now, never wait for it
            self._abort(503, "server is shutting down; retry on another instance")
        else:
            super().shutdown()

    # -- parser callbacks

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._timer is None:  # a kept-alive connection's next request (the first is armed)
            self._arm(self.limits.header_timeout_s, self._header_timed_out)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._reading_body = True
        self._last_body_at = self.loop.time()
        self._arm(self.limits.body_timeout_s, self._body_timed_out)

    def on_body(self, body: bytes) -> None:
        self._last_body_at = self.loop.time()
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._reading_body = False
        self._disarm()
        super().on_message_complete()

    # -- timers

    def _arm(self, delay_s: float, callback: Any) -> None:
        self._disarm()
        self._timer = self.loop.call_later(delay_s, callback)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _header_timed_out(self) -> None:
        self._timer = None
        log.debug("closing %s: no complete request header in %g s",
                  self.client, self.limits.header_timeout_s)
        self.transport.close()

    def _body_timed_out(self) -> None:
        self._timer = None
        timeout = self.limits.body_timeout_s
        idle = self.loop.time() - self._last_body_at
        if idle < timeout or self.flow.read_paused:
            # bytes came since it was armed, or the app (not the client) is behind
            self._arm(timeout - idle if idle < timeout else timeout, self._body_timed_out)
            return
        self._abort(408, f"request body stalled: no bytes for {timeout:g} s")

    def _abort(self, status: int, message: str) -> None:
        """Answer `status` if the app has not started its answer, end the app's request
        (its receive() says disconnected, its sends are dropped) and close."""
        self._disarm()
        self._reading_body = False
        cycle = self.cycle
        if self.transport.is_closing():
            return
        if cycle is None or not cycle.response_started:
            self.transport.write(error_response(
                status, message, {"retry-after": str(self.limits.retry_after_s)}
                if status == 503 else None))
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()
