"""Request bodies as the body middleware reads them (server.limits, server.memory): whole and
identical however they arrive, one `bytes` filled in place when they come in pieces, the
budget counted as before, and the memory release held back while big bodies are in flight."""

from __future__ import annotations

import asyncio
import gzip
import os
import zlib
from typing import Any

import pytest

from server import limits
from server.app import read_body
from server.memory import BodyBuffer


@pytest.mark.parametrize(("size", "pieces"), [
    (10, [b"hello", b"world"]),  # as announced, two pieces
    (10, [b"hello", b"", b"world"]),  # an empty piece on the way
    (0, [b"ab", b"cd", b"e"]),  # chunked: no size
    (3, [b"ab", b"cd", b"e"]),  # more than announced
    (9, [b"ab", b"cd"]),  # fewer than announced
    (6, [b"abcdef", b"g"]),  # the first piece already fills it
])
def test_a_body_in_pieces_comes_back_whole_and_identical(size: int, pieces: list[bytes]) -> None:
    buf = BodyBuffer(size)
    for p in pieces:
        buf.write(p)
    body = buf.result()
    assert type(body) is bytes
    assert body == b"".join(pieces)
    assert hash(body) == hash(b"".join(pieces))  # a finished bytes, like any other


def test_a_big_body_in_many_pieces_is_identical() -> None:
    pieces = [os.urandom(65536) for _ in range(40)] + [os.urandom(1234)]
    buf = BodyBuffer(sum(map(len, pieces)))
    for p in pieces:
        buf.write(p)
    assert buf.result() == b"".join(pieces)


def test_a_body_of_one_piece_is_that_piece_not_a_copy() -> None:
    piece = os.urandom(1000)
    buf = BodyBuffer(len(piece))
    buf.write(piece)
    assert buf.result() is piece


def _receive_of(pieces: list[bytes]) -> Any:
    msgs = [{"type": "http.request", "body": p, "more_body": i < len(pieces) - 1}
            for i, p in enumerate(pieces)]

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(0)
        return msgs.pop(0) if msgs else {"type": "http.disconnect"}

    return receive


