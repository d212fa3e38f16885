"""The link between a front-end process and the dispatch process (`server.frontends`).

One Unix stream socket per front end carries frames: an 8-byte head (the meta's and the
payload's lengths), the meta as JSON, the payload; read in bulk (many small frames per
read, a big payload straight into its own buffer). Per infer request, two round trips:

- `h` (the header: model, version, first byte) -> `go` (admitted for now, its place in the
  model's queue held while the body is read, as `server.early.HELD`) or `no` (the refusal:
  status, message, rule, retry-after), answered by the front end exactly as the
  one-process server answers it (`server.early.EarlyRefusal`);
- `b` (the whole body as payload, or where it lies in the front end's shared memory) ->
  `a` (status, headers; the answer as payload), from the dispatch process's own infer
  endpoint (`server.app`), called with the body at once.

A front end reads binary infer bodies straight into a shared-memory file of its own
(`SharedBodies`, mapped by the dispatch process when the front end says hello): such a
body crosses to the dispatch process as its offset and length, not copied over the
socket, and its space is the front end's again when the answer `a` comes.

While a big body arrives, `c` asks again every `CHECK_EVERY_BYTES` (`go` or `no`); a request
that ends before its body was sent (a 413, a client gone) gives its hold back (`r`).
Every other route goes whole as `x` and is answered by the dispatch process's app; `b` and
`x` carry the client's address (`c`: whose shared memory it may name, `server.shm`). A
gRPC call goes as `g` (the method, the peer, the `authorization` metadata, when the front
end had it; the request's bytes, a big one in the shared memory) -> `a` (status code,
details, trailing metadata; the response's bytes), from the dispatch process's servicer
(`server.grpc_server`). Each
second a front end tells how late its loop's timer fired meanwhile (`late`, for /metrics).

A `no` to an `h` may say until when the refusal stands for the model's next requests (`l`,
`time.monotonic()` there, which the processes of one host share: the dispatch core's
`Refusal.stands_s` from when it was decided, at most STANDS_MAX_S): meanwhile the front
end answers them with it without asking (`StandingRefusals`), and tells the dispatch
process within REPORT_S how many it refused so and how long each took (`lr`), to be
counted as the dispatch process counts its own.
`Dispatch` is the dispatch process's end, `Link` a front end's.
"""

from __future__ import annotations

import abc
import asyncio
import bisect
import itertools
import logging
import mmap
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
from starlette.types import Message

from dstack.common.errors import DeadlineRefused, DStackError, Unavailable
from dstack.common.pauses import Lateness
from dstack.runtime.dispatch import RefusalReason
from dstack.runtime.shm import memory_file
from server.connection import RECEIVED_AT
from server.early import HELD, INFER_PATH
from server.memory import TRIM_AFTER_BYTES, unfilled_bytes

log = logging.getLogger("dstack.server")

#: The longest a refusal at the header stands at a front end (`l`): the dispatch core's
#: `stands_s` assumes the work ahead finishes no sooner than predicted, which holds for a
#: few ms. (Under overload most of a model's requests come within one: at 4x, three in
#: four are refused, and each front end asked about each of them.)
STANDS_MAX_S = 0.005
#: A front end tells the dispatch process what it refused within a standing refusal this
#: long after the first (`lr`): /metrics and stats lag by no more.
REPORT_S = 0.01
#: A frame's head: the meta's length, the payload's length.
HEAD = struct.Struct("<II")
#: Bytes read from the link at once when no big payload is being filled.
READ_BYTES = 1 << 16
#: A link's send buffer: a body of a few MB goes in one write, and is read in one read. (At
#: the default 208 KB, a 600 KB body took three turns of both loops, each waiting for the
#: other: its time from first byte to the dispatch process grew from 1-15 to 20-35 ms
#: under overload on an H100 host.)
LINK_BUFFER_BYTES = 8 << 20
#: Linux's SO_SNDBUFFORCE: past net.core.wmem_max, where the process may.
_SO_SNDBUFFORCE = 32


