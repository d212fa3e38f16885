"""Socket-level limits uvicorn does not have: header and body read timeouts, a cap on open
connections, and uploads that do not hold up shutdown.

uvicorn closes idle kept-alive connections (`timeout_keep_alive`), but nothing bounds a
client that connects and sends half a header, or stops in the middle of a body: each holds
a socket (and a task) for ever, and stalled uploads hold graceful shutdown for its whole
timeout. `LimitedHttpToolsProtocol` is uvicorn's httptools protocol with a timer per
connection: armed when a request's header starts, reset by every body chunk, cancelled
when the request has been read.

At the connection cap a new connection is not refused while an open one is only waiting
for a request header (just connected, part of a header sent, or kept alive between
requests): the one that has waited longest is closed to make room. Slowloris sockets then
cannot lock normal clients out for a whole header timeout. Only when every open connection
is inside a request (its body arriving, or its answer not yet sent) is the newcomer
refused with 503.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
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
    drop_bytes_per_s: float = 0.0  # ServerConfig.dropped_body_bytes_per_s; 0: no pace


def raise_fd_limit(max_connections: int, headroom: int = 256) -> int:
    """Raise this process's soft limit on open files (often 1024) to hold `max_connections`
    client sockets and `headroom` more (the listening socket, worker pipes, logs, model
    files), up to the hard limit; warn when the hard limit is lower. Without it, accept()
    fails with EMFILE below the cap and asyncio stops accepting for a second at a time.
    Returns the soft limit now (-1 where there are no such limits)."""
    try:
        import resource
    except ImportError:  # not POSIX
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + headroom
    if soft != resource.RLIM_INFINITY and soft < want:
        soft = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft != resource.RLIM_INFINITY and soft < want:
        log.warning("open files limited to %d (hard limit): fewer than server.max_connections "
                    "(%d) + %d; connections beyond it fail to be accepted (raise `ulimit -Hn`)",
                    soft, max_connections, headroom)
    return int(soft)


#: A body of this many bytes declared or more, refused before its end, is read and dropped
#: at the pace `ConnectionLimits.drop_bytes_per_s` (all connections together): a storm of
#: refused uploads then cannot take the cores the workers need for the requests the server
#: did take.
DROP_AFTER_BYTES = 4 << 20

#: The scope key of when the server's parser met a request's first byte (time.monotonic()):
#: the request's deadline counts from there, the loop's delay in starting its handler
#: (under load, tens of ms) included.
RECEIVED_AT = "dstack.received_at"


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
    # The server's connections that wait for a request header, oldest first: a new one
    # goes last, a kept-alive connection moves last when its next request starts. What
    # `connection_made` closes at the cap. (One per `with_limits` class, i.e. per server.)
    _waiting: ClassVar[OrderedDict[LimitedHttpToolsProtocol, None]]
    _drop_free_at: ClassVar[float] = 0.0  # when the drop pace allows the next byte (loop time)
    _last_cap_warning: ClassVar[float] = 0.0
    _evicted: ClassVar[int] = 0  # since the last warning (every server in the process)
    _refused: ClassVar[int] = 0

    @classmethod
    def with_limits(cls, limits: ConnectionLimits) -> type[LimitedHttpToolsProtocol]:
        return type(cls.__name__, (cls,), {"limits": limits, "_waiting": OrderedDict(),
                                           "_drop_free_at": 0.0})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._reading_body = False  # from the end of a header to the end of its body
        self._in_header = False  # from a request's first byte to the end of its header
        self._last_body_at = 0.0
        self._waiting_since = 0.0
        self._big = False  # the body being read declared DROP_AFTER_BYTES or more

    # -- connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections and not self._evict_oldest():
            self._refuse()
            return
        self._wait_for_header()
        self._arm(self.limits.header_timeout_s, self._header_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._waiting.pop(self, None)
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._wait_if_idle()

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
        self.scope[RECEIVED_AT] = time.monotonic()  # type: ignore[literal-required]
        self._in_header = True
        if self._timer is None:  # a kept-alive connection's next request (the first is armed)
            self._arm(self.limits.header_timeout_s, self._header_timed_out)
            if self in self._waiting:  # idle until now: its header's wait starts now
                self._wait_for_header()

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        if (self._big and self._reading_body and cycle is not None and cycle.response_complete
                and self.limits.drop_bytes_per_s > 0):
            self._pace_drop(len(data))  # answered already: the rest of the body is dropped
        super().data_received(data)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        length = next((v for k, v in self.scope["headers"] if k == b"content-length"), b"")
        self._big = length.isdigit() and int(length) >= DROP_AFTER_BYTES
        self._in_header = False
        self._waiting.pop(self, None)
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
        self._wait_if_idle()

    # -- dropped bodies

    def _pace_drop(self, n: int) -> None:
        now = self.loop.time()
        cls = type(self)
        free_at = max(now, cls._drop_free_at) + n / self.limits.drop_bytes_per_s
        cls._drop_free_at = free_at
        if free_at - now > 0.002:
            self.flow.pause_reading()  # the body timeout counts this as the server's delay
            self.loop.call_later(free_at - now, self._resume_drop)

    def _resume_drop(self) -> None:
        if not self.transport.is_closing():
            self._last_body_at = self.loop.time()
            self.flow.resume_reading()

    # -- the connection cap

    def _wait_for_header(self) -> None:
        self._waiting.pop(self, None)
        self._waiting[self] = None
        self._waiting_since = self.loop.time()

    def _wait_if_idle(self) -> None:
        """Once a request has been read and answered (whichever ends last) and no
        pipelined one is queued, the connection waits for its next header: evictable."""
        cycle = self.cycle
        if (self._reading_body or self.pipeline or self.transport.is_closing()
                or (cycle is not None and not cycle.response_complete)):
            return
        if self not in self._waiting:
            self._wait_for_header()

    def _evict_oldest(self) -> bool:
        """Close the connection that has waited longest for a request header; False if
        every open connection is inside a request. O(1) but for ones already closing."""
        waiting = self._waiting
        while waiting:
            victim, _ = waiting.popitem(last=False)
            if victim.transport.is_closing():
                continue
            victim._evict()
            LimitedHttpToolsProtocol._evicted += 1
            self._warn_at_cap()
            return True
        return False

    def _evict(self) -> None:
        """Closed to make room: a client that has sent part of a header gets a JSON 503
        (it may read it); an idle one (nothing of a request sent) a bare close, as for
        uvicorn's keep-alive timeout (an HTTP client opens a new connection)."""
        self._disarm()
        if self._in_header:
            waited = self.loop.time() - self._waiting_since
            self.transport.write(error_response(
                503, f"too many open connections (limit {self.limits.max_connections}): "
                     f"closed to make room, no complete request header after {waited:.1f} s; "
                     "retry later", {"retry-after": str(self.limits.retry_after_s)}))
        self.transport.close()

    def _refuse(self) -> None:
        cap = self.limits.max_connections
        LimitedHttpToolsProtocol._refused += 1
        self._warn_at_cap()
        self.transport.write(error_response(
            503, f"too many open connections (limit {cap}); retry later",
            {"retry-after": str(self.limits.retry_after_s)}))
        self.transport.close()

    def _warn_at_cap(self) -> None:
        now = time.monotonic()
        if now - LimitedHttpToolsProtocol._last_cap_warning > 10:
            LimitedHttpToolsProtocol._last_cap_warning = now
            log.warning("at the connection cap (server.max_connections %d): since the last "
                        "warning, %d connections waiting for a request header closed to make "
                        "room, %d new ones refused (none was waiting for a header)",
                        self.limits.max_connections, LimitedHttpToolsProtocol._evicted,
                        LimitedHttpToolsProtocol._refused)
            LimitedHttpToolsProtocol._evicted = LimitedHttpToolsProtocol._refused = 0

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
        self._waiting.pop(self, None)
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
