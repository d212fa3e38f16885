"""A lean HTTP/1.1 client for the chaos benchmark's open-loop load, which shares the cores
of the server and its workers (at 1,600 requests/s of 600 KB bodies aiohttp took 0.40 of two
cores, more than the server). It sends each request as one prepared bytes object on a
kept-alive connection and parses the answer with httptools (uvicorn's C parser), with one
future per request and no task, timer or header object of its own.
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

import httptools

#: An answer: status, body, headers (names lower-case).
Answer = tuple[int, bytes, dict[str, str]]


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[tuple[Answer, bool, float]] | None = None
        self.body: list[bytes] = []
        self.headers: dict[str, str] = {}
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(ConnectionError(f"bad response: {e}"))
            assert self.transport is not None
            self.transport.close()

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        answer = (self.parser.get_status_code(), b"".join(self.body), self.headers)
        keep = self.parser.should_keep_alive()
        self.body, self.headers = [], {}
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result((answer, keep, time.perf_counter()))

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._fail(ConnectionError(f"connection lost: {exc or 'closed by the server'}"))

    def _fail(self, exc: Exception) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)


class LeanClient:
    """Requests to one `http://host:port`, on kept-alive connections reused one request at
    a time (`fresh`: a new connection for each request, closed after it)."""

    def __init__(self, base_url: str, *, fresh: bool = False) -> None:
        u = urlsplit(base_url)
        if u.scheme != "http" or u.hostname is None or u.port is None:
            raise ValueError(f"want http://host:port, got {base_url!r}")
        self.host, self.port, self.fresh = u.hostname, u.port, fresh
        self.idle: list[_Connection] = []

    def post(self, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        """The whole request, ready to send (build it once, send it many times)."""
        head = [f"POST {path} HTTP/1.1", f"host: {self.host}:{self.port}",
                f"content-length: {len(body)}", *(f"{k}: {v}" for k, v in headers.items())]
        return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body

    async def send(self, request: bytes, timeout_s: float) -> Answer:
        """Send a request made by `post` and wait for its answer; TimeoutError after
        `timeout_s` (the connection is closed), ConnectionError when it fails."""
        return (await self.send_timed(request, timeout_s))[0]

    async def send_timed(self, request: bytes, timeout_s: float) -> tuple[Answer, float]:
        """`send`, and the time.perf_counter() at which the answer's last byte was parsed
        (how long this process then took to get back to the caller is its own delay)."""
        loop = asyncio.get_running_loop()
        conn = None
        while self.idle and conn is None:
            conn = self.idle.pop()
            if conn.lost:  # closed by the server while idle (its keep-alive timeout)
                conn = None
        if conn is None:
            conn = await self._connect(loop)
        waiter: asyncio.Future[tuple[Answer, bool, float]] = loop.create_future()
        conn.waiter = waiter
        assert conn.transport is not None
        conn.transport.write(request)
        expiry = loop.call_later(timeout_s, _expire, waiter)
        try:
            answer, keep, parsed_at = await waiter
        except BaseException:
            conn.transport.close()
            raise
        finally:
            expiry.cancel()
        if keep and not self.fresh and not conn.lost:
            self.idle.append(conn)
        else:
            conn.transport.close()
        return answer, parsed_at

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> _Connection:
        _, conn = await loop.create_connection(_Connection, self.host, self.port)
        return conn

    def close(self) -> None:
        for conn in self.idle:
            if conn.transport is not None:
                conn.transport.close()
        self.idle.clear()


def _expire(waiter: asyncio.Future[tuple[Answer, bool, float]]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())