def frame(meta: dict[str, Any], payload: bytes | bytearray | memoryview = b"") -> list[Any]:
    m = orjson.dumps(meta)
    return [HEAD.pack(len(m), len(payload)), m, payload]


class FrameReader(asyncio.BufferedProtocol, abc.ABC):
    """Reads frames in bulk: many small ones per read; a payload bigger than what is left of
    the read buffer goes straight into its own bytearray. `on_frame(meta, payload)`."""

    def __init__(self) -> None:
        self._buf = bytearray(READ_BYTES)
        self._n = 0  # bytes of _buf holding unparsed data
        self._meta: dict[str, Any] | None = None  # the frame whose payload is being filled
        self._payload: bytes | bytearray | None = None
        self._view: memoryview | None = None  # where the payload being filled is written
        self._filled = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        for opt in (_SO_SNDBUFFORCE, socket.SO_SNDBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, LINK_BUFFER_BYTES)
                break
            except OSError:  # not allowed: the next one, else the default
                continue

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._view is not None:
            return self._view[self._filled:]
        return memoryview(self._buf)[self._n:]

    def buffer_updated(self, nbytes: int) -> None:
        if self._view is not None:
            self._filled += nbytes
            if self._filled < len(self._view):
                return
            meta, payload = self._meta, self._payload
            self._meta = self._payload = self._view = None
            self.on_frame(meta, payload)  # type: ignore[arg-type]
            return
        self._n += nbytes
        buf, at, n = self._buf, 0, self._n
        while n - at >= HEAD.size:
            mlen, plen = HEAD.unpack_from(buf, at)
            start = at + HEAD.size
            if n - start < mlen:
                if HEAD.size + mlen > len(buf):  # a meta bigger than the buffer (a request's
                    # long headers): a buffer that holds it, else the link stalls and dies
                    self._buf = bytearray(HEAD.size + mlen + READ_BYTES)
                    self._buf[:n - at] = buf[at:n]
                    self._n = n - at
                    return
                break
            meta = orjson.loads(memoryview(buf)[start:start + mlen])
            start += mlen
            have = n - start
            if have >= plen:
                payload = bytes(buf[start:start + plen]) if plen else b""
                at = start + plen
                self.on_frame(meta, payload)
                continue
            if HEAD.size + mlen + plen <= len(buf):  # the frame fits: read the rest first
                break
            made = unfilled_bytes(plen)  # not zeroed first: it is all written over
            if made is None:
                self._payload = bytearray(plen)
                self._view = memoryview(self._payload)
            else:
                self._payload, self._view = made
            self._meta = meta
            self._view[:have] = buf[start:n]
            self._filled, at = have, n
            break
        if at:
            buf[:n - at] = buf[at:n]
            self._n = n - at

    @abc.abstractmethod
    def on_frame(self, meta: dict[str, Any], payload: bytes | bytearray) -> None:
        """One whole frame (`payload` is the reader's to keep)."""

    def send(self, meta: dict[str, Any], payload: bytes | bytearray | memoryview = b"") -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.writelines(frame(meta, payload))


# ---------------------------------------------------------------------- dispatch side


def error_of(meta: dict[str, Any]) -> DStackError:
    """The refusal a `no` carries, as the `DStackError` it was decided as."""
    e = DStackError(meta["e"])
    e.status_code = meta["s"]
    e.reason = meta.get("why", "rejected")
    e.rule = meta.get("r")
    e.retry_after_s = meta.get("ra")
    e.hold_s = meta.get("h", 0.0)
    e.logged = True
    return e


