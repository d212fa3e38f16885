"""uvicorn's httptools protocol with socket-level limits uvicorn does not have: header and
body read timeouts, a cap on open connections, and uploads that do not hold up shutdown.

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

Refused bodies are dropped in the kernel. An infer request that `refuse_at_header`
(`server.early.HeaderRefusal`) refuses is answered from `on_headers_complete`, before any
task or app runs; and a request answered before its body has all come (a refusal while
the body arrives, a 503 for the body budget) is complete once its answer is. The rest of
such a body, of a declared length, is then read with `recv(MSG_TRUNC)` from a duplicate of
the socket, which discards it without copying it out of the kernel, instead of passing
through the event loop, the HTTP parser and two copies per piece; the parser then starts
afresh for the connection's next request. (Over TLS the bytes must be decrypted: they go
through the parser as before.) So that little of such a body leaves the kernel before
its header has been checked, the event loop reads a connection a header's worth at a time
while it waits for a header (`SizedReads`).

A client that sends `Expect: 100-continue` (curl does for bodies over 1 MiB) waits for the
server's go-ahead before it sends its body. Such a request is checked from its header as
any other: refused, it is answered at once with no `100 Continue`, so its body is never
sent, and the connection is closed after it (`Connection: close`; what the client sends
meanwhile, as one that does not wait, is dropped first, `_linger`). Let through, the app
reads its body, and uvicorn's `100 Continue` goes out as it starts to.

A body the app reads, of a declared length up to WHOLE_BODY_BYTES, is read from the socket
straight into the one `bytes` the app is given, and handed over in one message
(`LimitedHttpToolsProtocol._read_whole`): one copy of it out of the kernel instead of
three, and one step of the app instead of one per 256 KB.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import re
import socket
import time
import weakref
from collections import OrderedDict
from typing import Any, ClassVar

import httptools
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

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
    _Behind,
    _ClientWarnings,
    _HeadWithBody,
    _Later,
    _Pieces,
    _Whole,
    error_response,
    server_timing,
)
from server.memory import unfilled_bytes

log = logging.getLogger("dstack.server")

#: A body of this many bytes declared or more (or of no declared length: chunked), refused
#: before its end, is read and dropped at the pace `ConnectionLimits.drop_bytes_per_s` (all
#: connections together): a storm of refused uploads then cannot take the cores the
#: workers need for the requests the server did take.
DROP_AFTER_BYTES = 4 << 20

#: What `recv(MSG_TRUNC)` is given to read into: the kernel writes none of it (TCP drops
#: the bytes), so its pages are never touched and take no memory.
_SINK = memoryview(mmap.mmap(-1, 4 << 20))

#: The most a paced drop reads at once (so that the pace holds to about its own grain).
_PACED_READ_BYTES = 256 << 10

#: What a connection reads at once while it waits for a request's header: enough for any
#: usual header and a small body with it, and little of a big body the header may refuse.
HEADER_READ_BYTES = 16 << 10

#: What a connection reads at once inside a body: what uvloop reads, so that a connection
#: holds no more of a body than before the app has checked it against the body budget.
BODY_READ_BYTES = 256 << 10

#: After the 400 to a request it cannot parse, a connection reads and drops what its client
#: still sends, up to this long or until the client closes, and only then closes (nginx's
#: `lingering_close`): a close with bytes still coming makes the kernel answer them with a
#: reset, which destroys the 400 in the client's buffer before the client has read it.
LINGER_S = 2.0

#: A request's header fields `Upgrade` (`_ignore_upgrade`), and the end of a header.
_UPGRADE = re.compile(rb"\r\nupgrade[ \t]*:", re.IGNORECASE)
_HEAD_END = re.compile(rb"\r\n\r\n")

_CLIENT_WARNINGS = _ClientWarnings(logging.getLogger("uvicorn.error"))  # uvicorn's own


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with `limits` (use `with_limits` to set them)."""

    limits: ClassVar[ConnectionLimits]
    refuse_at_header: ClassVar[HeaderCheck | None] = None
    body_store: ClassVar[BodyStore | None] = None
    # The server's connections that wait for a request header, oldest first: a new one
    # goes last, a kept-alive connection moves last when its next request starts. What
    # `connection_made` closes at the cap. (One per `with_limits` class, i.e. per server.)
    _waiting: ClassVar[OrderedDict[LimitedHttpToolsProtocol, None]]
    _drop_free_at: ClassVar[float] = 0.0  # when the drop pace allows the next byte (loop time)
    _last_cap_warning: ClassVar[float] = 0.0
    _evicted: ClassVar[int] = 0  # since the last warning (every server in the process)
    _refused: ClassVar[int] = 0

    @classmethod
    def with_limits(cls, limits: ConnectionLimits, refuse_at_header: HeaderCheck | None = None,
                    body_store: BodyStore | None = None) -> type[SizedReads]:
        """The protocol class for uvicorn's `http` setting: this protocol under `limits`,
        behind `SizedReads` (one of each per server)."""
        limited = type(cls.__name__, (cls,), {
            "limits": limits, "_waiting": OrderedDict(), "_drop_free_at": 0.0,
            "refuse_at_header": staticmethod(refuse_at_header) if refuse_at_header else None,
            "body_store": staticmethod(body_store) if body_store else None})
        return type(SizedReads.__name__, (SizedReads,),
                    {"inner": limited, "_buffer": memoryview(bytearray(BODY_READ_BYTES))})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.logger = _CLIENT_WARNINGS  # type: ignore[assignment]
        self._timer: asyncio.TimerHandle | None = None
        self._lingering = False  # answered 400 unparseable: what comes is dropped (LINGER_S)
        self._reading_body = False  # from the end of a header to the end of its body
        self._in_header = False  # from a request's first byte to the end of its header
        self._last_body_at = 0.0
        self._waiting_since = 0.0
        self._big = False  # the body being read declared DROP_AFTER_BYTES or more, or none
        self._body_left = -1  # of the body being read, bytes declared and not yet seen
        self._answered_here = False  # the request being read was answered from its header
        # ... and the connection closes once its body has been dropped (the client asked to
        # close, or the app's answer before the body's end did: `_close_answered`)
        self._close_after = False
        self._sink: socket.socket | None = None  # while the rest of a body is dropped
        self._sink_watched = False  # the loop calls _drop_some when the sink has bytes
        self._dup: socket.socket | None = None  # the sink, kept for the connection's life
        self._whole: _Whole | None = None  # the body being read straight into its bytes
        self._later: _Later | None = None  # the request whose check answers LATER, meanwhile
        # The requests being answered are the connection's last: it closes after them (the
        # client closed its sending side, or pipelined a request behind a LATER one)...
        self._last = False
        self._eof = False  # ... the client has closed its sending side
        # what came after them was refused (it did not parse: 400; its header too big: 431):
        # that answer follows them
        self._bad_next: tuple[int, str] | None = None
        self._header_seen = 0  # bytes read since the request being read began, about
        self._send_stall: asyncio.TimerHandle | None = None  # while answers wait for the client

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
        if self._send_stall is not None:
            self._send_stall.cancel()
            self._send_stall = None
        self._whole = None
        self._stop_sink()
        dup, self._dup = self._dup, None
        if dup is not None:
            dup.close()
        self._waiting.pop(self, None)
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        if self._lingering:  # closed after its answer (`_close_answered`)
            self.server_state.total_requests += 1
            return
        cycle = self.cycle
        # The request being read was answered before its body has all come (else the
        # answer is to one before it, pipelined, and the body being read is another's).
        if self._reading_body and cycle is not None and cycle.response_complete:
            if self._whole is not None:
                self._whole.asked = True  # read the rest to drop it (over TLS)
            if (self._body_left > 0 and self._sink_ok() and not self.transport.is_closing()
                    and self._drop_in_kernel()):  # the rest is dropped in the kernel
                self.server_state.total_requests += 1  # as uvicorn counts it
                return
        super().on_response_complete()
        self._wait_if_idle()

    def _close_answered(self) -> None:
        """The close uvicorn makes after an answer with `Connection: close` (the client asked
        for it, or the app did). An answer complete while its request's body is still
        coming (a refusal: `server.limits.refuse`) closes once the rest has been dropped
        (`on_response_complete`, then `_body_done`, which lingers): a close with bytes still
        coming makes the kernel answer them with a reset, and a client still sending its
        body (urllib; a 300 MB upload refused 413) then sees the reset instead of the
        answer. A body the client waits to be asked for (`Expect: 100-continue`) and never
        was is not coming: the connection lingers at once."""
        cycle = self.cycle
        if (not self._reading_body or cycle is None or not cycle.response_complete
                or self.transport.is_closing()):
            self.transport.close()
        elif self.expect_100_continue and not cycle.transport.continued:  # type: ignore[attr-defined]
            self._close_softly()
        else:
            self._close_after = True

    def send_400_response(self, msg: str) -> None:
        # What httptools cannot parse (a bad request line, header, Content-Length or chunk
        # framing): uvicorn answers plain text; our clients read `{"error": ...}`. Bytes that
        # come after a whole request still being answered get their 400 after its answer
        # (uvicorn wrote it at once, where the client read it as that request's answer, which
        # was then lost).
        self._refuse_unread(400, MALFORMED)

    def _refuse_unread(self, status: int, message: str) -> None:
        """Answer a request that cannot be read, and close the connection after lingering.
        After a whole request still being answered, this answer waits for that one's."""
        self._in_header = False
        self._disarm()
        if self._owes_earlier():
            self._bad_next = (status, message)
            self._waiting.pop(self, None)
            return
        self.transport.write(error_response(status, message))
        self._drop_unread()
        self._linger()

    def _linger(self) -> None:
        """Close once the client has closed too, or LINGER_S from now, dropping what it
        sends meanwhile; after an end of file (where the transport has one), so that a
        client reading to the end reads the answer and stops. Evictable meanwhile, as
        a connection waiting for a header, with a bare close."""
        if self._eof:  # the client sends nothing more: nothing to wait for
            self.transport.close()
            return
        self._lingering = True
        cycle = self.cycle  # a request before it, still being answered: it cannot be now
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
        self._in_header = self._reading_body = False
        self._whole = None
        self._stop_sink()
        self._wait_for_header()
        if self.flow.read_paused:
            self.flow.resume_reading()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._arm(LINGER_S, self.transport.close)

    def _close_softly(self) -> None:
        """Close after an answer: lingering (`_linger`) where an end of file can go first,
        at once over TLS."""
        if self.transport.can_write_eof():
            self._linger()
        else:
            self.transport.close()

    def shutdown(self) -> None:
        if self._reading_body:  # an upload still arriving: refuse it now, never wait for it
            self._abort(503, "server is shutting down; retry on another instance")
        else:
            super().shutdown()

    def read_size(self) -> int:
        """How many bytes to read next (`SizedReads`): BODY_READ_BYTES inside a body,
        HEADER_READ_BYTES otherwise, so that a body refused from its header stays in the
        kernel to be dropped."""
        return BODY_READ_BYTES if self._reading_body or self._lingering else HEADER_READ_BYTES

    # -- parser callbacks

    def on_message_begin(self) -> None:
        if self._later is not None:  # pipelined behind a request still being asked about:
            # that one is answered, then the connection closes, and the client sends this
            # one again (RFC 9112 9.3.2; clients do not pipeline POSTs: not worth a queue)
            self._last = True
            raise _Behind
        super().on_message_begin()
        self.scope[RECEIVED_AT] = time.monotonic()  # type: ignore[literal-required]
        self._in_header = True
        self._header_seen = 0
        if self._timer is None:  # a kept-alive connection's next request (the first is armed)
            self._arm(self.limits.header_timeout_s, self._header_timed_out)
            if self in self._waiting:  # idle until now: its header's wait starts now
                self._wait_for_header()

    def data_received(self, data: bytes) -> None:
        if self._lingering or self._last or self._bad_next is not None:  # nothing more is served
            return
        if self.flow.write_paused:  # (reading was resumed for another reason meanwhile)
            self.flow.pause_reading()
        cycle = self.cycle
        if (self._big and self._reading_body and self.limits.drop_bytes_per_s > 0
                and (self._answered_here or (cycle is not None and cycle.response_complete))):
            self._pace_drop(len(data))  # answered already: the rest of the body is dropped
        if not self._reading_body:
            self._ignore_upgrade(data)
        self._feed(data)
        if self._in_header:  # the header goes on past this read
            self._header_seen += len(data)
            if self._header_seen > self.limits.max_header_bytes:
                self.logger.warning("Request header too large.")
                self._refuse_unread(431, (
                    f"request header over {self.limits.max_header_bytes} bytes (the "
                    f"server's max_header_bytes)"))
                return
        if (self._answered_here and self._body_left > 0 and self._sink_ok()
                and not self.transport.is_closing()):
            self._drop_in_kernel()  # answered from its header, and more of its body to come

    def pause_writing(self) -> None:
        """The client takes its answers more slowly than they come: read no more of its
        requests until it catches up (`resume_writing`), and disconnect it if it takes
        nothing for `send_timeout_s`. uvicorn's answers wait for the drain; those this
        connection writes itself (refusals from the header) did not, and a client
        pipelining small requests without reading its answers made the server hold them
        all (1,000,000 refused: the server's RSS from 71 to 497 MB). The keep-alive
        timeout is off meanwhile: such a connection is not idle."""
        super().pause_writing()
        self.flow.pause_reading()
        self._unset_keepalive_if_required()
        if self._send_stall is None:
            self._send_stall = self.loop.call_later(self.limits.send_timeout_s,
                                                    self._send_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._send_stall is not None:
            self._send_stall.cancel()
            self._send_stall = None
        # unless a check answers LATER, a body is dropped in the kernel, or a pipelined
        # request waits: each resumes reading itself when it is done
        if self._later is None and self._sink is None and not self.pipeline:
            self.flow.resume_reading()
        cycle = self.cycle
        if not (self._in_header or self._reading_body
                or (cycle is not None and not cycle.response_complete)):
            self._keep_alive()  # between requests

    def _send_timed_out(self) -> None:
        self._send_stall = None
        self.logger.warning("A client took none of its answers for %g s: disconnected.",
                            self.limits.send_timeout_s)
        self.transport.abort()

    def _ignore_upgrade(self, data: bytes | memoryview) -> None:
        """The server upgrades to nothing (no WebSocket, no h2c), so it ignores a request's
        `Upgrade` header, as RFC 9110 7.8 lets it: the field's name is altered in the read
        buffer before the parser sees it. Else httptools takes what follows the header for
        the new protocol, and the request's body was lost: Java's HttpClient (under Spring's
        RestClient) sends `Upgrade: h2c` with its requests over http://, and such JSON
        POSTs were answered 400 "malformed JSON" (uvicorn issue 2722). Only the header in
        this read is looked at (in the rare header split across reads just there, an
        Upgrade is left as it was)."""
        end = _HEAD_END.search(data)
        for m in _UPGRADE.finditer(data, 0, end.end() if end else len(data)):
            if isinstance(data, memoryview) and not data.readonly:
                data[m.start() + 2] = 0x78  # `xpgrade`: a field no one reads

    def _feed(self, data: bytes) -> None:
        """uvicorn's `data_received`, but for a request pipelined behind a LATER one, which
        stops the parser (`_Behind`) and is not one the client got wrong."""
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError as e:
            if not isinstance(e.__context__, _Behind):
                self.logger.warning("Invalid HTTP request received.")
                self.send_400_response("")

    def eof_received(self) -> bool | None:
        """The client has closed its sending side (`shutdown(SHUT_WR)`, `nc -N`): it sends
        nothing more, and reads the answers to what it sent (RFC 9112 9.6). What it sent
        whole is answered, then the connection closes. (uvicorn closed at once, and such a
        client got no answer.) A request cut short cannot be answered: closed, as before."""
        self._eof = True
        if self._lingering or not self._owes_earlier():
            return None  # the transport closes
        self._last = True
        return True

    def _owes_earlier(self) -> bool:
        """An answer is owed to a request that came whole before what is being read now
        (nothing, or part of a header)."""
        if self._later is not None:
            return self._later.complete
        cycle = self.cycle
        return not self._reading_body and (
            bool(self.pipeline) or (cycle is not None and not cycle.response_complete))

    def on_headers_complete(self) -> None:
        length = next((v for k, v in self.headers if k == b"content-length"), b"")
        self._body_left = int(length) if length.isdigit() else -1
        self._big = self._body_left >= DROP_AFTER_BYTES or self._body_left < 0  # or chunked
        self._in_header = False
        self._waiting.pop(self, None)
        self._reading_body = True
        self._last_body_at = self.loop.time()
        self._arm(self.limits.body_timeout_s, self._body_timed_out)
        answered = self._answer_from_header()
        if answered is LATER:
            self._later = _Later()
            self.flow.pause_reading()
        elif not answered:
            self._start_cycle()
        elif self.expect_100_continue:
            self._linger()  # its body is not coming (module docstring)

    def _start_cycle(self) -> None:
        """Hand the request whose header was just parsed to the app (uvicorn's way)."""
        started = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not started and self.scope["method"] != "HEAD":  # a body follows
            cycle.transport = _HeadWithBody(  # type: ignore[assignment]
                self.transport, self.scope[RECEIVED_AT],  # type: ignore[literal-required]
                self._close_answered)
            if (not self.pipeline and not self.expect_100_continue
                    and 0 < self._body_left <= WHOLE_BODY_BYTES):
                self._read_whole(cycle)

    def answered_later(self, answer: Answer | None) -> bool:
        """The answer of a check that said LATER: written (as `_answer_from_header` writes
        one), or None: the request goes to the app with what came of its body. False when
        the connection has gone meanwhile (nothing done)."""
        later, self._later = self._later, None
        if later is None or self.transport.is_closing():
            return False
        if answer is not None:
            self._write_answer(answer)
            if self.expect_100_continue:
                self._linger()
            elif later.complete:
                self._body_done()
                self.flow.resume_reading()  # paused for the LATER: the next request
            elif not (self._body_left > 0 and self._sink_ok() and self._drop_in_kernel()):
                self.flow.resume_reading()  # dropped through the parser (TLS)
            return True
        self.scope[ASKED_AT_HEADER] = True  # type: ignore[literal-required]
        self._body_left += sum(map(len, later.body))  # as at the header; on_body counts them
        self._start_cycle()
        for piece in later.body:
            self.on_body(piece)
        if later.complete:
            self.on_message_complete()
        self.flow.resume_reading()
        return True

    def on_body(self, body: bytes) -> None:
        self._last_body_at = self.loop.time()
        self._body_left -= len(body)
        if self._later is not None:
            self._later.body.append(body)
            return
        whole = self._whole
        if whole is not None:  # what came with the header
            whole.view[whole.filled:whole.filled + len(body)] = body
            whole.filled += len(body)
        elif not self._answered_here:
            cycle = self.cycle
            if cycle is not None and type(cycle.body) is bytearray and not cycle.body:
                cycle.body = _Pieces()  # type: ignore[assignment]
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._later is not None:
            self._later.complete = True
            return
        if self._answered_here or self._close_after:  # (the latter: dropped by the parser)
            self._body_done()
            return
        whole, self._whole = self._whole, None
        cycle = self.cycle
        if whole is not None and cycle is not None and not cycle.response_complete:
            # receive() gives it as is (a `body_store`'s object: `asked` gives it)
            cycle.body = whole.body if type(whole.body) is bytes else b""  # type: ignore[assignment]
        self._reading_body = False
        self._disarm()
        super().on_message_complete()
        self._wait_if_idle()

    # -- bodies read whole

    def _read_whole(self, cycle: RequestResponseCycle) -> None:
        """Read the body of the request just parsed, of `_body_left` bytes, into one
        `bytes` made for it (`_Whole`), or into what the `body_store` gives (a front end's
        shared memory), which the app's receive() is then given in one message. uvicorn's
        way (256 KB reads copied into new `bytes`, copied again by the parser into a piece,
        each piece a message that wakes the app, which copies it into its body; reading
        paused and resumed between pieces) cost a 600 KB body two more copies of itself and
        a dozen more steps of the loop. Until the app first asks for the body (once it has
        taken the body budget for it) no more than BODY_READ_BYTES of it is read, as
        before."""
        store = self.body_store
        made = store(self._body_left, self.scope) if store else None  # type: ignore[arg-type]
        made = made or unfilled_bytes(self._body_left)
        if made is None:
            return
        self._whole = _Whole(*made)
        # A `body_store`'s object is given as it is, not as bytes (uvicorn's receive() makes
        # bytes of what it has): kept here until then.
        body = self._whole.body
        stored = [] if type(body) is bytes else [body]
        # `asked` becomes an attribute of the cycle: it holds the cycle weakly and its
        # receive unbound, so that the two make no reference cycle, which only the garbage
        # collector frees, and with it every body it held (the server's memory grew by
        # about 3 MB a second under steady load until this).
        ref = weakref.ref(cycle)
        receive = type(cycle).receive

        async def asked() -> Any:
            me = ref()
            whole = self._whole
            if whole is not None and me is self.cycle:
                whole.asked = True  # receive() resumes reading
            msg = await receive(me)
            if stored and msg["type"] == "http.request" and not msg.get("more_body"):
                msg["body"] = stored.pop()
            return msg

        cycle.receive = asked  # type: ignore[method-assign]

    def whole_buffer(self) -> memoryview | None:
        """Where the next read goes (`SizedReads`): the rest of the body being read whole,
        or None (the server's buffer, fed to the parser)."""
        whole = self._whole
        if whole is None:
            return None
        room = self._body_left if whole.asked else BODY_READ_BYTES - whole.filled
        return whole.view[whole.filled:whole.filled + max(1, min(room, self._body_left))]

    def whole_read(self, n: int) -> None:
        """`n` more bytes of the body being read whole came into `whole_buffer()`."""
        whole = self._whole
        assert whole is not None
        whole.filled += n
        self._body_left -= n
        self._last_body_at = self.loop.time()
        if self._body_left == 0:
            self.on_message_complete()
            self._new_parser()  # it never saw this body
        elif not whole.asked and whole.filled >= BODY_READ_BYTES:
            self.flow.pause_reading()  # until the app asks

    def _new_parser(self) -> None:
        """A parser for the connection's next request, as uvicorn makes one."""
        self.parser = httptools.HttpRequestParser(self)
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)

    # -- answers from the header

    def _answer_from_header(self) -> bool | object:
        """Ask `refuse_at_header` about a POST with a declared length, alone on its
        connection (no answer before it still to be sent); write its answer if it has one
        (True), or say LATER."""
        check = self.refuse_at_header
        cycle = self.cycle
        if (check is None or self._body_left < 0 or self.pipeline
                or (cycle is not None and not cycle.response_complete)
                or self.parser.get_method() != b"POST"):
            return False
        self.scope[ANSWER_LATER] = self.answered_later  # type: ignore[literal-required]
        answer = check(httptools.parse_url(self.url).path.decode("ascii", "replace"),
                       self.headers, self._body_left, self.scope)  # type: ignore[arg-type]
        if answer is LATER:
            return LATER
        if answer is None:
            self.scope[ASKED_AT_HEADER] = True  # type: ignore[literal-required]
            return False
        self._write_answer(answer)  # type: ignore[arg-type]
        return True

    def _write_answer(self, answer: Answer) -> None:
        status, headers, body = answer
        self._close_after = not self.parser.should_keep_alive() or self.expect_100_continue
        head = [STATUS_LINE[status]]
        for name, value in [*self.server_state.default_headers, *headers,
                            (b"content-length", str(len(body)).encode()),
                            (b"server-timing", server_timing(
                                self.scope[RECEIVED_AT]))]:  # type: ignore[literal-required]
            head += [name, b": ", value, b"\r\n"]
        if self._close_after:
            head.append(b"connection: close\r\n")
        self.transport.write(b"".join([*head, b"\r\n", body]))
        self._answered_here = True
        self.server_state.total_requests += 1

    def _body_done(self) -> None:
        """The body of a request answered early has all been read (and dropped). If the
        connection is to close, it lingers (`_linger`): a client that sent more than its
        Content-Length said would have the rest unread at the close, and the kernel's
        reset could destroy the answer before the client read it (0.2% of the `make
        chaos` fuzzer's requests had no answer so)."""
        self._answered_here = False
        self._reading_body = False
        self._body_left = -1
        self._disarm()
        if self._close_after:
            self._close_after = False
            self._close_softly()
            return
        self._keep_alive()
        self._wait_if_idle()

    def _keep_alive(self) -> None:
        """Arm uvicorn's keep-alive timeout for a connection between requests, unless its
        answers wait for the client to take them (`pause_writing`): that is not idle."""
        if (self.timeout_keep_alive_task is None and not self.flow.write_paused
                and not self.transport.is_closing()):
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler)

    # -- dropped bodies

    def _drop_wait(self, n: int) -> float:
        """Seconds to wait before dropping more, `n` bytes of a big body having just been
        dropped under the pace (0: go on)."""
        if not self._big or self.limits.drop_bytes_per_s <= 0:
            return 0.0
        now = self.loop.time()
        cls = type(self)
        free_at = max(now, cls._drop_free_at) + n / self.limits.drop_bytes_per_s
        cls._drop_free_at = free_at
        return free_at - now if free_at - now > 0.002 else 0.0

    def _pace_drop(self, n: int) -> None:
        wait = self._drop_wait(n)
        if wait:
            self.flow.pause_reading()  # the body timeout counts this as the server's delay
            self.loop.call_later(wait, self._resume_drop)

    def _resume_drop(self) -> None:
        """The end of a pause of `_pace_drop`. Reading stays paused if another has taken
        it over since: the next request's body dropped in the kernel (a chunked body's end
        and the next request can come in one read), or its header asked about LATER; each
        resumes reading when done. (Resumed in the middle of a drop in the kernel, the parser
        read the body too, took the next request's bytes for its rest, and answered 400.)"""
        if not self.transport.is_closing() and self._sink is None and self._later is None:
            self._last_body_at = self.loop.time()
            self.flow.resume_reading()

    def _sink_ok(self) -> bool:
        return self.scheme != "https" and self.transport.get_extra_info("socket") is not None

    def _drop_in_kernel(self) -> bool:
        """Stop the transport's reading and read the rest of the body (`_body_left`
        bytes) from a duplicate of its socket with MSG_TRUNC: the kernel discards it. What
        has already come is dropped at once; the loop watches for the rest. False (nothing
        changed) when no file descriptor is left for the duplicate."""
        sink = self._dup
        if sink is None:
            try:
                sink = self._dup = self._duplicate()
            except OSError:
                return False
        self._sink = sink
        self._whole = None  # its rest is dropped, not read
        self.flow.pause_reading()
        self._drop_some()
        return True

    def _duplicate(self) -> socket.socket:
        """A duplicate of the connection's socket, to read from beside the event loop (which
        takes no reader of its own on a transport's socket), not blocking. The one a drop
        makes is kept until the connection is lost (a dup, a socket object and a close less
        per refused body), and closed then, so that the connection's close is not held."""
        sink = socket.socket(fileno=os.dup(self.transport.get_extra_info("socket").fileno()))
        sink.setblocking(False)
        return sink

    def _drop_unread(self) -> None:
        """Drop, in the kernel, what the client has sent that is still unread (up to 16 MB),
        before a close: closing a socket with unread bytes sends a reset, which can reach
        the client before it has read the answer written just before, and destroy it.
        (Reads of a header's size leave most of a malformed request's body unread.)"""
        if not self._sink_ok():
            return
        try:
            with self._duplicate() as sink:
                flags = socket.MSG_TRUNC | socket.MSG_DONTWAIT
                for _ in range(4):
                    if sink.recv_into(_SINK, len(_SINK), flags) <= 0:
                        return
        except OSError:  # nothing more for now (EAGAIN), or no descriptor left for the dup
            return

    def _drop_some(self) -> None:
        """Drop what has come of the body, until it ends, the pace says wait, or the
        socket has no more for now (then the loop calls this again when it has)."""
        sink = self._sink
        while sink is not None:
            want = min(self._body_left, _PACED_READ_BYTES if self._big else len(_SINK))
            try:
                n = sink.recv_into(_SINK, want, socket.MSG_TRUNC)
            except (BlockingIOError, InterruptedError):
                self._watch_sink(True)
                return
            except OSError:
                n = 0
            if n == 0:  # the client closed, or its connection failed, mid-body
                self._stop_sink()
                self.transport.close()
                return
            self._body_left -= n
            self._last_body_at = self.loop.time()
            if self._body_left == 0:
                self._stop_sink()
                self._new_parser()  # the next request afresh
                self.flow.resume_reading()
                self._body_done()
                return
            wait = self._drop_wait(n)
            if wait:
                self._watch_sink(False)
                self._last_body_at += wait  # our wait: the body timeout does not count it
                self.loop.call_later(wait, self._resume_sink, sink)
                return

    def _resume_sink(self, sink: socket.socket) -> None:
        if self._sink is sink:
            self._drop_some()

    def _watch_sink(self, on: bool) -> None:
        if self._sink_watched != on and self._sink is not None:
            self._sink_watched = on
            if on:
                self.loop.add_reader(self._sink.fileno(), self._drop_some)
            else:
                self.loop.remove_reader(self._sink.fileno())

    def _stop_sink(self) -> None:
        self._watch_sink(False)
        self._sink = None

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
        if self._bad_next is not None:  # what came after the requests just answered
            status, message = self._bad_next
            self._bad_next = None
            self._refuse_unread(status, message)
        elif self._last:
            self._close_softly()
        elif self not in self._waiting:
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
        if idle < timeout or (self.flow.read_paused and self._sink is None):
            # bytes came since it was armed, or the app (not the client) is behind
            self._arm(timeout - idle if idle < timeout else timeout, self._body_timed_out)
            return
        self._abort(408, f"request body stalled: no bytes for {timeout:g} s")

    def _abort(self, status: int, message: str) -> None:
        """Answer `status` if the app has not started its answer, end the app's request
        (its receive() says disconnected, its sends are dropped) and close."""
        self._disarm()
        self._stop_sink()
        self._reading_body = False
        cycle = self.cycle
        if self.transport.is_closing():
            return
        if not self._answered_here and (cycle is None or not cycle.response_started):
            self.transport.write(error_response(
                status, message, {"retry-after": str(self.limits.retry_after_s)}
                if status == 503 else None))
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()
