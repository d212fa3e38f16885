"""How the server's connection reads requests and writes answers (`server.connection`), on
a real uvicorn with the server's own protocol over a fake backend. Bodies are read from the
socket straight into the `bytes` the app is given (`WHOLE_BODY_BYTES`): whole and byte for
byte, the connection's next requests parsed from where each body ends, and no more of a
body read than before until the app asks for it. An answer's header is written with its
body: `100 Continue` still goes ahead of the body, HEAD and closing answers come whole."""

from __future__ import annotations

import asyncio
import gc
import json
import socket
from typing import Any

import pytest

from server import connection
from tests.integration.test_early_refusal import BODY, VALID, _head, _responses, _serving

XS = [0.5, -1.25, 3.0]


def _padded(pad: int) -> bytes:
    """A JSON infer request of `double` padded with spaces to about `pad` bytes."""
    doc = json.dumps({"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32",
                                  "data": XS}]}).encode()
    return doc.replace(b'"data"', b" " * pad + b'"data"')


def _doubled(answer: bytes) -> list[float]:
    return next(o for o in json.loads(answer)["outputs"] if o["name"] == "y")["data"]


def _recording(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    """Each read into a body being read whole, as (bytes of it read by then, whether the
    app had asked for it)."""
    reads: list[tuple[int, bool]] = []
    read = connection.LimitedHttpToolsProtocol.whole_read

    def recorded(self: connection.LimitedHttpToolsProtocol, n: int) -> None:
        whole = self._whole
        assert whole is not None
        reads.append((whole.filled + n, whole.asked))
        read(self, n)

    monkeypatch.setattr(connection.LimitedHttpToolsProtocol, "whole_read", recorded)
    return reads


def test_each_body_ends_where_it_says_and_the_next_request_follows_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On one kept-alive connection: a 600 KB body whose last bytes come in one write with
    the next request's header and body, answered in order; then three requests written
    at once (pipelined: the later two wait for the first's answer), all answered whole;
    then one more. Each body is read to its declared end and no further."""
    reads = _recording(monkeypatch)
    big = _padded(BODY)
    with _serving() as (addr, _), socket.create_connection(addr, timeout=10) as s:
        for _ in range(3):
            s.sendall(_head(len(big)) + big[:-1000])
            s.sendall(big[-1000:] + _head(len(VALID)) + VALID)
            answers = _responses(s, 2)
            assert [a[0] for a in answers] == [200, 200]
            assert _doubled(answers[0][2]) == [2 * x for x in XS]
            assert _doubled(answers[1][2]) == [2, 4, 6]
        s.sendall(_head(len(big)) + big + _head(len(VALID)) + VALID + _head(len(big)) + big)
        answers = _responses(s, 3)
        assert [a[0] for a in answers] == [200, 200, 200]
        assert [_doubled(a[2]) for a in answers] == [[2 * x for x in XS], [2, 4, 6],
                                                      [2 * x for x in XS]]
        s.sendall(_head(len(VALID)) + VALID)
        assert _responses(s, 1)[0][0] == 200
    assert reads, "no body was read whole"
    assert max(filled for filled, _ in reads) == len(big)


def test_no_more_of_a_body_is_read_than_one_read_until_the_app_asks_for_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A 900 KB body sent at once to an app that takes 0.3 s to ask for it (a loop busy
    with others): before it asks, no more than one body read (BODY_READ_BYTES) of it has
    left the kernel, as when uvicorn read it piece by piece; then all of it is read and
    the app gets it whole."""
    from server.limits import BodyLimits

    reads = _recording(monkeypatch)
    call = BodyLimits.__call__

    async def late(self: BodyLimits, scope: Any, receive: Any, send: Any) -> None:
        await asyncio.sleep(0.3)
        await call(self, scope, receive, send)

    monkeypatch.setattr(BodyLimits, "__call__", late)
    big = _padded(900_000)
    with _serving() as (addr, _), socket.create_connection(addr, timeout=10) as s:
        s.sendall(_head(len(big)) + big)
        status, _, answer = _responses(s, 1)[0]
    assert status == 200, answer
    assert _doubled(answer) == [2 * x for x in XS]
    before = [filled for filled, asked in reads if not asked]
    assert before and max(before) <= connection.BODY_READ_BYTES
    assert reads[-1] == (len(big), True)


def _read_until_closed(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def test_continue_head_and_closing_answers_come_whole() -> None:
    """`Expect: 100-continue`: the client reads `100 Continue` before it sends the body,
    then the answer. HEAD: the header with a length and no body, and the connection
    goes on. `Connection: close`: the whole answer, then the close."""
    with _serving() as (addr, _), socket.create_connection(addr, timeout=10) as s:
        s.sendall(_head(len(VALID)).replace(b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n"))
        assert s.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(VALID)
        status, _, answer = _responses(s, 1)[0]
        assert status == 200 and _doubled(answer) == [2, 4, 6]

        s.sendall(b"HEAD /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n")
        head = b""
        while not head.endswith(b"\r\n\r\n"):
            head += s.recv(1)
        assert head.startswith(b"HTTP/1.1 ") and b"content-length: " in head.lower()
        s.sendall(_head(len(VALID)) + VALID)  # nothing of a body came after the HEAD's header
        status, _, answer = _responses(s, 1)[0]
        assert status == 200 and _doubled(answer) == [2, 4, 6]

        s.sendall(_head(len(VALID)).replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
                  + VALID)
        raw = _read_until_closed(s)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"connection: close" in head.lower()
    assert _doubled(body) == [2, 4, 6]


def test_answered_requests_and_their_bodies_are_freed_without_the_garbage_collector() -> None:
    """Requests on one connection with the garbage collector off (600 KB bodies, malformed
    JSON, small valid ones): once answered, each is freed at once, by reference counting,
    its cycle and its body with it; the objects the collector tracks do not grow with the
    requests. The receive() a body read whole is given through made a reference cycle with
    its request's cycle, so every body stayed until a collection found it: under steady
    load the server's memory grew by about 3 MB a second (`make soak`)."""
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

    bodies = (_padded(BODY), b'{"inputs": [}', VALID)
    with _serving() as (addr, _), socket.create_connection(addr, timeout=10) as s:

        def send(n: int) -> None:
            for i in range(n):
                body = bodies[i % 3]
                s.sendall(_head(len(body)) + body)
                status, _, answer = _responses(s, 1)[0]
                assert status == (200, 400, 200)[i % 3], answer

        send(30)  # what the first requests make once
        gc.collect()
        gc.disable()
        try:
            before = len(gc.get_objects())
            send(300)
            grown = len(gc.get_objects()) - before
            live = [o for o in gc.get_objects() if isinstance(o, RequestResponseCycle)]
        finally:
            gc.enable()
    assert len(live) <= 2, f"{len(live)} requests' cycles still held after 300 answers"
    assert grown < 100, f"{grown} more objects after 300 requests"