def undecided_error(model: str, decide_s: float) -> DStackError:
    """The refusal a front end answers a request with when the dispatch process has not
    decided on its header within `decide_s` of its first byte (`server.decision_timeout_ms`):
    a 429 by the rule `work_ahead`, as the dispatch core's (the work ahead is the dispatch
    process's own)."""
    e = DeadlineRefused(
        f"model {model}: the server did not decide on this request within "
        f"{decide_s * 1000:g} ms of its first byte (server.decision_timeout_ms): too much "
        "work ahead; retry later")
    e.rule = RefusalReason.WORK_AHEAD.value
    e.logged = True
    return e


def _refusal_meta(i: int, e: DStackError) -> dict[str, Any]:
    meta = {"k": "no", "i": i, "s": e.status_code, "e": e.message, "r": e.rule,
            "ra": e.retry_after_s, "why": e.reason}
    if e.hold_s > 0:
        meta["h"] = e.hold_s
    return meta


def _standing_meta(i: int, e: DStackError) -> dict[str, Any]:
    """`_refusal_meta` for a refusal at the header just decided, with until when it stands
    (`l`)."""
    meta = _refusal_meta(i, e)
    if e.stands_s > 0:
        meta["l"] = time.monotonic() + min(e.stands_s, STANDS_MAX_S)
    return meta


class Dispatch:
    """The dispatch process's end of the links: `app` (the one-process server's app, built
    by `server.main.build_app` without auth: the front ends check it) answers every
    request; its runtime's `refuse_early` and `release` decide and hold at the header."""

    def __init__(self, app: Any, runtime: Any, version: str, grpc: Any = None) -> None:
        self.app = app
        # the gRPC servicer (`server.grpc_server.InferenceServicer`) that answers `g`
        self.grpc = grpc
        self.infer = app.state.infer_endpoint
        self.failed = app.state.metrics.failed
        self.metrics = app.state.metrics
        self.late = self.metrics.frontends_late = Lateness()  # the front ends' loops
        self.refuse_early: Callable[..., int | None] | None = getattr(
            runtime, "refuse_early", None)
        self.release: Callable[..., None] | None = getattr(runtime, "release", None)
        self.count_refused: Callable[[str, str, int], None] | None = getattr(
            runtime, "count_refused", None)
        self.version = version
        self.hello: asyncio.Queue[int] = asyncio.Queue()  # pids of front ends ready

    async def listen(self, path: Path) -> asyncio.AbstractServer:
        loop = asyncio.get_running_loop()
        return await loop.create_unix_server(lambda: _DispatchLink(self), str(path))


