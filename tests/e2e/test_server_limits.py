"""Read timeouts, body size and budget limits, bearer auth and answers' Server-Timing, each
checked against a real `dstack serve` process (docs/limits.md). The connection cap:
test_connection_cap.py."""

from __future__ import annotations

import gzip
import http.client
import json
import re
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.e2e.server_process import TINY, ServerProcess, launch, wait_ready

TOKEN = "e2e-secret-token-4f1c"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_BODY = 256 * 1024
BUDGET = 512 * 1024
HEADER_TIMEOUT_S = 2
BODY_TIMEOUT_S = 3
MAX_CONNECTIONS = 40
INFER = "/v2/models/tiny_cnn/infer"


@pytest.fixture(scope="module")
def servers(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
            ) -> Iterator[dict[int, ServerProcess]]:
    """Both servers of `srv`, started together (a start keeps one core busy: two starting at
    once on two cores are ready in about the time of one)."""
    wanted = {item.callspec.params["srv"] for item in request.session.items  # type: ignore[attr-defined]
              if item.module is request.module and "srv" in getattr(item, "callspec", {}).params}  # type: ignore[attr-defined]
    started: dict[int, ServerProcess] = {}
    try:
        for n in sorted(wanted):
            tmp = tmp_path_factory.mktemp("limits")
            (tmp / "token").write_text(TOKEN + "\n")
            started[n] = launch({"policy": "shared", "models": [TINY], "server": {
                "max_body_bytes": MAX_BODY, "body_budget_bytes": BUDGET,
                "header_timeout_s": HEADER_TIMEOUT_S, "body_timeout_s": BODY_TIMEOUT_S,
                "max_connections": n * MAX_CONNECTIONS, "auth_token_file": "token",
                "frontends": n}}, tmp)
        for s in started.values():
            wait_ready(s)
        yield started
    finally:
        for s in started.values():
            if s.proc.poll() is None:
                s.stop()


@pytest.fixture(scope="module", params=[1, 2], ids=["one-process", "two-front-ends"])
def srv(request: pytest.FixtureRequest,
        servers: dict[int, ServerProcess]) -> Iterator[ServerProcess]:
    """The server in one process, and with two front-end processes (the connection cap is
    per front end: MAX_CONNECTIONS each, however the kernel spreads the connections)."""
    s = servers[request.param]
    try:
        yield s
    finally:
        s.stop()  # gracefully: a kill would leave its workers' shared memory behind


def _connect(srv: ServerProcess, timeout_s: float = 10) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=timeout_s)
    return s


