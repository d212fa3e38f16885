"""Front ends in several processes (`server.frontends: N`, N > 1; docs/frontends.md).

On a GPU host the server's one Python process runs out before the device does: its loop
parses HTTP, refuses the requests it cannot take and answers the ones it took. With N front
ends, N processes accept the connections of the one listening socket (the kernel spreads
them), each with the server's connection limits, body limits, auth and TLS, and parse the
HTTP; the dispatch process (the one `dstack serve` started) keeps the runtime and every
decision about a model, so that refusals, holds, `/metrics` and the stats stay one count.
They talk over `server.link`. This module is the front end's side (its header check, app
and share of the body budget), the processes' start, restart and stop, and a front end's
`main`.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import mmap
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from dstack.common.errors import DStackError, Unavailable
from dstack.common.pauses import Lateness, count_lateness, prompt_gil_handoffs
from dstack.runtime.reading import RefusedShare
from server.app import read_body
from server.connection import ANSWER_LATER, LATER, RECEIVED_AT
from server.early import INFER_PATH, TooLate, checked_as_it_arrives
from server.limits import BodyBudget, error_json, refuse, retry_after
from server.link import (
    STOPPING,
    Link,
    SharedBodies,
    SharedBody,
    StandingRefusals,
    error_of,
    undecided_error,
)

log = logging.getLogger("dstack.server")


class DecisionBound:
    """`server.decision_timeout_ms` (`limit_s`) as a front end applies it: `now()`, the
    bound on the decision about a header asked now (0: wait for it), `limit_s` only while
    the server is refusing (`RefusedShare.refusing`, over the decisions told to `decided`;
    a decision the front end made itself, refusing a header not decided in time, is not one
    of them: it cannot keep the bound on by itself). Under overload that bound is what
    keeps a refusal fast when the deciding process's loop falls behind; at normal load a
    loop that falls behind now and then (a collection, a re-plan) only delays requests, as
    it would in one process, and refuses none."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.refusals = RefusedShare()

    def decided(self, refused: bool) -> None:
        self.refusals.decided(refused)

    def now(self) -> float:
        return self.limit_s if self.refusals.refusing else 0.0


