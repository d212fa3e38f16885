"""The chaos benchmark's load client (`bench.chaos_load.LeanClient`) against a real uvicorn with the
server's protocol: answers parsed whole, refusals read with their headers, connections
reused, a server that closes or does not answer reported as such."""

from __future__ import annotations

import asyncio
import http.client
import json
import time

import pytest

from bench.chaos_load import LeanClient
from dstack.runtime.dispatch import RefusalReason
from dstack.runtime.serving import refusal_error
from tests.e2e.test_connection_cap import _closed_by_server, _still_open
from tests.integration.test_early_refusal import VALID, _serving

HEADERS = {"content-type": "application/json"}


def test_answers_refusals_reuse_and_fresh_connections() -> None:
    with _serving() as ((host, port), backend):
        base = f"http://{host}:{port}"

        async def go() -> None:
            client = LeanClient(base)
            req = client.post("/v2/models/double/infer", VALID, HEADERS)
            status, body, _ = await client.send(req, 5)
            assert status == 200 and json.loads(body)["outputs"][0]["data"] == [2, 4, 6]
            err = refusal_error(RefusalReason.QUEUE_FULL, "model double: full")
            err.retry_after_s = 2
            backend.refusal = err
            try:
                status, body, headers = await client.send(req, 5)
            finally:
                backend.refusal = None
            assert status == 429 and json.loads(body)["reason"] == "queue_full"
            assert headers["retry-after"] == "2"
            assert len(client.idle) == 1  # both on one kept-alive connection
            close = client.post("/v2/models/double/infer", VALID,
                                {**HEADERS, "connection": "close"})
            assert (await client.send(close, 5))[0] == 200
            assert client.idle == []  # the server closed it: not reused
            assert (await client.send(req, 5))[0] == 200  # a new one is opened
            client.close()
            fresh = LeanClient(base, fresh=True)
            assert (await fresh.send(req, 5))[0] == 200
            assert fresh.idle == []

        asyncio.run(go())


def test_a_request_not_answered_in_time_is_a_timeout() -> None:
    with _serving() as ((host, port), _):

        async def go() -> None:
            client = LeanClient(f"http://{host}:{port}")
            # a body declared longer than sent: the server waits for the rest
            req = client.post("/v2/models/double/infer", VALID, HEADERS).replace(
                f"content-length: {len(VALID)}".encode(),
                f"content-length: {len(VALID) + 10}".encode())
            with pytest.raises(TimeoutError):
                await client.send(req, 0.3)
            assert client.idle == []  # that connection is closed, not reused

        asyncio.run(go())


def test_a_connection_the_server_closed_while_idle_is_not_used_again() -> None:
    """uvicorn closes a kept-alive connection idle for its keep-alive timeout: the next
    request goes on a new connection, not into the closed one (where no answer comes)."""
    with _serving() as ((host, port), _):

        async def go() -> None:
            client = LeanClient(f"http://{host}:{port}")
            req = client.post("/v2/models/double/infer", VALID, HEADERS)
            assert (await client.send(req, 5))[0] == 200
            (idle,) = client.idle
            assert idle.transport is not None
            idle.transport.close()  # as the server's close would end it
            await asyncio.sleep(0.05)
            assert idle.lost
            assert (await client.send(req, 2))[0] == 200
            assert client.idle and client.idle[0] is not idle

        asyncio.run(go())


@pytest.mark.parametrize("keep_alive_s", [0.3, None])
def test_an_idle_kept_alive_connection_is_closed_after_keep_alive_s(
        keep_alive_s: float | None) -> None:
    """`server.keep_alive_s` closes a connection idle between requests that long; by
    default it outlasts uvicorn's own 5 s (and clients' pools, which then drop it first)."""
    server = {} if keep_alive_s is None else {"keep_alive_s": keep_alive_s}
    with _serving(server=server) as ((host, port), _):
        conn = http.client.HTTPConnection(host, port, timeout=5)
        conn.request("POST", "/v2/models/double/infer", VALID, HEADERS)
        assert conn.getresponse().read() and conn.sock is not None
        if keep_alive_s:
            assert _closed_by_server(conn.sock, wait_s=3.0) == b""
        else:
            time.sleep(6.0)
            assert _still_open(conn.sock)
        conn.close()