def _read_all(s: socket.socket) -> bytes:
    """Everything the server sends until it closes (b"" for a bare close)."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def _json_body(raw: bytes) -> dict:
    return json.loads(raw.split(b"\r\n\r\n", 1)[1])


def _infer_json() -> bytes:
    return json.dumps({"inputs": [{"name": "input", "shape": [1, 3, 32, 32], "datatype": "FP32",
                                   "data": [0.5] * 3072}]}).encode()


def _post(srv: ServerProcess, body: bytes, headers: dict[str, str] | None = None,
          ) -> tuple[int, dict, dict]:
    """A plain urllib POST: it sends the whole body before it reads anything."""
    req = urllib.request.Request(f"http://{srv.url}{INFER}", data=body,
                                 headers={**AUTH, **(headers or {})}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def _serves(srv: ServerProcess) -> bool:
    status, payload, _ = _post(srv, _infer_json())
    return status == 200 and len(payload["outputs"][0]["data"]) == 10


def _settled_fds(srv: ServerProcess) -> int:
    time.sleep(0.3)  # connections of earlier requests finish closing
    return srv.fds()


def test_half_sent_headers_are_closed_within_the_header_timeout(srv: ServerProcess) -> None:
    before = _settled_fds(srv)
    stalled = []
    for _ in range(MAX_CONNECTIONS // 2):
        s = _connect(srv)
        s.sendall(f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Le".encode())
        stalled.append(s)
    try:
        assert _serves(srv), "normal traffic must go on during the slowloris"
        assert srv.fds() >= before + len(stalled)
        for s in stalled:  # closed by the server (recv returns), not by our 10 s timeout
            assert _read_all(s) == b""
        deadline = time.monotonic() + 10
        while srv.fds() > before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.fds() <= before
    finally:
        for s in stalled:
            s.close()


def test_an_idle_connection_that_never_sends_is_closed(srv: ServerProcess) -> None:
    with _connect(srv) as s:
        assert _read_all(s) == b""


def test_a_stalled_upload_gets_a_json_408_and_is_closed(srv: ServerProcess) -> None:
    with _connect(srv) as s:
        s.sendall(f"POST {INFER} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                  f"Content-Length: 5000\r\n\r\n{{\"inputs\": ".encode())
        raw = _read_all(s)
    assert raw.startswith(b"HTTP/1.1 408"), raw
    assert "stalled" in _json_body(raw)["error"]
    assert _serves(srv)


def test_a_client_still_sending_after_the_400_to_an_unparseable_header_reads_it(
        srv: ServerProcess) -> None:
    """The 400 to a header the server cannot parse is written at once, while the client
    is still sending what came after it (here 8 MiB). A close right after the 400 made
    the kernel answer the rest with a reset: the client's send failed and the 400 was
    destroyed unread (336 of `make chaos`'s 100,000 fuzzed requests had no answer so).
    Now the server reads and drops the rest, then the client reads the 400. And the log
    says such requests once, not once each."""
    head = (f"POST {INFER} HTTP/1.1\r\nHost: x\r\nnot a header\r\n"
            f"Content-Length: {8 << 20}\r\n\r\n").encode()
    for _ in range(4):
        with _connect(srv) as s:
            s.sendall(head + b" " * (8 << 20))  # ConnectionResetError before
            raw = _read_all(s)
        assert raw.startswith(b"HTTP/1.1 400"), raw
        assert "malformed HTTP request" in _json_body(raw)["error"]
    assert _serves(srv)
    # one line per process that parses HTTP (each front end has its own)
    assert srv.text().count("Invalid HTTP request received.") <= max(1, len(srv.front_ends()))


@pytest.mark.parametrize("size", [100_000, 64 << 20])
def test_a_header_over_max_header_bytes_gets_431_and_the_server_goes_on(
        srv: ServerProcess, size: int) -> None:
    """A header is read as it comes: with no bound, one GET could send tens of MB of header
    within the header timeout (32 MB in 10 s here, the server holding it), and through
    front ends a 100 KB header stopped the front end that read it (its link to the dispatch
    process could not hold the request: every request on that front end got 503 until it
    was replaced). Now past `max_header_bytes` (64 KiB by default) the client reads a 431
    with a JSON error, sent all at once or not; a header under it is served."""
    head = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Big: "
    with _connect(srv) as s:
        s.sendall(head + b"b" * size + b"\r\n\r\n")
        raw = _read_all(s)
    assert raw.startswith(b"HTTP/1.1 431"), raw[:200]
    assert "max_header_bytes" in _json_body(raw)["error"]
    with _connect(srv) as s:
        s.sendall(head + b"b" * 48_000 + b"\r\n\r\n")
        s.shutdown(socket.SHUT_WR)
        assert [status for status, _ in _answers(_read_all(s))] == [200]
    assert _serves(srv)


def _answers(raw: bytes) -> list[tuple[int, bytes]]:
    """The (status, body) of each whole answer in `raw` (Content-Length framed)."""
    out = []
    while b"\r\n\r\n" in raw:
        head, rest = raw.split(b"\r\n\r\n", 1)
        length = int(re.search(rb"(?i)content-length: *(\d+)", head)[1])  # type: ignore[index]
        if len(rest) < length:
            break
        out.append((int(head.split(b" ", 2)[1]), rest[:length]))
        raw = rest[length:]
    return out


def _infer_request() -> bytes:
    body = _infer_json()
    return (f"POST {INFER} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode() + body


def test_a_client_that_closes_its_sending_side_reads_its_answer(srv: ServerProcess) -> None:
    """A client may close its side once it has sent its request (`shutdown(SHUT_WR)`, as
    `nc -N` does) and read the answer (RFC 9112 9.6). uvicorn closed the connection at
    that end of file, and such a client read nothing, in one process and through front
    ends alike."""
    for _ in range(3):
        with _connect(srv) as s:
            s.sendall(_infer_request())
            s.shutdown(socket.SHUT_WR)
            answers = _answers(_read_all(s))
        assert [status for status, _ in answers] == [200]
        assert len(json.loads(answers[0][1])["outputs"][0]["data"]) == 10


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_request_asking_to_upgrade_to_h2c_is_served_with_its_body(
        srv: ServerProcess, framing: str) -> None:
    """Java's HttpClient (under Spring's RestClient) sends `Upgrade: h2c` with its requests
    over http://. The server upgrades to nothing and ignores the field (RFC 9110 7.8), but
    httptools took the body for the new protocol: the app read an empty body and answered
    400 "malformed JSON" (uvicorn issue 2722). Now the request is served with its body, and
    the connection's next request after it too."""
    body = _infer_json()
    head = (f"POST {INFER} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
            f"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\nContent-Type: application/json\r\n")
    if framing == "chunked":
        request = (head + "Transfer-Encoding: chunked\r\n\r\n").encode() + (
            b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
    else:
        request = (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    with _connect(srv) as s:
        s.sendall(request)
        raw = b""
        while not (answers := _answers(raw)):
            raw += s.recv(65536)
        s.sendall(_infer_request())
        s.shutdown(socket.SHUT_WR)
        answers = _answers(raw + _read_all(s))
    assert [status for status, _ in answers] == [200, 200], answers
    assert all(len(json.loads(a)["outputs"][0]["data"]) == 10 for _, a in answers)


@pytest.mark.parametrize("after", [b"GARBAGE\x00\r\n\r\n", b" ",
                                   b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"],
                         ids=["junk", "a-space", "a-pipelined-get"])
def test_what_comes_after_a_whole_request_does_not_take_its_answer(
        srv: ServerProcess, after: bytes) -> None:
    """Bytes after a whole request, in the same write: junk, or another request. The
    request is answered first, and only then does what came after it get its own answer
    (a 400 for what does not parse, or the pipelined request's; through front ends, a
    request pipelined behind an infer request the dispatch process is asked about is
    not served: the connection closes after the first answer and the client sends it
    again). Before, in one process the 400 went out at once, where the client read it as
    its request's answer, and the answer was lost; through front ends the connection was
    closed with no answer at all."""
    with _connect(srv) as s:
        s.sendall(_infer_request() + after)
        s.shutdown(socket.SHUT_WR)
        answers = _answers(_read_all(s))
    assert answers and answers[0][0] == 200, answers
    assert len(json.loads(answers[0][1])["outputs"][0]["data"]) == 10
    rest = [status for status, _ in answers[1:]]
    if after.startswith(b"GET"):
        assert rest in ([200], [] if srv.front_ends() else [200])
    else:
        assert rest in ([400], [] if srv.front_ends() else [400])
    assert _serves(srv)


# 2 MiB: a reset before the limits read the rest; 64 MiB: before the connection dropped
# the rest whatever its size (the limits read 4x the limit, then closed on the rest)
@pytest.mark.parametrize("size", [MAX_BODY + 1, 8 * MAX_BODY, 256 * MAX_BODY])
def test_a_client_sending_a_body_over_the_limit_reads_the_413(
        srv: ServerProcess, size: int) -> None:
    status, payload, _ = _post(srv, b"x" * size)  # urllib: sends it all, then reads
    assert status == 413 and "limit" in payload["error"]
    assert _serves(srv)


def test_after_a_413_the_connection_serves_the_next_request(srv: ServerProcess) -> None:
    """A body over the limit, of a declared length, is answered at once and dropped as it
    comes; the connection stays open for the next request (before: closed, and a body over
    4x the limit saw a reset instead of the 413)."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    conn.request("POST", INFER, body=b"x" * (64 * MAX_BODY), headers=AUTH)
    r = conn.getresponse()
    assert r.status == 413 and "limit" in json.loads(r.read())["error"]
    assert r.getheader("Connection") != "close"
    conn.request("POST", INFER, body=_infer_json(), headers=AUTH)
    assert conn.getresponse().status == 200
    conn.close()


@pytest.mark.parametrize("size", [2 * MAX_BODY, 64 * MAX_BODY])  # 16 MiB: a reset before
def test_a_chunked_body_over_the_limit_gets_413(srv: ServerProcess, size: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    chunks = (b"x" * 65536 for _ in range(size // 65536))
    conn.request("POST", INFER, body=chunks, encode_chunked=True,
                 headers={**AUTH, "Transfer-Encoding": "chunked"})
    r = conn.getresponse()
    assert r.status == 413 and "limit" in json.loads(r.read())["error"]
    conn.close()


def _start_upload(srv: ServerProcess, length: int, body: bytes = b"") -> socket.socket:
    s = _connect(srv)
    s.sendall(f"POST {INFER} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
              f"Content-Length: {length}\r\n\r\n".encode() + body)
    return s


def test_bodies_over_the_budget_get_503_with_retry_after_before_being_read(
        srv: ServerProcess) -> None:
    # Two uploads in progress hold 2 x 240 KiB of the 512 KiB budget.
    holders = [_start_upload(srv, 240 * 1024) for _ in range(2)]
    try:
        time.sleep(0.3)
        # Content-Length above what is left: refused from the header alone (no body sent).
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=BODY_TIMEOUT_S / 2)
        conn.putrequest("POST", INFER)
        for k, v in {**AUTH, "Content-Length": str(64 * 1024)}.items():
            conn.putheader(k, v)
        conn.endheaders()
        r = conn.getresponse()
        payload = json.loads(r.read())
        assert r.status == 503 and r.getheader("Retry-After") == "1", payload
        assert "body_budget_bytes" in payload["error"]
        assert r.getheader("Connection") != "close"
        # The body, sent after all, is dropped; the connection serves the next request.
        conn.send(b"x" * 64 * 1024)
        conn.request("POST", INFER, body=_infer_json(), headers=AUTH)
        r = conn.getresponse()
        assert r.status == 200, r.read()
        assert json.loads(r.read())["outputs"][0]["shape"] == [1, 10]
        conn.close()
        # A chunked body is counted as it arrives.
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=BODY_TIMEOUT_S / 2)
        conn.request("POST", INFER, body=(b"x" * 16384 for _ in range(4)),
                     headers={**AUTH, "Transfer-Encoding": "chunked"}, encode_chunked=True)
        r = conn.getresponse()
        assert r.status == 503 and r.getheader("Retry-After") == "1"
        conn.close()
        # Small bodies that still fit are served.
        assert _serves(srv)
    finally:
        for s in holders:
            s.close()
    # The holders' budget comes back once the server sees them go.
    deadline = time.monotonic() + 10
    status = 0
    while time.monotonic() < deadline and status != 400:
        status, _, _ = _post(srv, b"x" * (MAX_BODY - 1))  # not JSON: 400, after being read
    assert status == 400


def test_requests_without_the_token_get_401_and_health_stays_open(srv: ServerProcess) -> None:
    assert srv.get("/v2/health/ready") == 200 and srv.get("/v2/health/live") == 200
    assert srv.get("/metrics") == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                    {"Authorization": f"Basic {TOKEN}"}):
        req = urllib.request.Request(f"http://{srv.url}/v2/models/tiny_cnn", headers=headers)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=5)
        assert e.value.code == 401
        assert e.value.headers["WWW-Authenticate"].startswith("Bearer")
        body = e.value.read().decode()
        assert "error" in json.loads(body) and TOKEN not in body
    assert srv.get("/v2/models/tiny_cnn", {"Authorization": f"bearer {TOKEN}"}) == 200
    # a body sent without the token is dropped: the client reads its 401, not a reset
    for size in (MAX_BODY, 64 * MAX_BODY):  # 16 MiB: a reset before
        status, payload, _ = _post(srv, b"x" * size, headers={"Authorization": "Bearer no"})
        assert status == 401 and "error" in payload


def test_tritonclient_with_the_token(srv: ServerProcess) -> None:
    client = httpclient.InferenceServerClient(srv.url)
    x = np.ones((2, 3, 32, 32), np.float32)
    inp = httpclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    # (a copy: tritonclient adds its binary header to the dict it is given)
    out = client.infer("tiny_cnn", [inp], headers=dict(AUTH)).as_numpy("output")
    assert out.shape == (2, 10)
    assert client.is_server_ready()  # open path
    with pytest.raises(InferenceServerException, match="unauthorized"):
        client.infer("tiny_cnn", [inp])
    client.close()


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_tritonclient_compressing_its_requests_gets_the_same_answers(
        srv: ServerProcess, binary: bool) -> None:
    """tritonclient's `request_compression_algorithm` sends the body gzip- or
    deflate-compressed (`Content-Encoding`), which Triton reads: answered 400 "malformed
    JSON" before, in one process and through front ends."""
    client = httpclient.InferenceServerClient(srv.url)
    x = np.random.default_rng(0).random((2, 3, 32, 32), np.float32)
    inp = httpclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    plain = client.infer("tiny_cnn", [inp], headers=dict(AUTH)).as_numpy("output")
    for algorithm in ("gzip", "deflate"):
        out = client.infer("tiny_cnn", [inp], headers=dict(AUTH),
                           request_compression_algorithm=algorithm,
                           response_compression_algorithm=algorithm).as_numpy("output")
        np.testing.assert_allclose(out, plain, rtol=1e-5)
    client.close()


def test_compressed_bodies_are_held_to_the_limit_once_decompressed(srv: ServerProcess) -> None:
    """A body is held to `max_body_bytes` as it decompresses: 1 KB of gzip that would
    decompress to 16 MiB gets 413; a stream cut short or not gzip at all, 400; another
    encoding, 415. Each names what was wrong, and the server goes on."""
    bomb = gzip.compress(b"\0" * (64 * MAX_BODY))
    assert len(bomb) < 32 * 1024
    status, payload, _ = _post(srv, bomb, {"Content-Encoding": "gzip"})
    assert status == 413 and "decompressed" in payload["error"]
    body = gzip.compress(_infer_json())
    for data, encoding, want, says in [(body[:-20], "gzip", 400, "does not end"),
                                       (b"not gzip at all", "gzip", 400, "not valid gzip"),
                                       (body, "br", 415, "'br' is not supported")]:
        status, payload, _ = _post(srv, data, {"Content-Encoding": encoding})
        assert (status, says in payload["error"]) == (want, True), payload
    assert _post(srv, body, {"Content-Encoding": "gzip"})[0] == 200
    assert _serves(srv)


def _server_ms(headers: dict) -> float:
    """The `Server-Timing: total;dur=<ms>` of an answer."""
    value = {k.lower(): v for k, v in headers.items()}["server-timing"]
    name, dur = value.split(";")
    assert name == "total" and dur.startswith("dur="), value
    return float(dur[4:])


def test_answers_say_in_server_timing_how_long_the_server_took(srv: ServerProcess) -> None:
    # an answer, a refusal by the app (401) and one from the header (413, never read)
    for body, headers, want in ((_infer_json(), {}, 200),
                                (_infer_json(), {"Authorization": "Bearer no"}, 401),
                                (b"x" * (MAX_BODY + 1), {}, 413)):
        t0 = time.perf_counter()
        status, _, got = _post(srv, body, headers)
        client_ms = 1000 * (time.perf_counter() - t0)
        assert status == want
        assert 0 <= _server_ms(got) <= client_ms, (status, got)