class LinkHeaderCheck:
    """The front end's `server.connection.HeaderCheck`: an infer request's header asked
    about across the link (`h`) the moment it is parsed, with no task and no app; the
    connection reads nothing more until the answer (LATER). A refusal is written by the
    connection as the one-process server's `server.early.HeaderRefusal` writes it; a
    request let through goes to the app with its id on the link (`LINK_ID`), its place
    held. A refusal that stands (`StandingRefusals`) answers the model's next requests
    without asking, while it does. `bound` (`DecisionBound`: `server.decision_timeout_ms`
    while the server is refusing; none by default): a request not decided on within it of
    its first byte is refused here (`undecided_error`) and the dispatch process told (`u`:
    it gives back the place it held, if it let it through, and counts the refusal). Not
    asked (None: `FrontEndRefusal` asks): other routes, bodies over `max_body_bytes`,
    requests without the token where one is wanted."""

    def __init__(self, link: Link, *, max_body_bytes: int,
                 allowed: Callable[[str, list[tuple[bytes, bytes]]], bool] | None,
                 bound: DecisionBound | None = None) -> None:
        self.link = link
        self.max_body_bytes = max_body_bytes
        self.allowed = allowed
        self.bound = bound or DecisionBound(0.0)
        self.standing = StandingRefusals(link)

    def __call__(self, path: str, headers: list[tuple[bytes, bytes]], length: int,
                 scope: dict[str, Any]) -> object:
        m = INFER_PATH.match(path)
        if (m is None or length > self.max_body_bytes
                or (self.allowed is not None and not self.allowed(path, headers))):
            return None
        key = m.group(1), m.group(2)
        received = scope.get(RECEIVED_AT) or time.monotonic()
        standing = self.standing.answer(key, received)
        resume = scope[ANSWER_LATER]
        if standing is not None:
            self.bound.decided(True)
            hold_s = self.standing.hold_s(key)
            if hold_s > 0:  # paced, as the dispatch process paces its own
                asyncio.get_running_loop().call_later(hold_s, resume, standing)
                return LATER
            return standing
        i = next(self.link.ids)
        timer: asyncio.TimerHandle | None = None
        decide_s = self.bound.now()

        def answered(reply: dict[str, Any] | None, _: bytes) -> None:
            if timer is not None:
                timer.cancel()
            if reply is None:
                e: DStackError = Unavailable(STOPPING)
                e.retry_after_s = 1.0
            elif reply["k"] == "go":
                self.bound.decided(False)
                scope[LINK_ID] = i
                if not resume(None):  # the client has gone meanwhile
                    self.link.tell({"k": "r", "i": i})
                return
            else:
                self.bound.decided(True)
                e = error_of(reply)
            answer = _refusal_answer(e)
            if reply is not None:
                self.standing.stand(key, reply, answer)
            if e.hold_s > 0:  # paced (`Runtime.hold_s`)
                asyncio.get_running_loop().call_later(e.hold_s, resume, answer)
            else:
                resume(answer)

        if not self.link.ask(_header_meta(i, *key, received, decide_s), answered):
            return None
        if decide_s > 0:
            timer = asyncio.get_running_loop().call_later(
                max(0.0, received + decide_s - time.monotonic()),
                self._undecided, i, key[0], received, decide_s, resume)
        return LATER

    def _undecided(self, i: int, model: str, received: float, decide_s: float,
                   resume: Callable[[Any], bool]) -> None:
        if self.link.waiting.pop(i, None) is None:  # answered meanwhile
            return
        self.link.tell({"k": "u", "i": i, "m": model, "t": received, "d": decide_s})
        resume(_refusal_answer(undecided_error(model, decide_s)))


def _header_meta(i: int, model: str, version: str | None, received: float,
                decide_s: float) -> dict[str, Any]:
    """The `h` asking about request `i`'s header; with the front end's bound on the
    decision, if it has one (`d`: the dispatch process reading it later does not decide)."""
    meta = {"k": "h", "i": i, "m": model, "v": version, "t": received}
    if decide_s > 0:
        meta["d"] = decide_s
    return meta


def _refusal_answer(e: DStackError) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """What the connection writes for a refusal at the header (as `server.early` does)."""
    return (e.status_code, [(b"content-type", b"application/json"), *retry_after(e)],
            error_json(e.message, e.rule))


#: A front end's shared memory for binary infer bodies (`server.link.SharedBodies`), at
#: most: its pages are the OS's until a body is first read into them. (The body budget,
#: if smaller, bounds it too.)
SHARED_BODIES_BYTES = 64 << 20


#: The scope key the front end's header check sets to the request's id on the link when
#: the dispatch process let it through with a hold; popped when its body is sent (`b`).
LINK_ID = "dstack.link_id"