class _DispatchLink(FrameReader):
    def __init__(self, dispatch: Dispatch) -> None:
        super().__init__()
        self.d = dispatch
        # request id -> (model, token), held while its body is read (`server.early.HELD`)
        self.holds: dict[int, tuple[str, int | None]] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.shared: memoryview | None = None  # the front end's bodies (`SharedBodies`)

    def connection_lost(self, exc: Exception | None) -> None:
        for held in self.holds.values():  # the front end is gone: so are its bodies
            self._release(held)
        self.holds.clear()

    def _release(self, held: tuple[str, int | None]) -> None:
        if self.d.release is not None:
            self.d.release(*held)

    def on_frame(self, meta: dict[str, Any], payload: bytes | bytearray) -> None:
        k = meta["k"]
        if k == "h":
            self._header(meta)
        elif k == "b" or k == "x":
            t = asyncio.get_running_loop().create_task(self._answer(meta, payload))
            self.tasks.add(t)
            t.add_done_callback(self.tasks.discard)
        elif k == "c":
            self._check(meta)
        elif k == "g":
            t = asyncio.get_running_loop().create_task(self._answer_grpc(meta, payload))
            self.tasks.add(t)
            t.add_done_callback(self.tasks.discard)
        elif k == "r":
            held = self.holds.pop(meta["i"], None)
            if held is not None:
                self._release(held)
        elif k == "u":
            self.d.metrics.frontends_undecided += 1
            held = self.holds.pop(meta["i"], None)
            if held is not None:  # let through: refused by the front end after all
                self._release(held)
                self._count_undecided(meta)
        elif k == "lr":
            self._refused_standing(meta)
        elif k == "late":
            told = Lateness()
            told.counts, told.sum_s = meta["c"], meta["s"]
            self.d.late.merge(told)
        elif k == "hello":
            if meta.get("shm"):
                try:
                    self.shared = SharedBodies.map(meta["shm"], meta["shm_bytes"])
                except OSError as e:  # its bodies keep crossing the link
                    log.warning("front end %s: its shared memory for bodies cannot be "
                                "mapped (%s); bodies cross the link", meta["pid"], e)
                else:
                    self.send({"k": "shm", "i": 0})  # the front end may use it now
            self.d.hello.put_nowait(meta["pid"])

    def _header(self, meta: dict[str, Any]) -> None:
        i, model = meta["i"], meta["m"]
        decide_s = meta.get("d")  # the front end's bound on this decision, if it has one
        if decide_s is not None and time.monotonic() - meta["t"] >= decide_s:
            # too late to decide: the front end refuses it (`u` follows), counted here
            self._count_undecided(meta)
            return
        ask = self.d.refuse_early
        if ask is None or meta.get("v") not in (None, self.d.version):
            self.send({"k": "go", "i": i})  # the route answers it (404 for a wrong version)
            return
        try:
            # judged from its first byte: a header decided late (the loop behind, the
            # link's round trip) has that much less time left
            token = ask(model, time.monotonic() - meta["t"], hold=self.d.release is not None)
        except DStackError as e:
            if e.status_code == 404:  # the route answers it
                self.send({"k": "go", "i": i})
                return
            self.d.failed(model, e, "header", meta["t"])
            self.send(_standing_meta(i, e) if self.d.count_refused is not None
                      else _refusal_meta(i, e))
            return
        self.holds[i] = (model, token)  # (given back only where `release` is)
        self.send({"k": "go", "i": i})

    def _refused_standing(self, meta: dict[str, Any]) -> None:
        """`lr`: the front end refused `len(d)` requests for model `m` within a standing
        refusal (`no` meta), each `d[j]` s after its first byte."""
        model, e, took = meta["m"], error_of(meta), meta["d"]
        if self.d.count_refused is not None and e.rule is not None:  # as ever with `l`
            self.d.count_refused(model, e.rule, len(took))
        now = time.monotonic()
        for s in took:
            self.d.failed(model, e, "header", now - s)
        self.d.metrics.frontends_standing_refusals += len(took)

    def _count_undecided(self, meta: dict[str, Any]) -> None:
        """A request for `m` refused by its front end (`undecided_error`), the decision
        on its header not come within `d` s of its first byte `t`: counted as the
        dispatch core's refusals at the header are (a model it does not serve is not:
        the route would have answered 404)."""
        model, count = meta["m"], self.d.count_refused
        if count is None:
            return
        try:
            count(model, RefusalReason.WORK_AHEAD.value, 1)
        except KeyError:  # not a model it serves
            return
        # timed as the front end answered it: `d` after its first byte
        self.d.failed(model, undecided_error(model, meta["d"]), "header",
                      time.monotonic() - meta["d"])

    def _check(self, meta: dict[str, Any]) -> None:
        i, model = meta["i"], meta["m"]
        try:
            if self.d.refuse_early is not None:
                self.d.refuse_early(model, time.monotonic() - meta["t"])
        except DStackError as e:
            held = self.holds.pop(i, None)
            if held is not None:
                self._release(held)
            self.d.failed(model, e, "body", meta["t"])
            self.send(_refusal_meta(i, e))
            return
        self.send({"k": "go", "i": i})

    async def _answer_grpc(self, meta: dict[str, Any], payload: bytes | bytearray | memoryview
                           ) -> None:
        """`g`: the gRPC call `r` a front end received, answered by the servicer (its
        status code `c`, details `e`, trailing metadata `T`, and the response's bytes)."""
        at = meta.get("o")
        if at is not None and self.shared is not None:  # in the front end's shared memory
            payload = self.shared[at:at + meta["n"]]
            self.d.metrics.frontends_shared_bodies += 1
        if self.d.grpc is None:  # (front ends are told to serve gRPC only with one)
            code, details, trailing, out = 14, "gRPC is not served", [], b""
        else:
            try:
                code, details, trailing, out = await self.d.grpc.answer_linked(
                    meta["r"], payload, meta.get("P"), meta.get("A", ()), meta["t"])
            except Exception as e:  # noqa: BLE001 - the servicer answers its own; a bug
                log.exception("unhandled error in gRPC %s", meta["r"])
                code, details, trailing, out = 13, f"internal error: {e}", [], b""
        self.send({"k": "a", "i": meta["i"], "c": code, "e": details, "T": trailing}, out)

    async def _answer(self, meta: dict[str, Any], payload: bytes | bytearray | memoryview
                      ) -> None:
        i = meta["i"]
        at = meta.get("o")
        if at is not None and self.shared is not None:  # in the front end's shared memory
            payload = self.shared[at:at + meta["n"]]
            self.d.metrics.frontends_shared_bodies += 1
        status = 500
        headers: list[tuple[bytes, bytes]] = []
        chunks: list[bytes] = []
        given = False

        async def receive() -> Message:
            nonlocal given
            if given:  # as a connection still open: nothing more to read
                await asyncio.get_running_loop().create_future()
            given = True
            return {"type": "http.request", "body": payload, "more_body": False}

        async def send(msg: Message) -> None:
            nonlocal status, headers
            if msg["type"] == "http.response.start":
                status, headers = msg["status"], list(msg.get("headers", ()))
            elif msg["type"] == "http.response.body":
                chunks.append(msg.get("body", b""))

        scope: dict[str, Any] = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": meta.get("M", "POST"), "scheme": "http", "path": meta["p"],
            "raw_path": meta["p"].encode(), "query_string": meta.get("q", "").encode(),
            "root_path": "", "headers": [(k.encode("latin-1"), v.encode("latin-1"))
                                         for k, v in meta.get("H", ())],
            "client": (meta["c"], 0) if "c" in meta else None, "server": None, "state": {},
            RECEIVED_AT: meta.get("t"),
        }
        held = self.holds.pop(i, None)
        try:
            if meta["k"] == "b":
                if held is not None:
                    scope[HELD] = held
                await self.d.infer(scope, receive, send, meta["m"], meta.get("v"))
            else:
                await self.d.app(scope, receive, send)
        except Exception:  # noqa: BLE001 - the endpoint answers its own; this is a bug
            log.exception("unhandled error on %s %s", scope["method"], scope["path"])
            status, headers, chunks = 500, [], [b'{"error":"internal error"}']
        finally:
            left = scope.pop(HELD, None)
            if left is not None:
                self._release(left)
        self.send({"k": "a", "i": i, "s": status,
                   "H": [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers
                         if k != b"content-length"]},
                  chunks[0] if len(chunks) == 1 else b"".join(chunks))