def _scope(headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    return {"type": "http", "method": "POST", "path": "/", "headers": headers,
            "http_version": "1.1"}


class _Recorder:
    """An app that reads its body, notes it and the budget in use, and answers 200."""

    def __init__(self, budget: limits.BodyBudget) -> None:
        self.budget = budget
        self.bodies: list[bytes] = []
        self.used_while_answering: list[int] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        msg = await receive()
        assert msg["more_body"] is False
        self.bodies.append(msg["body"])
        self.used_while_answering.append(self.budget.used_bytes)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


async def _call(mw: limits.BodyLimits, headers: list[tuple[bytes, bytes]],
                pieces: list[bytes]) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    await mw(_scope(headers), _receive_of(pieces), send)
    return sent


@pytest.mark.parametrize("chunked", [False, True])
def test_the_app_gets_the_body_whole_and_the_budget_is_counted_as_before(chunked: bool) -> None:
    pieces = [os.urandom(65536) for _ in range(10)] + [os.urandom(100)]
    n = sum(map(len, pieces))
    budget = limits.BodyBudget(4 << 20)
    app = _Recorder(budget)
    mw = limits.BodyLimits(app, max_body_bytes=2 << 20, budget=budget, release=lambda: None)
    headers = ([(b"transfer-encoding", b"chunked")] if chunked
               else [(b"content-length", str(n).encode())])
    sent = asyncio.run(_call(mw, headers, pieces))
    assert sent[0]["status"] == 200
    assert app.bodies == [b"".join(pieces)] and type(app.bodies[0]) is bytes
    assert app.used_while_answering == [n]  # the whole body, counted once
    assert budget.used_bytes == 0  # given back after the answer


def test_over_the_limit_and_over_the_budget_are_still_refused() -> None:
    budget = limits.BodyBudget(1 << 20)
    app = _Recorder(budget)
    mw = limits.BodyLimits(app, max_body_bytes=1 << 20, budget=budget, release=lambda: None)
    piece = b"x" * 65536
    # chunked past the limit: 413 once it passes
    sent = asyncio.run(_call(mw, [(b"transfer-encoding", b"chunked")], [piece] * 20))
    assert sent[0]["status"] == 413
    # declared more than is left of the budget: 503 + Retry-After before reading
    budget.used_bytes = (1 << 20) - 1000
    sent = asyncio.run(_call(mw, [(b"content-length", b"2000")], [b"y" * 2000]))
    assert sent[0]["status"] == 503 and (b"retry-after", b"1") in sent[0]["headers"]
    assert app.bodies == [] and budget.used_bytes == (1 << 20) - 1000


@pytest.mark.parametrize("compress", [gzip.compress, zlib.compress], ids=["gzip", "deflate"])
def test_a_compressed_body_reaches_the_app_plain_and_is_counted_decompressed(
        compress: Any) -> None:
    plain = os.urandom(3 << 20)[:2_500_000] + bytes(500_000)  # several decompression steps
    body = compress(plain)
    budget = limits.BodyBudget(16 << 20)
    app = _Recorder(budget)
    mw = limits.BodyLimits(app, max_body_bytes=4 << 20, budget=budget, release=lambda: None)
    encoding = b"gzip" if compress is gzip.compress else b"deflate"
    sent = asyncio.run(_call(mw, [(b"content-length", str(len(body)).encode()),
                                  (b"content-encoding", encoding)], [body]))
    assert sent[0]["status"] == 200
    assert app.bodies == [plain]
    assert app.used_while_answering == [len(body) + len(plain)]
    assert budget.used_bytes == 0


def test_a_compressed_body_refused_gives_back_what_it_took_of_the_budget() -> None:
    budget = limits.BodyBudget(8 << 20)
    app = _Recorder(budget)
    mw = limits.BodyLimits(app, max_body_bytes=4 << 20, budget=budget, release=lambda: None)
    for data, want in [(gzip.compress(bytes(5 << 20)), 413),  # over the limit decompressed
                       (gzip.compress(os.urandom(3 << 20))[:-100], 400)]:  # cut short
        sent = asyncio.run(_call(mw, [(b"content-length", str(len(data)).encode()),
                                      (b"content-encoding", b"gzip")], [data]))
        assert sent[0]["status"] == want
        assert budget.used_bytes == 0
    # more than the budget has left once decompressed: 503, before it is all decompressed
    budget.used_bytes = 6 << 20
    data = gzip.compress(bytes(3 << 20))
    sent = asyncio.run(_call(mw, [(b"content-length", str(len(data)).encode()),
                                  (b"content-encoding", b"gzip")], [data]))
    assert sent[0]["status"] == 503 and budget.used_bytes == 6 << 20
    assert app.bodies == []


def test_the_memory_release_waits_for_the_last_big_body_in_flight() -> None:
    released: list[int] = []
    big = limits.TRIM_AFTER_BYTES
    budget = limits.BodyBudget(4 * big)
    first_done = asyncio.Event()
    answered: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        body = (await receive())["body"]
        if body[:1] == b"b":  # the second waits until the first has been answered
            await first_done.wait()
            for _ in range(25):  # time enough for a release the first one asked for
                if released:
                    break
                await asyncio.sleep(0.004)
            answered.append(f"second, releases so far {len(released)}")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
        if body[:1] == b"a":
            first_done.set()

    mw = limits.BodyLimits(app, max_body_bytes=2 * big, budget=budget,
                           release=lambda: released.append(1))
    length = [(b"content-length", str(big).encode())]

    async def go() -> None:
        await asyncio.gather(_call(mw, length, [b"a" * big]), _call(mw, length, [b"b" * big]))
        for _ in range(200):
            if mw.trims.done:
                break
            await asyncio.sleep(0.01)

    asyncio.run(go())
    assert answered == ["second, releases so far 0"]  # none while the second was in flight
    assert released == [1]  # one, after the last


def test_read_body_hands_over_a_whole_body_without_copying_it() -> None:
    body = os.urandom(100_000)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    got = asyncio.run(read_body(_scope([]), receive, 1 << 20))
    assert got is body  # one piece is handed over as it came, not joined (copied)