class FrontEnd:
    """The front end's ASGI app (innermost: inside `BodyLimits`, `FrontEndRefusal` and
    `BearerAuth`): infer requests' bodies go to the dispatch process as `b`, every other
    request whole as `x`."""

    def __init__(self, link: Link, max_body_bytes: int) -> None:
        self.link = link
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        i = next(self.link.ids)
        m = INFER_PATH.match(scope["path"]) if scope["method"] == "POST" else None
        try:
            body = await read_body(scope, receive, self.max_body_bytes)  # whole: BodyLimits
        except DStackError as e:  # a client gone mid-body
            await refuse(scope, send, e.status_code, e.message)
            return
        # A binary infer body in shared memory (`SharedBodies.store` takes no other): it
        # goes as where it lies, and its space is given back at the answer (`call`'s
        # `then`), when the dispatch process is done with it.
        shared = body if isinstance(body, SharedBody) else None
        if m is not None:
            meta = {"k": "b", "i": scope.pop(LINK_ID, i), "m": m.group(1), "v": m.group(2),
                    "p": scope["path"], "t": scope.get(RECEIVED_AT) or time.monotonic(),
                    "H": [(k.decode("latin-1"), v.decode("latin-1"))
                          for k, v in scope["headers"] if k == b"inference-header-content-length"]}
            if shared is not None:
                meta["o"], meta["n"], body = shared.at, shared.size, b""
        else:
            meta = {"k": "x", "i": i, "M": scope["method"], "p": scope["path"],
                    "q": scope["query_string"].decode("latin-1"),
                    "H": [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]}
        client = scope.get("client")
        if client:  # whose shared memory the request may name (`server.shm`)
            meta["c"] = client[0]
        try:
            reply, out = await self.link.call(meta, body,
                                              None if shared is None else shared.free)
        except DStackError as e:
            await refuse(scope, send, e.status_code, e.message)
            return
        await send({"type": "http.response.start", "status": reply["s"], "headers": [
            (b"content-length", str(len(out)).encode()),
            *((k.encode("latin-1"), v.encode("latin-1")) for k, v in reply["H"])]})
        await send({"type": "http.response.body", "body": out})


class FrontEndRefusal:
    """`server.early.EarlyRefusal` across the link: the header of `POST .../infer` asked
    about (`h`) before its body is read, and again (`c`) each CHECK_EVERY_BYTES while it
    arrives; a refusal answered with the same status, body and `Retry-After`, and the rest
    of its body dropped by the connection. A header not decided on within `bound` of its
    first byte is refused here, as `LinkHeaderCheck` refuses one."""

    def __init__(self, app: ASGIApp, link: Link, *, bound: DecisionBound | None = None) -> None:
        self.app = app
        self.link = link
        self.bound = bound or DecisionBound(0.0)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        m = None
        if scope["type"] == "http" and scope["method"] == "POST":
            m = INFER_PATH.match(scope["path"])
        if m is None:
            await self.app(scope, receive, send)
            return
        model = m.group(1)
        received = scope.get(RECEIVED_AT) or time.monotonic()
        i = scope.get(LINK_ID)
        if i is None:  # not asked by the connection (LinkHeaderCheck): asked here
            i = next(self.link.ids)
            decide_s = self.bound.now()
            try:
                async with asyncio.timeout(max(0.0, received + decide_s - time.monotonic())
                                           if decide_s else None):
                    reply, _ = await self.link.call(
                        _header_meta(i, model, m.group(2), received, decide_s))
            except DStackError as e:
                await refuse(scope, send, e.status_code, e.message)
                return
            except TimeoutError:
                self.link.waiting.pop(i, None)  # (its late answer, if any, finds no one)
                self.link.tell({"k": "u", "i": i, "m": model, "t": received, "d": decide_s})
                await self._refuse(scope, send, undecided_error(model, decide_s))
                return
            self.bound.decided(reply["k"] == "no")
            if reply["k"] == "no":
                await self._refuse(scope, send, error_of(reply))
                return
            scope[LINK_ID] = i
        try:
            await self.app(scope, self._watched(receive, i, model, received), send)
        except TooLate as late:
            await self._refuse(scope, send, late.error)
        finally:
            if scope.pop(LINK_ID, None) is not None:  # its body never went: give the hold back
                self.link.tell({"k": "r", "i": i})

    async def _refuse(self, scope: Scope, send: Send, e: DStackError) -> None:
        await refuse(scope, send, e.status_code, e.message, headers=retry_after(e),
                     reason=e.rule)

    def _watched(self, receive: Receive, i: int, model: str, received: float) -> Receive:
        async def check() -> DStackError | None:  # `c`, across the link
            reply, _ = await self.link.call({"k": "c", "i": i, "m": model, "t": received})
            return error_of(reply) if reply["k"] == "no" else None

        return checked_as_it_arrives(receive, check)