# ---------------------------------------------------------------------- a front end's end


class SharedBody:
    """A body in a front end's `SharedBodies`: what the app is given as the body (its
    length is the body's); `free()` gives its space back (once the dispatch process is
    done with it), and so does its end when it never reached the dispatch process."""

    __slots__ = ("owner", "at", "size", "view")

    def __init__(self, owner: SharedBodies, at: int, size: int) -> None:
        self.owner, self.at, self.size = owner, at, size
        self.view = owner.view[at:at + size]

    def __len__(self) -> int:
        return self.size

    def free(self) -> None:
        if self.at >= 0:
            self.owner.give(self.at)
            self.at = -1

    __del__ = free


class SharedBodies:
    """A front end's shared memory for binary infer bodies (a memfd of `size` bytes), given
    out first fit: `store(n, scope)` is the connection's `body_store`; a body that does
    not fit, and every other body, is read into its own bytes and crosses the link."""

    ALIGN = 64

    def __init__(self, size: int) -> None:
        self.size = size
        self.enabled = False  # until the dispatch process says it has mapped it (`shm`)
        # `path`: where the dispatch process opens it (`map`)
        self.fd, self.path = memory_file("dstack-bodies", size)
        self.map = mmap.mmap(self.fd, size)
        self.view = memoryview(self.map)
        self.free_at: list[int] = [0]  # starts of the free runs, in order
        self.free_len: list[int] = [size]
        self.used: dict[int, int] = {}  # start -> length of each body given out

    @staticmethod
    def map(path: str, size: int) -> memoryview:
        """The dispatch process's read-only view of a front end's `SharedBodies`."""
        with open(path, "rb") as f:
            return memoryview(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ))

    def take(self, n: int) -> SharedBody | None:
        need = -(-max(n, 1) // self.ALIGN) * self.ALIGN
        for k, length in enumerate(self.free_len):
            if length >= need:
                at = self.free_at[k]
                if length == need:
                    del self.free_at[k], self.free_len[k]
                else:
                    self.free_at[k] += need
                    self.free_len[k] -= need
                self.used[at] = need
                return SharedBody(self, at, n)
        return None

    def give(self, at: int) -> None:
        length = self.used.pop(at, None)
        if length is None:  # (at the process's exit, its bodies go in any order)
            return
        if length >= TRIM_AFTER_BYTES:
            # A big body's pages go back to the OS, as the server's own big bodies' do
            # (`server.memory`): the run keeps its place, its pages are fresh when reused.
            first = -(-at // mmap.PAGESIZE) * mmap.PAGESIZE
            last = (at + length) // mmap.PAGESIZE * mmap.PAGESIZE
            self.map.madvise(mmap.MADV_REMOVE, first, last - first)
        k = bisect.bisect(self.free_at, at)
        if k < len(self.free_at) and at + length == self.free_at[k]:  # joins the next run
            length += self.free_len[k]
            del self.free_at[k], self.free_len[k]
        if k and self.free_at[k - 1] + self.free_len[k - 1] == at:  # ... and the one before
            self.free_len[k - 1] += length
        else:
            self.free_at.insert(k, at)
            self.free_len.insert(k, length)

    def store(self, n: int, scope: dict[str, Any]) -> tuple[SharedBody, memoryview] | None:
        """The connection's `body_store`: a binary infer body goes here while it fits."""
        if (not self.enabled or scope.get("method") != "POST"
                or INFER_PATH.match(scope["path"]) is None
                or not any(k == b"inference-header-content-length" for k, _ in scope["headers"])
                or any(k == b"content-encoding" for k, _ in scope["headers"])):  # decoded first
            return None
        body = self.take(n)
        return None if body is None else (body, body.view)


class StandingRefusals:
    """A front end's refusals at the header that stand (`l` on a `no`): `stand(key, reply,
    answer)` keeps one until `reply["l"]`; `answer(key, received)` gives it to a request for
    the same model and version meanwhile (None: ask), and has it told to the dispatch
    process (`lr`, within REPORT_S), with the time from the request's first byte."""

    def __init__(self, link: FrameReader) -> None:
        self.link = link
        self.standing: dict[tuple[str, str | None], tuple[float, Any, dict[str, Any]]] = {}
        self.untold: dict[tuple[str, str | None], tuple[dict[str, Any], list[float]]] = {}

    def stand(self, key: tuple[str, str | None], reply: dict[str, Any], answer: Any) -> None:
        until = reply.get("l")
        if until is not None:
            self.standing[key] = (until, answer, reply)

    def answer(self, key: tuple[str, str | None], received: float) -> Any:
        got = self.standing.get(key)
        if got is None:
            return None
        now = time.monotonic()
        until, answer, reply = got
        if now >= until:
            del self.standing[key]
            return None
        if not self.untold:
            asyncio.get_running_loop().call_later(REPORT_S, self.tell)
        untold = self.untold.get(key)
        if untold is None or untold[0] is not reply:
            if untold is not None:  # the model's earlier refusal: told as it was
                self._tell(key, *untold)
            untold = self.untold[key] = (reply, [])
        untold[1].append(now - received)
        return answer

    def hold_s(self, key: tuple[str, str | None]) -> float:
        """How long a refusal `answer` just gave for `key` is held before it is written:
        until it lapses, where the dispatch process holds its own (`h`: `Runtime.hold_s`)."""
        got = self.standing.get(key)
        if got is None or not got[2].get("h"):
            return 0.0
        return max(0.0, got[0] - time.monotonic())

    def tell(self) -> None:
        """Tell the dispatch process what was refused within standing refusals."""
        for key, (reply, took) in self.untold.items():
            self._tell(key, reply, took)
        self.untold.clear()

    def _tell(self, key: tuple[str, str | None], reply: dict[str, Any], took: list[float]
              ) -> None:
        self.link.send({**reply, "k": "lr", "i": 0, "m": key[0], "d": took})


#: What waits for the dispatch process's answer to one request: called with the answer's
#: meta and payload, or (None, b"") when the link is gone.
Waiter = Callable[[dict[str, Any] | None, bytes], None]

STOPPING = "the server is stopping"


class Link(FrameReader):
    """A front end's end of its link: `ask(meta, waiter, payload)` has `waiter` called with
    the dispatch process's answer to the request `meta["i"]`, `call` awaits it, `tell(meta)`
    wants none."""

    def __init__(self, on_lost: Callable[[], None], shared: SharedBodies | None = None) -> None:
        super().__init__()
        self.ids = itertools.count(1)
        self.waiting: dict[int, Waiter] = {}
        self.on_lost = on_lost
        self.shared = shared  # this front end's bodies, used once the dispatch process says

    def ask(self, meta: dict[str, Any], waiter: Waiter,
            payload: bytes | bytearray | memoryview = b"") -> bool:
        if self.transport is None or self.transport.is_closing():
            return False
        self.waiting[meta["i"]] = waiter
        self.send(meta, payload)
        return True

    def call(self, meta: dict[str, Any], payload: bytes | bytearray | memoryview = b"",
             then: Callable[[], None] | None = None
             ) -> Awaitable[tuple[dict[str, Any], bytes]]:
        """Ask and await the answer; `then()` runs when it comes (or the link is lost), if
        the caller has stopped waiting too."""
        fut: asyncio.Future[tuple[dict[str, Any], bytes]] = (
            asyncio.get_running_loop().create_future())

        def answered(reply: dict[str, Any] | None, out: bytes) -> None:
            if then is not None:
                then()
            if fut.done():
                return
            if reply is None:
                fut.set_exception(Unavailable(STOPPING))
            else:
                fut.set_result((reply, out))

        if not self.ask(meta, answered, payload):
            raise Unavailable(STOPPING)
        return fut

    tell = FrameReader.send

    def on_frame(self, meta: dict[str, Any], payload: bytes | bytearray) -> None:
        if meta["k"] == "shm" and self.shared is not None:
            self.shared.enabled = True
            return
        waiter = self.waiting.pop(meta["i"], None)
        if waiter is not None:
            try:
                waiter(meta, payload)  # type: ignore[arg-type]
            except Exception:  # noqa: BLE001 - one request's bug must not cut the link
                log.exception("unhandled error answering request %s", meta["i"])

    def connection_lost(self, exc: Exception | None) -> None:
        waiting, self.waiting = self.waiting, {}
        for waiter in waiting.values():
            waiter(None, b"")
        self.on_lost()
