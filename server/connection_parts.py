"""What the server's connections and their users share (`server.connection` is the
interface; `server.httptools_protocol` the protocol): the limits, the ASGI scope keys and
the header check's types, and the small objects a connection reads a request's body and
writes its answer with."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from server.httptools_protocol import LimitedHttpToolsProtocol


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int
    retry_after_s: int = 1
    drop_bytes_per_s: float = 0.0  # ServerConfig.dropped_body_bytes_per_s; 0: no pace
    max_header_bytes: int = 64 << 10  # ServerConfig.max_header_bytes
    send_timeout_s: float = 30.0  # ServerConfig.send_timeout_s



#: The scope key of when the server's parser met a request's first byte (time.monotonic()):
#: the request's deadline counts from there, the loop's delay in starting its handler
#: (under load, tens of ms) included.
RECEIVED_AT = "dstack.received_at"

#: The scope key set when `refuse_at_header` was asked about a request and left it to the
#: app: the app's own check from the header (`server.early.EarlyRefusal`) is not asked again.
ASKED_AT_HEADER = "dstack.asked_at_header"

#: uvicorn logs a WARNING for each request it cannot parse and each upgrade it does not
#: serve, which a client can send by the thousand: at most one in this many seconds here,
#: with the count of those left out.
CLIENT_WARNING_EVERY_S = 10.0

#: A body declared up to this size is read, once the app asks for it, from the socket
#: straight into the one `bytes` the app is given (`_Whole`), and given in one message.
WHOLE_BODY_BYTES = 1 << 20

#: `refuse_at_header(path, headers, content_length, scope)`: the status, headers and body
#: to answer a request with from its header alone, or None to hand it to the app (with
#: what it noted in the request's ASGI `scope`), or LATER.
Answer = tuple[int, list[tuple[bytes, bytes]], bytes]
HeaderCheck = Callable[[str, list[tuple[bytes, bytes]], int, dict[str, Any]],
                       "Answer | None | object"]

#: Where a body read whole goes instead of new `bytes` (`server_config`'s `body_store`):
#: given its size and the request's scope, the object the app is given as the body and a
#: writable view of its bytes, or None (new bytes).
BodyStore = Callable[[int, dict[str, Any]], "tuple[Any, memoryview] | None"]

#: What a `HeaderCheck` returns when the answer comes later (asked of another process,
#: `server.frontends`): it then calls `scope[ANSWER_LATER](answer)`, with the answer or
#: None as it would have returned. Meanwhile the connection reads nothing more and keeps
#: what came of the body with the header.
LATER = object()

#: The scope key of a connection's `answered_later` (set before its check is asked).
ANSWER_LATER = "dstack.answer_later"

MALFORMED = ("malformed HTTP request: the request line, a header, the Content-Length or the "
             "chunked framing could not be parsed")


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> bytes:
    """A whole HTTP/1.1 response `{"error": message}` that closes the connection."""
    body = json.dumps({"error": message}).encode()
    head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
            "content-type: application/json", f"content-length: {len(body)}",
            "connection: close", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class _Pieces:
    """A request body's pieces as uvicorn's cycle holds them until the app reads them (its
    `body`). uvicorn keeps a bytearray, extended by each piece and copied out whole by
    `receive()`: two copies of every byte of every body. Here `+=` keeps the piece, and
    `bytes()` gives it back as it is when it is the only one (joined, one copy, when more
    came meanwhile)."""

    __slots__ = ("_pieces", "_size")

    def __init__(self) -> None:
        self._pieces: list[bytes] = []
        self._size = 0

    def __iadd__(self, piece: bytes) -> _Pieces:
        self._pieces.append(piece)
        self._size += len(piece)
        return self

    def __len__(self) -> int:
        return self._size

    def __bytes__(self) -> bytes:
        pieces = self._pieces
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)


class _Behind(Exception):
    """Raised in the parser's callback to stop it at a request pipelined behind one whose
    check answers LATER (`LimitedHttpToolsProtocol.on_message_begin`)."""


class _Later:
    """What came of a request's body while its header check answers LATER."""

    __slots__ = ("body", "complete")

    def __init__(self) -> None:
        self.body: list[bytes] = []
        self.complete = False  # the whole body came with the header


class _Whole:
    """A body being read into the `bytes` it will be given as (`view` writes it)."""

    __slots__ = ("body", "view", "filled", "asked")

    def __init__(self, body: bytes, view: memoryview) -> None:
        self.body = body
        self.view = view
        self.filled = 0
        self.asked = False  # the app has asked for it