class SharedBodyBudget(BodyBudget):
    """`server.body_budget_bytes` across the front ends: a file of one 8-byte count per
    front end, mapped by each, summed under a lock (`flock`) when a front end takes bytes,
    so that the bodies held by all of them together stay within the limit. A front end
    writes only its own count; the dispatch process zeroes a dead one's before restarting it."""

    def __init__(self, limit_bytes: int, path: Path, slot: int) -> None:  # noqa: D107
        self.limit_bytes = limit_bytes
        self._fd = os.open(path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, 0)
        self._n = len(self._map) // 8
        self._at = 8 * slot

    @staticmethod
    def create(path: Path, slots: int) -> None:
        path.write_bytes(bytes(8 * slots))

    @staticmethod
    def clear(path: Path, slot: int) -> None:
        with path.open("r+b") as f:
            f.seek(8 * slot)
            f.write(bytes(8))

    @property  # type: ignore[override]
    def used_bytes(self) -> int:
        return sum(struct.unpack_from(f"<{self._n}q", self._map))

    def _add(self, n: int) -> None:
        (mine,) = struct.unpack_from("<q", self._map, self._at)
        struct.pack_into("<q", self._map, self._at, mine + n)

    def take(self, n: int) -> bool:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            if self.used_bytes + n > self.limit_bytes:
                return False
            self._add(n)
            return True
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def give(self, n: int) -> None:
        self._add(-n)


async def report_lateness(link: Link, every_s: float = 1.0) -> None:
    """Count how late this front end's loop timer fires (as the dispatch process counts its
    own) and tell the dispatch process each `every_s` what was counted meanwhile (`late`),
    for /metrics' `dstack_frontend_loop_late_seconds`."""
    late, told = Lateness(), Lateness()
    ticking = asyncio.create_task(count_lateness(late))
    try:
        while True:
            await asyncio.sleep(every_s)
            new = late.since(told)
            told.merge(new)
            link.tell({"k": "late", "i": 0, "c": new.counts, "s": new.sum_s})
    finally:
        ticking.cancel()


# ---------------------------------------------------------------------- processes


