"""Request bodies at the ASGI level: a size limit (413) and a memory budget shared by all
requests (503 + Retry-After), both decided before the body is read when Content-Length
says enough; and refusals that let the client finish sending, so that it reads them.

A client that is answered before it has sent its whole body (urllib, requests and
tritonclient send the body first and read after) sees a connection reset when the server
closes on unread bytes. `refuse` therefore answers at once and leaves the rest of the body
to the connection (`server.connection`), which drops it as it comes, in the kernel where
its length is declared, and then keeps the connection, or closes it if the client asked to.
"""

from __future__ import annotations

import asyncio
import math
import zlib
from collections.abc import Callable, Iterable

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dstack.common.errors import DStackError
from server.memory import TRIM_AFTER_BYTES, BodyBuffer, release_freed_memory


class BodyBudget:
    """Bytes of request bodies held in memory at once, across all requests (one event
    loop: no lock needed)."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.used_bytes = 0

    def take(self, n: int) -> bool:
        if self.used_bytes + n > self.limit_bytes:
            return False
        self.used_bytes += n
        return True

    def give(self, n: int) -> None:
        self.used_bytes -= n


def header(scope: Scope, name: bytes) -> bytes | None:
    """The value of the request header `name` (lower case), or None."""
    for k, v in scope["headers"]:
        if k == name:
            return v  # type: ignore[no-any-return]
    return None


def error_json(message: str, reason: str | None = None) -> bytes:
    """The body of an error answer: `{"error": message}`, and `"reason"` when given
    (orjson: under overload, where every refusal is answered with one, json.dumps took a
    twentieth of the server's CPU per refusal)."""
    doc = {"error": message} if reason is None else {"error": message, "reason": reason}
    return orjson.dumps(doc)


def retry_after(e: DStackError) -> list[tuple[bytes, bytes]]:
    """The `Retry-After` header `e` asks for (whole seconds, at least 1), or none."""
    return [] if e.retry_after_s is None else [
        (b"retry-after", str(max(1, math.ceil(e.retry_after_s))).encode())]


async def refuse(scope: Scope, send: Send, status: int, message: str, *,
                 headers: Iterable[tuple[bytes, bytes]] = (), reason: str | None = None
                 ) -> None:
    """Answer `{"error": message}` (and `"reason"`, when given) with `status`, complete at
    once: what is still coming of the request's body is the connection's to drop
    (`server.connection`: in the kernel where its length is declared, else through the
    parser), with no wake-up of this task per piece. The connection is then kept for the
    client's next request, or closed if the client asked to, or if it waits for `100
    Continue` (its body may never come)."""
    body = error_json(message, reason)
    head = [(b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()), *headers]
    if closes_after(scope) or header(scope, b"expect") is not None:
        head.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def closes_after(scope: Scope) -> bool:
    """Whether the server closes the connection after answering this request (the client
    asked for it, or HTTP/1.0 without keep-alive)."""
    conn = (header(scope, b"connection") or b"").lower()
    if scope.get("http_version") == "1.0":
        return b"keep-alive" not in conn
    return b"close" in conn


#: zlib's window bits for a body in gzip or zlib ("deflate" in HTTP) format, told apart by
#: its header.
_GZIP_OR_ZLIB = 32 + 15
#: Bytes decompressed at a time, each counted against the limit and the budget first.
DECODE_STEP_BYTES = 1 << 20


class BodyLimits:
    """Reads each request's body before the app runs, within `max_body_bytes` and the
    shared `budget`, and hands it to the app whole; the budget is given back when the app
    has answered.

    A body sent compressed (`Content-Encoding: gzip` or `deflate`, as tritonclient's
    `request_compression_algorithm` sends it, and Triton reads it) is decompressed here,
    a step at a time in a thread, the decompressed bytes held to the same limit and budget
    (a small body that decompresses to gigabytes is refused 413 at the limit); the app gets
    it plain, its `content-encoding` gone from the headers. Another encoding: 415."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int, budget: BodyBudget,
                 retry_after_s: int = 1,
                 release: Callable[[], object] = release_freed_memory) -> None:
        self.app = app
        self.trims = _Trims(release)
        self.max_body_bytes = max_body_bytes
        self.budget = budget
        self.retry_after = (b"retry-after", str(retry_after_s).encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = header(scope, b"content-length")
        if length is None and header(scope, b"transfer-encoding") is None:
            await self.app(scope, receive, send)  # no body
            return
        declared = int(length) if length is not None and length.isdigit() else 0
        if declared > self.max_body_bytes:
            await self._too_large(scope, send, f"{declared} bytes")
            return
        if not self.budget.take(declared):  # nothing read yet: a declared body is dropped
            await self._over_budget(scope, send)
            return
        taken = declared
        big = declared >= TRIM_AFTER_BYTES
        self.trims.big_in_flight += big
        try:
            pieces = BodyBuffer(declared)  # one `bytes` of the declared size, filled in place
            total = 0
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return  # nobody left to answer
                chunk = msg.get("body", b"")
                total += len(chunk)
                more = msg.get("more_body", False)
                if total > self.max_body_bytes:
                    await self._too_large(scope, send, f"more than {self.max_body_bytes} bytes")
                    return
                if total > taken:  # chunked (or longer than declared): count as it comes
                    if not self.budget.take(total - taken):
                        await self._over_budget(scope, send)
                        return
                    taken = total
                pieces.write(chunk)
                if not more:
                    break
            body = pieces.result()
            del pieces
            encoding = header(scope, b"content-encoding")
            if encoding is not None and encoding.strip().lower() != b"identity":
                decoded = await self._decoded(scope, send, encoding, body)
                if decoded is None:
                    return  # refused (answered)
                body, plain = decoded
                taken += plain
            await self.app(scope, _replay(body, receive), send)
        finally:
            self.budget.give(taken)
            self.trims.big_in_flight -= big
            if taken >= TRIM_AFTER_BYTES:
                self.trims.request()

    async def _decoded(self, scope: Scope, send: Send, encoding: bytes,
                       body: bytes) -> tuple[bytes, int] | None:
        """`body` decompressed, and the budget taken for it; None when it was refused
        (answered: 415, 400, 413 or 503)."""
        name = encoding.strip().lower().decode("latin-1")
        if name not in ("gzip", "x-gzip", "deflate"):
            await refuse(scope, send, 415, f"Content-Encoding {name!r} is not supported: send "
                                           f"the body as it is, or gzip or deflate")
            return None
        d = zlib.decompressobj(_GZIP_OR_ZLIB)
        pieces: list[bytes] = []
        taken, data, ok = 0, body, False
        try:
            while not d.eof:
                piece = await asyncio.to_thread(d.decompress, data, DECODE_STEP_BYTES)
                data = d.unconsumed_tail
                if not piece and not data:
                    break  # the body is spent before its stream ends
                if taken + len(piece) > self.max_body_bytes:
                    await self._too_large(scope, send, f"more than {self.max_body_bytes} "
                                                       f"bytes once decompressed ({name})")
                    return None
                if not self.budget.take(len(piece)):
                    await self._over_budget(scope, send)
                    return None
                taken += len(piece)
                pieces.append(piece)
            if not d.eof or d.unused_data:
                await refuse(scope, send, 400, f"request body ({name}) does not end where its "
                                               f"compressed stream does")
                return None
            ok = True
        except zlib.error as e:
            await refuse(scope, send, 400, f"request body is not valid {name}: {e}")
            return None
        finally:
            if not ok:
                self.budget.give(taken)  # refused: given back now
        scope["headers"] = [(k, v) for k, v in scope["headers"]
                            if k not in (b"content-encoding", b"content-length")]
        scope["headers"].append((b"content-length", str(taken).encode()))
        return b"".join(pieces), taken

    async def _too_large(self, scope: Scope, send: Send, size: str) -> None:
        await refuse(scope, send, 413,
                     f"request body of {size} exceeds the limit of {self.max_body_bytes} bytes")

    async def _over_budget(self, scope: Scope, send: Send) -> None:
        b = self.budget
        await refuse(scope, send, 503,
                     f"server busy: request bodies in flight use {b.used_bytes} of "
                     f"{b.limit_bytes} bytes (server.body_budget_bytes); retry later",
                     headers=[self.retry_after])


class _Trims:
    """Runs `release` (server.memory) in a thread after big bodies are freed: on the loop's
    next turn (when the request's frames, and so its body, are gone), one at a time; a
    request while one runs makes it run once more after.

    While other big bodies are still in flight the release waits for the last of them:
    their pages would be given back only to be asked for again (the OS zeroes each one it
    gives, on the event loop's thread), and glibc's trim holds the allocator's lock while
    it runs. What is held meanwhile is bounded by the body budget."""

    def __init__(self, release: Callable[[], object]) -> None:
        self.release = release
        self.running = False
        self.again = False
        self.big_in_flight = 0  # bodies of TRIM_AFTER_BYTES or more being read or answered
        self.done = 0  # how many have run (tests)

    def request(self) -> None:
        if self.big_in_flight > 0:
            return  # the last of them asks again when it is done
        if self.running:
            self.again = True
            return
        self.running = True
        asyncio.get_running_loop().call_soon(self._start)

    def _start(self) -> None:
        self.again = False
        fut = asyncio.get_running_loop().run_in_executor(None, self.release)
        fut.add_done_callback(self._finished)

    def _finished(self, _: object) -> None:
        self.done += 1
        if self.again:
            self._start()
        else:
            self.running = False


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive() that gives `body` once, then defers to the real one (disconnects)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed
