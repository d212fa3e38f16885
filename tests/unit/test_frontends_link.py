"""The link between a front end and the dispatch process (`server.link`): frames come
out whole and in order however the bytes are cut into reads, small ones many per read and
big payloads straight into their own buffer; bodies in shared memory; refusals that stand
at a front end, and their counting by the dispatch process."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import socket
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dstack.common.errors import DeadlineRefused, ModelNotFound
from server.connection import ANSWER_LATER, LATER, RECEIVED_AT
from server.frontends import DecisionBound, FrontEnds, LinkHeaderCheck
from server.link import (
    READ_BYTES,
    REPORT_S,
    FrameReader,
    SharedBodies,
    StandingRefusals,
    _DispatchLink,
    frame,
)


class _Collect(FrameReader):
    def __init__(self) -> None:
        super().__init__()
        self.frames: list[tuple[dict[str, Any], bytes]] = []

    def on_frame(self, meta: dict[str, Any], payload: bytes | bytearray) -> None:
        self.frames.append((meta, bytes(payload)))


def _feed(reader: FrameReader, data: bytes, cuts: random.Random) -> None:
    """`data` into `reader` as the loop would: each read at most what get_buffer offers."""
    at = 0
    while at < len(data):
        buf = reader.get_buffer(-1)
        assert len(buf), "no room offered: the event loop fails the link (RuntimeError)"
        n = min(len(buf), len(data) - at, cuts.randint(1, 3 * READ_BYTES))
        buf[:n] = data[at:at + n]
        reader.buffer_updated(n)
        at += n


def test_frames_come_out_whole_and_in_order_however_the_reads_cut_them() -> None:
    rng = random.Random(7)
    sizes = [0, 1, 10, 600_000, 5, READ_BYTES - 20, READ_BYTES, READ_BYTES + 1, 3_000_000, 0, 7]
    sent = [({"k": "b", "i": i, "m": "model" * (i % 3)}, rng.randbytes(n))
            for i, n in enumerate(sizes * 3)]
    data = b"".join(b"".join(frame(meta, payload)) for meta, payload in sent)
    for seed in range(5):
        reader = _Collect()
        _feed(reader, data, random.Random(seed))
        assert reader.frames == sent


def test_a_meta_bigger_than_the_read_buffer_comes_out_whole() -> None:
    """A request passed whole to the dispatch process carries its headers in the meta: one
    GET with a 100 KB header made a meta bigger than the read buffer, which then offered the
    loop no room; the loop failed the link, and the front end stopped (every request it
    held answered 503 "the server is stopping")."""
    rng = random.Random(3)
    sent = [({"k": "x", "i": i, "headers": [["x-a", "b" * n]]}, rng.randbytes(p))
            for i, (n, p) in enumerate([(100_000, 10), (5, 0), (3 * READ_BYTES, 700_000),
                                        (READ_BYTES, 0), (1, 1)])]
    data = b"".join(b"".join(frame(meta, payload)) for meta, payload in sent)
    for seed in range(5):
        reader = _Collect()
        _feed(reader, data, random.Random(seed))
        assert reader.frames == sent


def test_many_small_frames_are_parsed_from_one_read() -> None:
    reader = _Collect()
    sent = [({"k": "h", "i": i, "m": "tiny_cnn", "t": 1.5}, b"") for i in range(500)]
    data = b"".join(b"".join(frame(m, p)) for m, p in sent)
    reads = 0
    at = 0
    while at < len(data):
        buf = reader.get_buffer(-1)
        n = min(len(buf), len(data) - at)
        buf[:n] = data[at:at + n]
        reader.buffer_updated(n)
        at += n
        reads += 1
    assert reader.frames == sent
    assert reads <= len(data) // (READ_BYTES // 2) + 1  # not one read per frame


def _binary_infer_scope() -> dict[str, Any]:
    return {"method": "POST", "path": "/v2/models/m/infer",
            "headers": [(b"inference-header-content-length", b"120")]}


def _shared(size: int) -> SharedBodies:
    bodies = SharedBodies(size)
    bodies.enabled = True  # as when the dispatch process has said it mapped them
    return bodies


def test_shared_bodies_are_given_out_first_fit_and_taken_back_whole() -> None:
    bodies = _shared(1 << 20)
    a, b, c = (bodies.take(300_000) for _ in range(3))
    assert a is not None and b is not None and c is not None
    assert bodies.take(300_000) is None  # 3 x 300,000 given out of 1 MiB: no room
    assert bodies.store(10, _binary_infer_scope()) is not None  # a small one still fits
    b_at = b.at
    b.free()
    b.free()  # once only
    d = bodies.take(200_000)  # into b's place, first fit
    assert d is not None and d.at == b_at
    a.free()
    c.free()
    d.free()
    # every run joined again: the whole region in one piece
    whole = bodies.take((1 << 20) - SharedBodies.ALIGN)
    assert whole is not None and whole.at == 0


def test_a_shared_body_dropped_unsent_gives_its_space_back() -> None:
    bodies = _shared(1 << 20)
    made = bodies.store(900_000, _binary_infer_scope())
    assert made is not None
    body, view = made
    view[:3] = b"abc"  # the connection reads the socket into it
    assert bytes(body.view[:3]) == b"abc" and len(body) == 900_000
    assert bodies.take(900_000) is None
    del made, body, view  # a request refused, or its client gone: never sent
    assert bodies.take(900_000) is not None


def test_only_binary_infer_bodies_go_to_shared_memory() -> None:
    bodies = SharedBodies(1 << 20)
    assert bodies.store(100, _binary_infer_scope()) is None  # not before the dispatch says
    bodies.enabled = True
    json_infer = {**_binary_infer_scope(), "headers": [(b"content-type", b"application/json")]}
    other = {**_binary_infer_scope(), "path": "/v2/repository/models/m/load"}
    assert bodies.store(100, json_infer) is None
    assert bodies.store(100, other) is None
    assert bodies.store(2 << 20, _binary_infer_scope()) is None  # bigger than the region
    mapped = SharedBodies.map(bodies.path, bodies.size)  # as the dispatch process maps it
    made = bodies.store(100, _binary_infer_scope())
    assert made is not None
    made[1][:5] = b"hello"
    assert bytes(mapped[made[0].at:made[0].at + 5]) == b"hello"


def test_a_big_shared_body_gives_its_pages_back_once_freed() -> None:
    import os

    bodies = _shared(16 << 20)
    body = bodies.take(8 << 20)
    assert body is not None
    body.view[:] = b"x" * (8 << 20)  # a big body read in: its pages are taken
    assert os.fstat(bodies.fd).st_blocks * 512 >= 8 << 20
    body.free()  # as one process trims after a big body, so does a front end
    assert os.fstat(bodies.fd).st_blocks * 512 < 1 << 20



class _Sent(FrameReader):
    """A link end that keeps what it sends."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[dict[str, Any]] = []

    def send(self, meta: dict[str, Any], payload: bytes | bytearray | memoryview = b"") -> None:
        self.sent.append(meta)

    def on_frame(self, meta: dict[str, Any], payload: bytes | bytearray) -> None: ...


def test_a_standing_refusal_answers_the_models_requests_until_it_lapses_and_is_told() -> None:
    link = _Sent()
    standing = StandingRefusals(link)
    key, other = ("m", None), ("n", None)
    no = {"k": "no", "i": 7, "s": 429, "e": "model m: work ahead", "r": "work_ahead",
          "ra": None, "why": "deadline"}
    answer = (429, [], b'{"error": "model m: work ahead"}')

    async def go() -> None:
        assert standing.answer(key, time.monotonic()) is None  # nothing stands yet
        standing.stand(key, {**no, "l": time.monotonic() + 0.05}, answer)
        standing.stand(other, no, answer)  # says nothing of standing
        received = time.monotonic() - 0.002
        assert standing.answer(key, received) is answer
        assert standing.answer(key, time.monotonic()) is answer
        assert standing.answer(other, time.monotonic()) is None
        assert link.sent == []  # told within REPORT_S, together
        await asyncio.sleep(2 * REPORT_S)
        [told] = link.sent
        assert (told["k"], told["m"], told["r"], told["s"], told["e"]) == (
            "lr", "m", "work_ahead", 429, "model m: work ahead")
        assert len(told["d"]) == 2 and told["d"][0] >= 0.002
        await asyncio.sleep(0.05)
        assert standing.answer(key, time.monotonic()) is None  # lapsed: ask again

    asyncio.run(go())


def test_refusals_told_by_a_front_end_are_counted_as_the_dispatch_process_counts_its_own(
        ) -> None:
    counted: list[tuple[str, str, int]] = []
    failed: list[tuple[str, int, str, float]] = []
    metrics = SimpleNamespace(frontends_standing_refusals=0)
    d = SimpleNamespace(count_refused=lambda m, r, n: counted.append((m, r, n)),
                        failed=lambda m, e, stage, at: failed.append(
                            (m, e.status_code, stage, time.monotonic() - at)),
                        metrics=metrics)
    end = _DispatchLink(d)  # type: ignore[arg-type]
    end.on_frame({"k": "lr", "i": 0, "m": "m", "s": 429, "e": "model m: work ahead",
                  "r": "work_ahead", "ra": None, "why": "deadline", "d": [0.001, 0.003]}, b"")
    assert counted == [("m", "work_ahead", 2)]
    assert [f[:3] for f in failed] == [("m", 429, "header")] * 2
    # each timed as the front end timed it, from its first byte to its refusal
    assert 0.001 <= failed[0][3] < 0.05 and 0.003 <= failed[1][3] < 0.05
    assert metrics.frontends_standing_refusals == 2


def _dispatch_end(admit: bool = True) -> tuple[_DispatchLink, _Record]:
    """A dispatch process's end of a link whose runtime lets every header through
    (`admit`) or refuses it for work ahead."""
    rec = _Record()

    def refuse_early(model: str, since_s: float = 0.0, hold: bool = False) -> int | None:
        rec.since_s.append(since_s)
        if model not in ("m",):
            raise ModelNotFound(f"no model {model}")
        if not admit:
            rec.counted.append((model, "work_ahead", 1))
            raise DeadlineRefused(f"model {model}: work ahead")
        return 41

    def count_refused(model: str, rule: str, n: int) -> None:
        if model != "m":
            raise KeyError(model)
        rec.counted.append((model, rule, n))

    d = SimpleNamespace(
        version="1", refuse_early=refuse_early, count_refused=count_refused,
        release=lambda m, token: rec.released.append((m, token)),
        failed=lambda m, e, stage, at: rec.failed.append(
            (m, e.status_code, e.rule, stage, time.monotonic() - at)),
        metrics=SimpleNamespace(frontends_undecided=0))
    end = _DispatchLink(d)  # type: ignore[arg-type]
    end.send = lambda meta, payload=b"": rec.sent.append(meta)  # type: ignore[method-assign]
    return end, rec


class _Record:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.counted: list[tuple[str, str, int]] = []
        self.released: list[tuple[str, int | None]] = []
        self.failed: list[tuple[str, int, str | None, str, float]] = []
        self.since_s: list[float] = []  # what each header was judged with


def test_a_header_the_front_end_refused_undecided_is_given_back_and_counted_once() -> None:
    end, rec = _dispatch_end()
    now = time.monotonic()
    # decided in time and let through; the answer came too late: the front end refused it
    end.on_frame({"k": "h", "i": 1, "m": "m", "t": now, "d": 0.05}, b"")
    assert [m["k"] for m in rec.sent] == ["go"] and rec.released == []
    end.on_frame({"k": "u", "i": 1, "m": "m", "t": now, "d": 0.05}, b"")
    assert rec.released == [("m", 41)]  # its place is free again
    assert rec.counted == [("m", "work_ahead", 1)]
    [(model, status, rule, stage, took)] = rec.failed
    assert (model, status, rule, stage) == ("m", 429, "work_ahead", "header")
    assert 0.05 <= took < 0.5  # timed as the front end answered it
    # read after its time was up: not decided (no answer, nothing held), counted once
    end.on_frame({"k": "h", "i": 2, "m": "m", "t": now - 0.06, "d": 0.05}, b"")
    end.on_frame({"k": "u", "i": 2, "m": "m", "t": now - 0.06, "d": 0.05}, b"")
    assert [m["k"] for m in rec.sent] == ["go"] and rec.released == [("m", 41)]
    assert rec.counted == [("m", "work_ahead", 1)] * 2 and len(rec.failed) == 2
    # a model the server does not serve: not counted (no series for clients' made-up names)
    end.on_frame({"k": "h", "i": 3, "m": "nope", "t": now - 0.06, "d": 0.05}, b"")
    end.on_frame({"k": "u", "i": 3, "m": "nope", "t": now - 0.06, "d": 0.05}, b"")
    assert len(rec.counted) == 2 and len(rec.failed) == 2
    assert end.d.metrics.frontends_undecided == 3


def test_a_header_refused_in_time_and_answered_late_is_counted_once() -> None:
    end, rec = _dispatch_end(admit=False)
    now = time.monotonic()
    end.on_frame({"k": "h", "i": 1, "m": "m", "t": now, "d": 0.05}, b"")
    end.on_frame({"k": "u", "i": 1, "m": "m", "t": now, "d": 0.05}, b"")
    assert [m["k"] for m in rec.sent] == ["no"]
    assert rec.counted == [("m", "work_ahead", 1)] and rec.released == []


def test_a_header_without_a_bound_is_decided_however_late() -> None:
    end, rec = _dispatch_end()  # (asked by a front end without a bound at the time)
    end.on_frame({"k": "h", "i": 1, "m": "m", "t": time.monotonic() - 10}, b"")
    assert [m["k"] for m in rec.sent] == ["go"]


def test_a_header_is_judged_from_its_first_byte() -> None:
    """The dispatch process decides on a header as of the request's first byte at the front
    end: one read 50 ms late (its loop behind) has 50 ms less of its SLO left."""
    end, rec = _dispatch_end()
    end.on_frame({"k": "h", "i": 1, "m": "m", "t": time.monotonic() - 0.05}, b"")
    assert [m["k"] for m in rec.sent] == ["go"]
    assert 0.05 <= rec.since_s[0] < 1


class _AskingLink:
    """A front end's link whose questions are kept, answered by the test (or never)."""

    def __init__(self) -> None:
        self.ids = itertools.count(1)
        self.waiting: dict[int, Any] = {}
        self.told: list[dict[str, Any]] = []

    def ask(self, meta: dict[str, Any], waiter: Any) -> bool:
        self.waiting[meta["i"]] = waiter
        return True

    def tell(self, meta: dict[str, Any]) -> None:
        self.told.append(meta)


def _refusing_bound(limit_s: float) -> DecisionBound:
    """A `DecisionBound` of a front end whose server has been refusing: on."""
    bound = DecisionBound(limit_s)
    while bound.now() == 0:
        bound.decided(True)
    return bound


def test_a_front_end_refuses_a_header_not_decided_in_time_and_says_so() -> None:
    link = _AskingLink()
    check = LinkHeaderCheck(link, max_body_bytes=1 << 20, allowed=None,  # type: ignore[arg-type]
                            bound=_refusing_bound(0.02))
    answers: dict[int, Any] = {}

    def scope(n: int) -> dict[str, Any]:
        return {RECEIVED_AT: time.monotonic(),
                ANSWER_LATER: lambda answer: answers.setdefault(n, answer) is answer}

    async def go() -> None:
        assert check("/v2/models/m/infer", [], 100, scope(1)) is LATER
        assert check("/v2/models/m/infer", [], 100, scope(2)) is LATER
        link.waiting.pop(2)({"k": "go", "i": 2}, b"")  # decided in time: let through
        await asyncio.sleep(0.06)
        status, _, body = answers[1]
        assert status == 429 and json.loads(body)["reason"] == "work_ahead"
        assert "did not decide on this request within 20 ms" in json.loads(body)["error"]
        assert answers[2] is None  # went on to its body
        assert link.told == [{"k": "u", "i": 1, "m": "m", "t": link.told[0]["t"], "d": 0.02}]
        assert link.waiting == {}  # the dispatch process's late answer finds no one

    asyncio.run(go())


def test_a_front_end_bounds_the_decision_only_while_the_server_is_refusing() -> None:
    """At normal load (few refusals) a header waits for its decision however long the
    dispatch process takes; once a quarter of the recent decisions are refusals, it is
    asked with the bound (`d`) and refused when that is up; the front end's own refusals
    of headers not decided in time do not keep the bound on."""
    link = _AskingLink()
    bound = DecisionBound(0.02)
    check = LinkHeaderCheck(link, max_body_bytes=1 << 20, allowed=None,  # type: ignore[arg-type]
                            bound=bound)
    answers: dict[int, Any] = {}
    ids = itertools.count(100)

    def ask(decision: str | None) -> int:
        """One header, answered `go` or `no` by the dispatch process at once (None:
        never); its id."""
        n = next(ids)
        scope = {RECEIVED_AT: time.monotonic(),
                 ANSWER_LATER: lambda answer: answers.setdefault(n, answer) is answer}
        assert check("/v2/models/m/infer", [], 100, scope) is LATER
        i = max(link.waiting)
        if decision is not None:
            link.waiting.pop(i)({"k": decision, "i": i, "s": 429, "e": "full", "r": "work_ahead"},
                                b"")
        return n

    async def go() -> None:
        for _ in range(50):
            ask("go")
        for _ in range(5):  # one in 11 refused: normal load
            ask("no")
        slow = ask(None)
        await asyncio.sleep(0.05)
        assert slow not in answers and link.told == []  # still waiting, unbounded
        link.waiting.clear()
        for _ in range(10):  # now a quarter and more of the decisions are refusals
            ask("no")
        assert bound.now() == 0.02
        undecided = [ask(None) for _ in range(30)]
        await asyncio.sleep(0.05)
        assert all(answers[n][0] == 429 for n in undecided)  # bounded, refused
        assert [m["k"] for m in link.told] == ["u"] * 30
        assert bound.now() == 0.02  # not fed by its own refusals: still on
        for _ in range(30):  # the server takes requests again
            ask("go")
        assert bound.now() == 0
        assert link.waiting == {}

    asyncio.run(go())


def test_a_front_end_holds_a_held_refusal_and_the_refusals_that_stand_on_it() -> None:
    """A refusal the dispatch process holds (`h`: `Runtime.hold_s`) is held by the front end
    too, and so is a request refused meanwhile within its standing: written when it lapses,
    so that a client sending again at once is paced there as well."""
    link = _AskingLink()
    check = LinkHeaderCheck(link, max_body_bytes=1 << 20, allowed=None,  # type: ignore[arg-type]
                            bound=DecisionBound(0.0))
    answered_at: dict[int, float] = {}

    def scope(n: int) -> dict[str, Any]:
        return {RECEIVED_AT: time.monotonic(),
                ANSWER_LATER: lambda answer: answered_at.setdefault(n, time.monotonic()) > 0}

    async def go() -> None:
        t0 = time.monotonic()
        assert check("/v2/models/m/infer", [], 100, scope(1)) is LATER
        link.waiting.pop(1)({"k": "no", "i": 1, "s": 429, "e": "model m: work ahead",
                             "r": "work_ahead", "ra": None, "why": "deadline", "h": 0.1,
                             "l": time.monotonic() + 0.1}, b"")
        assert check("/v2/models/m/infer", [], 100, scope(2)) is LATER  # within its standing
        assert link.waiting == {}  # not asked: it stands
        await asyncio.sleep(0.03)
        assert answered_at == {}
        await asyncio.sleep(0.15)
        assert set(answered_at) == {1, 2}
        assert min(answered_at.values()) - t0 >= 0.09

    asyncio.run(go())


def test_a_front_end_that_exits_as_it_starts_fails_the_start_at_once(tmp_path: Path) -> None:
    """Its exit code is said when it exits, not after the whole wait for its hello."""
    with socket.socket() as sock:
        fronts = FrontEnds(2, tmp_path / "deploy.yaml", sock.fileno(), tmp_path, None)
        fronts.argv = [sys.executable, "-c", "import sys; sys.exit(3)"]
        with pytest.raises(RuntimeError, match="exited as it started.*exit code 3"):
            asyncio.run(fronts.start(asyncio.Queue(), timeout_s=60))
        for p in fronts.procs:
            p.wait(10)