class FrontEnds:
    """The dispatch process's front-end processes: started on `sock` (inherited), each
    restarted when it dies unexpectedly, stopped with SIGTERM (each drains its requests
    within the grace period, as one server does)."""

    def __init__(self, n: int, config: Path, sock_fd: int, folder: Path,
                 cores: tuple[int, ...] | None, grpc_address: str | None = None) -> None:
        self.n = n
        self.budget = folder / "budget"
        SharedBodyBudget.create(self.budget, n)
        self.argv = [sys.executable, "-m", "server.frontends", "--config", str(config),
                     "--fd", str(sock_fd), "--link", str(folder / "link"), "--of", str(n),
                     "--budget", str(self.budget)]
        if cores:
            self.argv += ["--cores", ",".join(map(str, cores))]
        if grpc_address:  # each front end listens there too (`FrontEndGrpc`)
            self.argv += ["--grpc", grpc_address]
        self.fd = sock_fd
        self.procs: list[subprocess.Popen[bytes]] = []
        self.stopping = False

    def _start(self, k: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen([*self.argv, "--slot", str(k)], pass_fds=(self.fd,))

    async def start(self, hello: asyncio.Queue[int], timeout_s: float) -> None:
        """All started and ready (each said hello); RuntimeError when one exits first or
        they are not ready in `timeout_s`."""
        self.procs = [self._start(k) for k in range(self.n)]
        deadline = time.monotonic() + timeout_s
        ready = 0
        while ready < self.n:
            exited = [p.returncode for p in self.procs if p.poll() is not None]
            if exited:
                raise RuntimeError(f"a front end exited as it started (exit code "
                                   f"{exited[0]}; its error is above)")
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"front ends not ready in {timeout_s:g} s")
            try:
                await asyncio.wait_for(hello.get(), min(0.2, left))
                ready += 1
            except TimeoutError:
                continue

    async def watch(self) -> None:
        """Restart a front end that died (its link's holds are given back as it closes)."""
        while not self.stopping:
            await asyncio.sleep(0.2)
            for k, p in enumerate(self.procs):
                if p.poll() is not None and not self.stopping:
                    log.warning("front end %d (pid %d) exited with %s; starting another",
                                k, p.pid, p.returncode)
                    SharedBodyBudget.clear(self.budget, k)  # what it held went with it
                    self.procs[k] = self._start(k)

    async def stop(self, grace_s: float) -> None:
        self.stopping = True
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s + 5
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def main(argv: list[str] | None = None) -> int:
    """A front-end process (started by the dispatch process, not by hand)."""
    import argparse

    import uvicorn

    from dstack.common.config import decision_timeout_s, load_config
    from dstack.common.pauses import freeze_startup_objects
    from dstack.common.slices import pin_threads
    from server.auth import BearerAuth, header_allows, load_token
    from server.connection import raise_fd_limit, server_config
    from server.limits import BodyLimits
    from server.memory import steady_server_heap

    p = argparse.ArgumentParser(prog="python -m server.frontends")
    p.add_argument("--config", required=True)
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--link", required=True)
    p.add_argument("--of", type=int, required=True)
    p.add_argument("--budget", required=True)
    p.add_argument("--slot", type=int, required=True)
    p.add_argument("--cores", default=None)
    p.add_argument("--grpc", default=None, help="HOST:PORT to serve gRPC on")
    args = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the dispatch process says when to stop
    steady_server_heap()  # malloc's thresholds as `dstack serve` fixes them for itself
    cfg = load_config(args.config)
    prompt_gil_handoffs(cfg.server.switch_interval_ms / 1000)  # as the dispatch process
    logging.basicConfig(level=cfg.server.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.cores:
        pin_threads(tuple(int(c) for c in args.cores.split(",")))
    s = cfg.server
    share = -(-s.max_connections // args.of)
    s = s.model_copy(update={"max_connections": share})
    raise_fd_limit(share)
    sock = socket.socket(fileno=args.fd)
    bodies = SharedBodies(min(s.body_budget_bytes, SHARED_BODIES_BYTES))
    # (when the dispatch process is gone, this front end stops)
    link = Link(lambda: setattr(server, "should_exit", True), bodies)
    app: ASGIApp = FrontEnd(link, s.max_body_bytes)
    app = BodyLimits(app, max_body_bytes=s.max_body_bytes, budget=SharedBodyBudget(
        s.body_budget_bytes, Path(args.budget), args.slot))
    bound = DecisionBound(decision_timeout_s(cfg))
    app = FrontEndRefusal(app, link, bound=bound)
    token = load_token(s)
    if token is not None:
        app = BearerAuth(app, token=token, open_paths=s.auth_open_paths)
    check = LinkHeaderCheck(link, max_body_bytes=s.max_body_bytes,
                            allowed=header_allows(token, s.auth_open_paths),
                            bound=bound)
    config = server_config(app, s, header_check=check, body_store=bodies.store)
    config.lifespan = "off"
    grpc = None
    if args.grpc:
        from server.grpc_server import FrontEndGrpc

        host, _, port = args.grpc.rpartition(":")
        grpc = FrontEndGrpc(link, s, host.strip("[]"), int(port))

    class _FrontEndServer(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            loop = asyncio.get_running_loop()
            await loop.create_unix_connection(lambda: link, args.link)
            if grpc is not None:
                grpc.bind()
                await grpc.start()
            await super().startup(sockets)
            freeze_startup_objects()
            link.tell({"k": "hello", "i": 0, "pid": os.getpid(), "shm": bodies.path,
                       "shm_bytes": bodies.size})
            self.late_task = loop.create_task(report_lateness(link))

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            check.standing.tell()  # what stood and was not told yet: counted
            if grpc is None:
                await super().shutdown(sockets)
            else:  # both drain together, within the same grace
                await asyncio.gather(super().shutdown(sockets),
                                     grpc.stop(self.config.timeout_graceful_shutdown or 0.0))

    server = _FrontEndServer(config)
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())

