"""The connection cap against a real `dstack serve` process (docs/limits.md): at the cap
a new connection closes the one that has waited longest for a request header; only when
every connection is inside a request is the new one refused with 503."""

from __future__ import annotations

import http.client
import json
import socket
import time
from pathlib import Path

import pytest

from tests.e2e.server_process import TINY, ServerProcess

CAP = 20
HEADER_TIMEOUT_S = 30  # long: what closes a socket here is the cap, never the timer
BODY_TIMEOUT_S = 10
INFER = "/v2/models/tiny_cnn/infer"
BODY = json.dumps({"inputs": [{"name": "input", "shape": [1, 3, 32, 32], "datatype": "FP32",
                               "data": [0.5] * 3072}]}).encode()


def server_config(tmp_path: Path) -> dict:
    """This module's server (tests/e2e/conftest.py `module_server`)."""
    return {"policy": "shared", "models": [TINY], "server": {
        "header_timeout_s": HEADER_TIMEOUT_S, "body_timeout_s": BODY_TIMEOUT_S,
        "max_connections": CAP}}


@pytest.fixture(scope="module")
def srv(module_server: ServerProcess) -> ServerProcess:
    return module_server


def _settle(srv: ServerProcess) -> None:
    """Wait until the server holds no client connection from an earlier test."""
    base = None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            n = srv.fds()
        except FileNotFoundError:  # a socket closed while they were being listed
            n = None
        if n == base:
            return
        base = n
        time.sleep(0.3)


def _open(srv: ServerProcess, first_bytes: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    if first_bytes:
        s.sendall(first_bytes)
    time.sleep(0.02)  # accepted (and its header timer armed) in this order
    return s


def _half_headers(srv: ServerProcess, n: int) -> list[socket.socket]:
    return [_open(srv, f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Le".encode())
            for _ in range(n)]


def _closed_by_server(s: socket.socket, wait_s: float = 2.0) -> bytes | None:
    """What the server sent before closing `s` (b"" for a bare close); None if `s` is
    still open after `wait_s`."""
    s.settimeout(wait_s)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return out


def _still_open(s: socket.socket) -> bool:
    return _closed_by_server(s, wait_s=0.05) is None


def _infer(conn: http.client.HTTPConnection) -> int:
    conn.request("POST", INFER, body=BODY, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    r.read()
    return r.status


def _close_all(socks: list[socket.socket]) -> None:
    for s in socks:
        s.close()


def test_at_the_cap_a_new_client_closes_the_oldest_half_sent_header(
        srv: ServerProcess) -> None:
    _settle(srv)
    stalled = _half_headers(srv, CAP)
    clients = [http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10) for _ in range(5)]
    try:
        for c in clients:  # each a new connection, kept alive after its answer
            assert _infer(c) == 200  # before: 503 "too many open connections"
        for s in stalled[:5]:  # the five oldest made room, told why
            raw = _closed_by_server(s)
            assert raw is not None and raw.startswith(b"HTTP/1.1 503"), raw
            assert b"retry-after: 1" in raw.lower()
            assert "make room" in json.loads(raw.split(b"\r\n\r\n", 1)[1])["error"]
        assert all(_still_open(s) for s in stalled[5:])
        # Now the oldest waiting are stalled[5:], older than the five idle kept-alive
        # clients: a sixth client closes stalled[5] and none of theirs.
        extra = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
        clients.append(extra)
        assert _infer(extra) == 200
        assert _closed_by_server(stalled[5]) is not None
        assert all(_still_open(s) for s in stalled[6:])
        for c in clients[:5]:  # the same connections serve their next request
            assert _infer(c) == 200
    finally:
        _close_all(stalled)
        for c in clients:
            c.close()


def test_idle_kept_alive_connections_make_room_oldest_first(srv: ServerProcess) -> None:
    _settle(srv)
    idle = [http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10) for _ in range(CAP)]
    try:
        for c in idle:
            assert _infer(c) == 200
            time.sleep(0.02)
        fresh = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
        idle.append(fresh)
        assert _infer(fresh) == 200
        # The first idle one was closed without a word (nothing of a request was sent):
        # its next recv sees the close.
        assert _closed_by_server(idle[0].sock) == b""
        assert all(_still_open(c.sock) for c in idle[1:CAP])
    finally:
        for c in idle:
            c.close()


def test_when_every_connection_is_inside_a_request_a_new_one_gets_503(
        srv: ServerProcess) -> None:
    _settle(srv)
    # Uploads that sent their header and part of their body, then stall: inside a request
    # until the body timeout.
    uploads = [_open(srv, f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                          f"\r\nContent-Length: {len(BODY)}\r\n\r\n".encode() + BODY[:100])
               for _ in range(CAP)]
    try:
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", srv.port), timeout=BODY_TIMEOUT_S / 2) as s:
            raw = _closed_by_server(s, wait_s=BODY_TIMEOUT_S / 2)
        assert raw is not None and raw.startswith(b"HTTP/1.1 503"), raw
        assert time.monotonic() - t0 < BODY_TIMEOUT_S / 2  # at once, not by a timer
        assert b"retry-after: 1" in raw.lower()
        assert "too many open connections" in json.loads(raw.split(b"\r\n\r\n", 1)[1])["error"]
        assert all(_still_open(u) for u in uploads)  # none of them was closed for it
        uploads[0].settimeout(10)  # and it is still served when its body comes
        uploads[0].sendall(BODY[100:])
        raw = uploads[0].recv(65536)
        assert raw.startswith(b"HTTP/1.1 200"), raw
    finally:
        _close_all(uploads)
    _settle(srv)
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    assert _infer(conn) == 200
    conn.close()