def server_timing(received_at: float) -> bytes:
    """The `Server-Timing` header's value (W3C Server Timing, the `total` metric): the ms
    from the request's first byte (RECEIVED_AT) to its answer being written, on the
    server's clock. What a client measures beyond it was spent outside the server's
    handling: before the server read the first byte, on the way back, or in the client."""
    return b"total;dur=%.2f" % (1000 * (time.monotonic() - received_at))


class _HeadWithBody:
    """The transport as a request's cycle sees it: uvicorn writes an answer's header and
    its body in two writes, each a send to the socket; the header is held here and sent
    with the body's first write (or when the cycle closes the connection), with
    `Server-Timing` added as it is held. Not for an answer to HEAD, which has no body to
    write. The cycle's close of the connection goes to `close` (the connection's way).
    `continued`: a `100 Continue` went out (the client was asked for its body)."""

    __slots__ = ("_transport", "_head", "_fresh", "_received_at", "_close", "continued")

    def __init__(self, transport: asyncio.Transport, received_at: float,
                 close: Callable[[], None]) -> None:
        self._transport = transport
        self._head: bytes | None = None
        self._fresh = True  # nothing of the answer written yet
        self._received_at = received_at
        self._close = close
        self.continued = False

    def write(self, data: bytes) -> None:
        if self._fresh:
            if data.startswith(b"HTTP/1.1 100 "):  # `100 Continue`: sent as it is
                self.continued = True
            else:  # the head, ending in an empty line
                self._fresh = False
                self._head = b"%sserver-timing: %s\r\n\r\n" % (
                    data[:-2], server_timing(self._received_at))
                return
        head, self._head = self._head, None
        self._transport.write(data if head is None else head + data)

    def close(self) -> None:
        if self._head is not None:
            self._transport.write(self._head)
            self._head = None
        self._close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()


class _ClientWarnings:
    """uvicorn's connection logger, its warnings rate-limited (`CLIENT_WARNING_EVERY_S`):
    every one of them is about what a client sent. All else goes through as it is."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._last = -CLIENT_WARNING_EVERY_S
        self._left_out = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._logger, name)

    def warning(self, msg: str, *args: Any, **kwargs: Any) -> None:
        now = time.monotonic()
        if now - self._last < CLIENT_WARNING_EVERY_S:
            self._left_out += 1
            return
        if self._left_out:
            msg = (f"{msg} (and {self._left_out} more such warnings about clients' requests "
                   f"in the last {now - self._last:.0f} s)")
        self._last, self._left_out = now, 0
        self._logger.warning(msg, *args, **kwargs)


_CLIENT_WARNINGS = _ClientWarnings(logging.getLogger("uvicorn.error"))  # uvicorn's own


class SizedReads(asyncio.BufferedProtocol):
    """What the event loop reads a connection's bytes with, for `inner` (a
    `LimitedHttpToolsProtocol`), which does everything else.

    uvloop reads an `asyncio.Protocol` 256 KB at a time into a buffer of its own and copies
    each read into a new bytes object. So a 600 KB body refused from its header had 256 KB
    of it copied out of the kernel, copied again, and copied once more by the HTTP parser
    into a body piece, before the rest was dropped in the kernel; at 5,000 refusals a
    second that was a quarter of the server's CPU. Here the loop reads into one buffer per
    server, of the size `inner.read_size()` asks for (HEADER_READ_BYTES while a header is
    awaited), and the parser is fed a view of it, not a copy: it copies out what it keeps
    (URL, headers, body pieces), and nothing holds the view after `data_received`
    returns, so the next read may reuse the buffer. A body read whole (up to
    WHOLE_BODY_BYTES) goes from the kernel straight into its own `bytes`
    (`inner.whole_buffer()`), past the parser.
    """

    __slots__ = ("_protocol",)
    inner: ClassVar[type[LimitedHttpToolsProtocol]]
    _buffer: ClassVar[memoryview]  # the server's; one read at a time on its loop

    def __init__(self, **kwargs: Any) -> None:
        self._protocol = self.inner(**kwargs)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._protocol.connection_made(transport)  # type: ignore[arg-type]

    def get_buffer(self, sizehint: int) -> memoryview:
        whole = self._protocol.whole_buffer()
        return self._buffer[:self._protocol.read_size()] if whole is None else whole

    def buffer_updated(self, nbytes: int) -> None:
        if self._protocol._whole is not None:  # get_buffer gave its whole_buffer()
            self._protocol.whole_read(nbytes)
        else:
            self._protocol.data_received(self._buffer[:nbytes])  # type: ignore[arg-type]

    def eof_received(self) -> bool | None:
        return self._protocol.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._protocol.connection_lost(exc)

    def pause_writing(self) -> None:
        self._protocol.pause_writing()

    def resume_writing(self) -> None:
        self._protocol.resume_writing()
