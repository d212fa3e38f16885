"""Refusing an infer request from its headers, before its body is read.

Under overload most requests are refused, and on a small machine receiving and decoding
their bodies (a 600 KB binary tensor for one 224x224 image) takes the cores the workers
need. The model is in the URL; a backend that can say whether a request of one item would
be refused now (`refuse_early(model)`, raising the `DStackError` it would be answered
with) is asked before anything reads the body: a refusal is answered at once, with the
same status, JSON body (`error`, `reason`) and `Retry-After` as a refusal after the body.

The connection is kept: once the answer is complete the connection drops the rest of the
body (`server.connection`: in the kernel, or through the parser over TLS), so a client that
sends its whole body before reading (requests, tritonclient, aiohttp) reads the 429 rather
than a reset, and its next request reuses the connection. A client that asked to close the
connection after the answer (urllib sends `Connection: close`) gets its answer and the
connection closes once the rest of its body has been dropped: closing with its bytes unread
would reset the connection mid-upload.
A request whose batch turns out to be bigger than one item is checked again, whole, when
it is admitted.

A body still arriving is checked again every `CHECK_EVERY_BYTES` (`refuse_early(model,
since_s)`, since_s counted from the request's first byte): a request whose deadline has
gone by while its body was being received (60 MB takes longer to arrive than a 60 ms SLO)
is refused then, the same way, and the rest of its body is dropped as it comes instead of
being copied, held and parsed only to be refused.

`HeaderRefusal` asks the same question from the connection itself
(`server.connection.LimitedHttpToolsProtocol`), the moment a request's header has been
parsed: a refusal is written there and then, with no task, no ASGI call and no app, and
the body the client sends anyway is dropped in the kernel. Under overload, where most
requests are refused, that is most of the server's work per request. The connection
does not ask about a chunked or pipelined request or one with `Expect: 100-continue`:
this middleware asks about those, as before. What the connection asked about and let
through is not asked about again here. A request it lets through holds a place in its
model's queue while its body is read (`HELD`), so that the requests whose headers come
meanwhile are checked with it counted.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dstack.common.errors import DStackError, ModelNotFound
from server.connection import ANSWER_LATER, ASKED_AT_HEADER, LATER, RECEIVED_AT, Answer
from server.limits import error_json, refuse, retry_after

log = logging.getLogger("dstack.server")

#: POST /v2/models/{model}[/versions/{version}]/infer: the model, the version or None.
INFER_PATH = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+))?/infer$")

#: Bytes of a body read between two checks of its deadline while it arrives. (A body of
#: up to `server.connection.WHOLE_BODY_BYTES`, no more than this, comes in one message.)
CHECK_EVERY_BYTES = 1 << 20

#: The scope key `HeaderRefusal` sets (to the model and the token `refuse_early` gave) when
#: it let a request through with a hold on the model's queue (`Runtime.refuse_early(hold=
#: True)`): the request counts as queued, and its body as being read, until it is back.
#: Whoever pops it releases the hold (`release(model, token)`):
#: the infer route just before it asks about the request's real batch, else
#: `EarlyRefusal` when the request is over, however it ended.
HELD = "dstack.held"


#: `failed(model, error, stage, received_at)`: an infer request answered with a
#: DStackError, counted (and a refusal timed) as `server.metrics.Metrics.failed` does.
Failed = Callable[[str, DStackError, str, float | None], None]


class TooLate(Exception):
    """Raised out of a body's reading: `error` is the refusal it is answered with."""

    def __init__(self, error: DStackError) -> None:
        super().__init__(error.message)
        self.error = error


class EarlyRefusal:
    """ASGI middleware: `refuse_early(model)` before the body of `POST .../infer` is read,
    `refuse_early(model, since_s)` while it arrives; `failed(model, error, stage,
    received_at)` counts and times each refusal answered here (`server.metrics.Metrics.
    failed`, which the infer route feeds, so that stats and metrics count them as any)."""

    def __init__(self, app: ASGIApp, *, refuse_early: Callable[..., object],
                 failed: Failed, version: str,
                 release: Callable[..., None] | None = None) -> None:
        self.app = app
        self.refuse_early = refuse_early
        self.release = release
        self.failed = failed
        self.version = version

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            m = INFER_PATH.match(scope["path"])
            if m is not None and m.group(2) in (None, self.version):
                model = m.group(1)
                try:
                    if not scope.get(ASKED_AT_HEADER):  # else asked by the connection already
                        self.refuse_early(model, _since(scope))
                except ModelNotFound:
                    pass  # the route answers it (404), as without this middleware
                except DStackError as e:
                    await self._refuse(scope, send, model, e, "header")
                    return
                else:
                    try:
                        await self.app(scope, self._watched(scope, receive, model), send)
                    except TooLate as late:
                        await self._refuse(scope, send, model, late.error, "body")
                    finally:
                        held = scope.pop(HELD, None)
                        if held is not None and self.release is not None:
                            self.release(*held)
                    return
        await self.app(scope, receive, send)

    async def _refuse(self, scope: Scope, send: Send, model: str,
                      e: DStackError, stage: str) -> None:
        _counted(self.failed, model, e, stage, scope.get(RECEIVED_AT))
        if e.hold_s > 0:  # paced: `Runtime.hold_s`
            await asyncio.sleep(e.hold_s)
        await refuse(scope, send, e.status_code, e.message, headers=retry_after(e),
                     reason=e.rule)

    def _watched(self, scope: Scope, receive: Receive, model: str) -> Receive:
        """`receive`, asking `refuse_early(model, since_s)` as the body arrives."""
        received = scope.get(RECEIVED_AT) or time.monotonic()

        async def check() -> DStackError | None:
            try:
                self.refuse_early(model, time.monotonic() - received)
            except DStackError as e:
                return e
            return None

        return checked_as_it_arrives(receive, check)


def checked_as_it_arrives(receive: Receive,
                          check: Callable[[], Awaitable[DStackError | None]]) -> Receive:
    """`receive`, awaiting `check()` each time another CHECK_EVERY_BYTES of the body have
    come while more is to come; the refusal it returns is raised as TooLate, out of the
    body's reading (nothing has been answered yet)."""
    unchecked = 0

    async def watched() -> Message:
        nonlocal unchecked
        msg = await receive()
        if msg.get("more_body", False):
            unchecked += len(msg.get("body", b""))
            if unchecked >= CHECK_EVERY_BYTES:
                unchecked = 0
                refusal = await check()
                if refusal is not None:
                    raise TooLate(refusal)
        return msg

    return watched


class HeaderRefusal:
    """`refuse_early(model)` for an infer request whose header has just been parsed, asked
    by the connection (`LimitedHttpToolsProtocol.refuse_at_header`): the answer to write,
    counted as EarlyRefusal counts it, or None to leave the request to the app (not an
    infer route of this version, an unknown model, a body over `max_body_bytes`, no token
    where `allowed` wants one, or nothing to refuse)."""

    def __init__(self, *, refuse_early: Callable[..., int | None],
                 failed: Failed, version: str, max_body_bytes: int,
                 allowed: Callable[[str, list[tuple[bytes, bytes]]], bool] | None = None,
                 hold: bool = False) -> None:
        self.refuse_early = refuse_early
        self.failed = failed
        self.version = version
        self.max_body_bytes = max_body_bytes
        self.allowed = allowed
        self.hold = hold  # let through with a hold on the queue (HELD)

    def __call__(self, path: str, headers: list[tuple[bytes, bytes]], length: int,
                 scope: dict[str, Any] | None = None) -> Answer | None:
        m = INFER_PATH.match(path)
        if (m is None or m.group(2) not in (None, self.version) or length > self.max_body_bytes
                or (self.allowed is not None and not self.allowed(path, headers))):
            return None
        model = m.group(1)
        hold = self.hold and scope is not None
        token = None
        since_s = 0.0 if scope is None else _since(scope)
        try:
            if hold:
                token = self.refuse_early(model, since_s, hold=True)
            else:
                self.refuse_early(model, since_s)
        except ModelNotFound:
            return None  # the route answers it (404)
        except DStackError as e:
            _counted(self.failed, model, e, "header",
                     None if scope is None else scope.get(RECEIVED_AT))
            answer = (e.status_code, [(b"content-type", b"application/json"),
                                      *retry_after(e)], error_json(e.message, e.rule))
            later = None if scope is None else scope.get(ANSWER_LATER)
            if e.hold_s > 0 and later is not None:  # paced: `Runtime.hold_s`
                asyncio.get_running_loop().call_later(e.hold_s, later, answer)
                return LATER  # type: ignore[return-value]
            return answer
        if hold:
            scope[HELD] = (model, token)  # type: ignore[index]
        return None


def _since(scope: Scope | dict[str, Any]) -> float:
    """How long ago the request's first byte came (0 where the connection did not say)."""
    received = scope.get(RECEIVED_AT)
    return 0.0 if received is None else max(0.0, time.monotonic() - received)


def _counted(failed: Failed, model: str, e: DStackError, stage: str,
             received_at: float | None) -> None:
    failed(model, e, stage, received_at)
    if e.status_code >= 500 and not e.logged:  # as the app's handler does
        log.warning("%s: %s", type(e).__name__, e.message)
