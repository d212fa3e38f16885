"""A real `dstack serve` with `server.frontends: 2` (docs/frontends.md): every route answers
through the front-end processes as the one-process server does, gRPC too, refusals keep their
status, body and headers and are counted once by the dispatch process, a front end that
dies is replaced while the other goes on serving. (SIGTERM and SIGINT draining through
them: tests/e2e/test_server_lifecycle.py; the limits: tests/e2e/test_server_limits.py.)"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from server.metrics import histogram_counts
from tests.e2e.conftest import ROOT, free_port
from tests.e2e.server_process import TINY, ServerProcess, launch, wait_ready

INFER = "/v2/models/tiny_cnn/infer"
GRPC_ON = re.compile(r"gRPC \(KServe v2 / Triton\) on 127\.0\.0\.1:(\d+), served by the 2 "
                     r"front ends")
RESTARTED = re.compile(r"front end \d+ \(pid (\d+)\) exited with (-?\d+); starting another")


def server_config(tmp_path: Path) -> dict:
    """This module's server (tests/e2e/conftest.py `module_server`)."""
    return {"policy": "shared", "models": [TINY],
            "server": {"frontends": 2, "grpc_port": free_port(), "allow_client_shm": True}}


@pytest.fixture(scope="module")
def srv(module_server: ServerProcess) -> ServerProcess:
    """One server with two front ends, shared by the tests that leave it running."""
    return module_server


# The servers of the last three tests, one each (each test changes its server's state),
# started together when the first of them runs: a start keeps one core busy, so three
# starting at once on two cores are ready well before three one after another.
OWN_SERVERS = {
    "test_a_body_still_arriving_past_its_deadline_is_refused_across_the_link": {
        "policy": "shared", "models": [{**TINY, "slo_ms": 300}], "server": {"frontends": 2}},
    "test_refusals_that_stand_at_a_front_end_answer_and_count_as_the_dispatch_process": {
        "policy": "shared", "server": {"frontends": 2},
        "models": [{**TINY, "slo_ms": 15, "max_batch_size": 1, "max_queue_delay_ms": 0}]},
    "test_a_front_end_refuses_what_a_stalled_dispatch_process_has_not_decided": {
        "policy": "shared", "models": [{**TINY, "slo_ms": 300}],
        "server": {"frontends": 2, "decision_timeout_ms": 200}},
}


@pytest.fixture(scope="module")
def own_servers(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                ) -> Iterator[dict[str, ServerProcess]]:
    wanted = {item.originalname for item in request.session.items  # type: ignore[attr-defined]
              if item.module is request.module}  # type: ignore[attr-defined]
    servers = {name: launch(cfg, tmp_path_factory.mktemp("own"))
               for name, cfg in OWN_SERVERS.items() if name in wanted}
    try:
        for s in servers.values():
            wait_ready(s)
        yield servers
    finally:
        for s in servers.values():  # each test stops its own; this is for one that failed
            if s.proc.poll() is None:
                s.stop()


@pytest.fixture
def own(request: pytest.FixtureRequest, own_servers: dict[str, ServerProcess]) -> ServerProcess:
    """This test's own server, ready (`OWN_SERVERS`)."""
    return own_servers[request.node.originalname]  # type: ignore[attr-defined]


def _infer_json(n: int = 1) -> bytes:
    return json.dumps({"inputs": [{"name": "input", "shape": [n, 3, 32, 32], "datatype": "FP32",
                                   "data": [0.5] * (n * 3072)}]}).encode()


def _infer_binary() -> tuple[bytes, dict[str, str]]:
    """A one-item request in the binary tensor extension (a front end passes its body in
    shared memory), its answer asked for as JSON: (body, headers)."""
    head = json.dumps({"inputs": [{"name": "input", "shape": [1, 3, 32, 32], "datatype": "FP32",
                                   "parameters": {"binary_data_size": 3072 * 4}}],
                       "parameters": {"binary_data_output": False}}).encode()
    return (head + np.full(3072, 0.5, np.float32).tobytes(),
            {"Inference-Header-Content-Length": str(len(head))})


def _post(srv: ServerProcess, body: bytes, headers: dict[str, str] | None = None,
          ) -> tuple[int, dict, dict[str, str]]:
    """A plain urllib POST on a new connection: (status, JSON body, lower-cased headers)."""
    req = urllib.request.Request(f"http://{srv.url}{INFER}", data=body, headers=headers or {},
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            status, payload, headers = r.status, json.loads(r.read()), r.headers
    except urllib.error.HTTPError as e:
        status, payload, headers = e.code, json.loads(e.read()), e.headers
    return status, payload, {k.lower(): v for k, v in headers.items()}


def _expect_continue(srv: ServerProcess, body: bytes) -> bytes:
    """A POST with `Expect: 100-continue` whose body is sent only on `100 Continue`: what
    the server sent until it closed the connection (no `100 Continue` when it refuses)."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as c:
        c.sendall(f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n".encode())
        got = b""
        while chunk := c.recv(65536):
            if got + chunk == b"HTTP/1.1 100 Continue\r\n\r\n":
                c.sendall(body)
            got += chunk
        return got


def _post_chunked(srv: ServerProcess, body: bytes) -> tuple[int, dict, dict[str, str]]:
    """`_post` with the body sent chunked (no Content-Length)."""
    c = http.client.HTTPConnection(srv.url.split(":")[0], srv.port, timeout=30)
    try:
        c.request("POST", INFER, body=iter([body[:1000], body[1000:]]), encode_chunked=True)
        r = c.getresponse()
        return r.status, json.loads(r.read()), {k.lower(): v for k, v in r.getheaders()}
    finally:
        c.close()


def _get_text(srv: ServerProcess, path: str) -> str:
    with urllib.request.urlopen(f"http://{srv.url}{path}", timeout=10) as r:
        return r.read().decode()


def _successes(srv: ServerProcess) -> tuple[int, float]:
    """tiny_cnn's successful requests: (the stats' count, /metrics' counter)."""
    stats = json.loads(_get_text(srv, "/v2/models/tiny_cnn/stats"))
    count = stats["model_stats"][0]["inference_stats"]["success"]["count"]
    m = re.search(r'^nv_inference_request_success\{model="tiny_cnn",version="1"\} (\S+)$',
                  _get_text(srv, "/metrics"), re.M)
    assert m is not None
    return count, float(m.group(1))


def _shared_bodies(srv: ServerProcess) -> float:
    m = re.search(r"^dstack_frontend_shared_bodies_total (\S+)$", _get_text(srv, "/metrics"),
                  re.M)
    assert m is not None
    return float(m.group(1))


def _front_ends(srv: ServerProcess) -> list[int]:
    """`srv.front_ends()`, tried again while a process it lists is just going away."""
    for _ in range(20):
        try:
            return srv.front_ends()
        except OSError:
            time.sleep(0.05)
    return srv.front_ends()


def test_every_route_answers_through_the_front_ends(srv: ServerProcess) -> None:
    assert len(_front_ends(srv)) == 2
    for path in ("/v2", "/v2/models/tiny_cnn", "/v2/models/tiny_cnn/config",
                 "/v2/health/ready", "/metrics"):
        assert srv.get(path) == 200, path
    before, before_metric = _successes(srv)
    shared_before = _shared_bodies(srv)
    rounds = 4

    def client_thread(seed: int) -> int:
        """One tritonclient per thread: binary and JSON infers of the same inputs agree."""
        client = httpclient.InferenceServerClient(srv.url)
        rng = np.random.default_rng(seed)
        done = 0
        try:
            for k in range(rounds):
                x = rng.standard_normal((1 + (seed + k) % 4, 3, 32, 32), dtype=np.float32)
                got = {}
                for binary in (True, False):
                    inp = httpclient.InferInput("input", list(x.shape), "FP32")
                    inp.set_data_from_numpy(x, binary_data=binary)
                    out = httpclient.InferRequestedOutput("output", binary_data=binary)
                    got[binary] = client.infer("tiny_cnn", [inp], outputs=[out]).as_numpy(
                        "output")
                    done += 1
                    assert got[binary].shape == (x.shape[0], 10)
                    assert np.isfinite(got[binary]).all()
                np.testing.assert_allclose(got[True], got[False], rtol=1e-4, atol=1e-5)
        finally:
            client.close()
        return done

    with ThreadPoolExecutor(4) as pool:
        k = sum(pool.map(client_thread, range(4)))
    assert k == 4 * rounds * 2
    after, after_metric = _successes(srv)
    assert after - before == k  # counted once, by the dispatch process
    assert after_metric - before_metric == k
    # the binary ones (half) were passed in the front ends' shared memory, not over the link
    assert _shared_bodies(srv) - shared_before == k // 2
    assert len(_front_ends(srv)) == 2


def _listening(port: int, pids: list[int]) -> set[int]:
    """Those of `pids` that hold a socket listening on TCP `port` (grpcio's are IPv6
    sockets with a v4-mapped address)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[1].endswith(f":{port:04X}") and f[3] == "0A":  # LISTEN
                inodes.add(f"socket:[{f[9]}]")
    held = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                if os.readlink(fd) in inodes:
                    held.add(pid)
            except OSError:  # closed meanwhile
                pass
    return held


def test_grpc_is_served_by_the_front_ends_and_decided_by_the_dispatch_process(
        srv: ServerProcess) -> None:
    m = GRPC_ON.search(srv.text())
    assert m is not None, srv.text()
    port = int(m.group(1))
    fronts = _front_ends(srv)
    assert _listening(port, [srv.pid, *fronts]) == set(fronts)  # each front end, not it
    before, _ = _successes(srv)
    shared_before = _shared_bodies(srv)
    g = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    h = httpclient.InferenceServerClient(srv.url)
    try:
        rng = np.random.default_rng(0)
        for n in (1, 8):  # 8 items: 98 KB, across the link in the front end's shared memory
            x = rng.standard_normal((n, 3, 32, 32), dtype=np.float32)
            inp = grpcclient.InferInput("input", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            hinp = httpclient.InferInput("input", list(x.shape), "FP32")
            hinp.set_data_from_numpy(x, binary_data=True)
            np.testing.assert_allclose(g.infer("tiny_cnn", [inp]).as_numpy("output"),
                                       h.infer("tiny_cnn", [hinp]).as_numpy("output"),
                                       rtol=1e-4, atol=1e-5)
        with pytest.raises(InferenceServerException, match="unknown model 'nope'") as e:
            g.infer("nope", [inp])
        assert e.value.status() == "StatusCode.NOT_FOUND"
        bad = grpcclient.InferInput("input", [1, 3, 31, 32], "FP32")
        bad.set_data_from_numpy(np.zeros((1, 3, 31, 32), np.float32))
        with pytest.raises(InferenceServerException, match="dimension 2") as e:
            g.infer("tiny_cnn", [bad])
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
        # a stream: each request answered, the bad one with its error
        answers: list[tuple[object, object]] = []
        g.start_stream(callback=lambda result, error: answers.append((result, error)))
        for i in range(3):
            g.async_stream_infer("tiny_cnn", [inp], request_id=f"r{i}")
        g.async_stream_infer("tiny_cnn", [bad], request_id="bad")
        g.stop_stream()  # waits for the answers
        assert sorted(r.get_response().id for r, err in answers if err is None) == [
            "r0", "r1", "r2"]
        assert ["dimension 2" in str(err) for _, err in answers if err is not None] == [True]
        # system shared memory over gRPC: the front end passes its client's address on
        np.testing.assert_allclose(_infer_in_regions(grpcclient, g, x),
                                   h.infer("tiny_cnn", [hinp]).as_numpy("output"),
                                   rtol=1e-4, atol=1e-5)
    finally:
        g.close()
        h.close()
    after, _ = _successes(srv)
    assert after - before == 2 * 2 + 3 + 2  # counted once, by the dispatch process
    assert _shared_bodies(srv) - shared_before >= 1 + 1  # gRPC's 98 KB and HTTP's binary


def test_the_grpc_port_of_the_front_ends_is_refused_to_another_server(
        srv: ServerProcess, tmp_path: Path) -> None:
    """The front ends share the port (SO_REUSEPORT); another server asking for it,
    with one process or with front ends of its own, fails to start with one line."""
    m = GRPC_ON.search(srv.text())
    assert m is not None
    for frontends in (1, 2):
        cfg = tmp_path / f"deploy{frontends}.yaml"
        cfg.write_text(f"models: [{{name: tiny_cnn, slo_ms: 10000}}]\n"
                       f"server: {{frontends: {frontends}}}\n")
        proc = subprocess.run(
            [sys.executable, "-m", "dstack.cli", "serve", "--config", str(cfg), "--host",
             "127.0.0.1", "--port", "0", "--grpc-port", m.group(1)],
            cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
        assert len(errors) == 1 and errors[0].startswith("error: cannot listen for gRPC"), errors
    assert _listening(int(m.group(1)), [srv.pid, *_front_ends(srv)]) == set(_front_ends(srv))


def _infer_in_regions(lib: Any, client: Any, x: np.ndarray) -> np.ndarray:
    """tiny_cnn on `x`, its input and output in system shared-memory regions that `client`
    (of `lib`: tritonclient.http or .grpc) registers and removes: the output read back."""
    key = f"/fe_{lib.__name__.rsplit('.', 1)[1]}_{os.getpid()}"
    n = x.shape[0]
    regions = [shm.create_shared_memory_region("in", key + "_in", x.nbytes),
               shm.create_shared_memory_region("out", key + "_out", n * 40)]
    try:
        shm.set_shared_memory_region(regions[0], [x])
        client.register_system_shared_memory("in", key + "_in", x.nbytes)
        client.register_system_shared_memory("out", key + "_out", n * 40)
        inp = lib.InferInput("input", list(x.shape), "FP32")
        inp.set_shared_memory("in", x.nbytes)
        out = lib.InferRequestedOutput("output")
        out.set_shared_memory("out", n * 40)
        client.infer("tiny_cnn", [inp], outputs=[out])
        return shm.get_contents_as_numpy(regions[1], np.float32, [n, 10]).copy()
    finally:
        client.unregister_system_shared_memory()
        for r in regions:
            shm.destroy_shared_memory_region(r)


def test_shared_memory_over_http_through_the_front_ends(srv: ServerProcess) -> None:
    """A front end passes on its client's address: a client on this host registers
    regions over HTTP and infers from and into them, as with one process."""
    x = np.random.default_rng(1).standard_normal((2, 3, 32, 32), dtype=np.float32)
    h = httpclient.InferenceServerClient(srv.url)
    try:
        plain = httpclient.InferInput("input", list(x.shape), "FP32")
        plain.set_data_from_numpy(x, binary_data=True)
        np.testing.assert_allclose(_infer_in_regions(httpclient, h, x),
                                   h.infer("tiny_cnn", [plain]).as_numpy("output"),
                                   rtol=1e-4, atol=1e-5)
    finally:
        h.close()


def test_the_front_ends_loop_lateness_is_in_metrics(srv: ServerProcess) -> None:
    # each front end ticks a 10 ms timer and reports its counts each second
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        late = histogram_counts(_get_text(srv, "/metrics"), "dstack_frontend_loop_late_seconds")
        if late.count >= 2 * 50:  # two front ends, half a second's ticks each at least
            break
        time.sleep(0.2)
    assert late.count >= 2 * 50
    assert late.sum_s >= 0


def test_refusals_through_front_ends_match_one_process_and_are_counted_once(
        tmp_path: Path) -> None:
    # An SLO of 1 µs: no request can be queued in time, so each is refused from its header.
    hopeless = {**TINY, "slo_ms": 0.001, "max_queue_delay_ms": 0}
    servers: dict[int, ServerProcess] = {}
    try:
        for n in (1, 2):  # both start at once
            (tmp_path / str(n)).mkdir()
            servers[n] = launch({"policy": "shared", "models": [hopeless],
                                 "server": {"frontends": n}}, tmp_path / str(n))
        for s in servers.values():
            wait_ready(s)

        def shape(answer: tuple[int, dict, dict[str, str]]) -> tuple:
            status, payload, headers = answer
            return (status, sorted(payload), payload.get("reason"),
                    headers.get("content-type"), headers.get("retry-after"))

        want = shape(_post(servers[1], _infer_json()))
        assert want[0] == 429 and want[1] == ["error", "reason"], want
        sent = 20
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: _post(servers[2], _infer_json()), range(sent)))
        assert [shape(a) for a in answers] == [want] * sent
        assert all("SLO" in a[1]["error"] for a in answers)
        assert all(a[2]["server-timing"].startswith("total;dur=") for a in answers)

        text = _get_text(servers[2], "/metrics")
        header = histogram_counts(text, "dstack_refusal_seconds", model="tiny_cnn",
                                  stage="header")
        body = histogram_counts(text, "dstack_refusal_seconds", model="tiny_cnn", stage="body")
        assert (sum(header.counts), sum(body.counts)) == (sent, 0)
        stats = json.loads(_get_text(servers[2], "/v2/models/tiny_cnn/stats"))
        assert stats["model_stats"][0]["inference_stats"]["fail"]["count"] == sent
        assert stats["model_stats"][0]["inference_stats"]["success"]["count"] == 0
        for s in servers.values():  # a client waiting for `100 Continue` never sends it
            assert _expect_continue(s, _infer_json()).startswith(b"HTTP/1.1 429 "), s.port
    finally:
        for s in servers.values():
            s.stop()


def test_a_killed_front_end_is_replaced_and_requests_go_on(srv: ServerProcess) -> None:
    old = _front_ends(srv)
    assert len(old) == 2
    victim = old[0]
    statuses: list[int] = []
    stop = threading.Event()

    binary, binary_headers = _infer_binary()

    def traffic() -> None:
        """Requests one after another, JSON and binary; a connection error retried at most
        3 times."""
        while not stop.is_set():
            for _ in range(4):
                try:
                    statuses.append(_post(srv, _infer_json())[0])
                    status, answer, _ = _post(srv, binary, binary_headers)
                    statuses.append(status if len(answer["outputs"][0]["data"]) == 10 else 0)
                    break
                except OSError:  # reset by the dying front end: once, for that request
                    time.sleep(0.05)
            else:
                statuses.append(0)

    t = threading.Thread(target=traffic, daemon=True)
    t.start()
    try:
        time.sleep(0.3)
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 20
        now = _front_ends(srv)
        while (len(now) != 2 or victim in now) and time.monotonic() < deadline:
            time.sleep(0.1)
            now = _front_ends(srv)
        assert len(now) == 2 and victim not in now and old[1] in now, (old, now, srv.text())
    finally:
        stop.set()
        t.join(30)
    assert statuses and all(s == 200 for s in statuses), statuses
    for _ in range(20):  # new connections, spread by the kernel over both front ends
        assert _post(srv, _infer_json())[0] == 200
    shared = _shared_bodies(srv)
    os.kill(old[1], signal.SIGSTOP)  # the replacement alone accepts: it serves
    try:
        for _ in range(5):
            assert _post(srv, _infer_json())[0] == 200
            status, answer, _ = _post(srv, binary, binary_headers)
            assert status == 200 and np.allclose(answer["outputs"][0]["data"],
                                                 _post(srv, _infer_json())[1]["outputs"][0]["data"])
        assert _shared_bodies(srv) - shared == 5  # in the replacement's own shared memory
    finally:
        os.kill(old[1], signal.SIGCONT)
    # the replacement listens on the gRPC port too: new connections, spread over both
    m = GRPC_ON.search(srv.text())
    assert m is not None
    assert _listening(int(m.group(1)), now) == set(now)
    x = np.zeros((1, 3, 32, 32), np.float32)
    for _ in range(10):
        g = grpcclient.InferenceServerClient(f"127.0.0.1:{m.group(1)}")
        try:
            inp = grpcclient.InferInput("input", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            assert g.infer("tiny_cnn", [inp], client_timeout=30).as_numpy("output").shape == (
                1, 10)
        finally:
            g.close()
    exits = RESTARTED.findall(srv.text())
    assert exits == [(str(victim), str(-signal.SIGKILL))], srv.text()


def test_a_body_still_arriving_past_its_deadline_is_refused_across_the_link(
        own: ServerProcess) -> None:
    """Checked again while it arrives (`c`, every MiB), as one process checks it: a 3 MiB
    upload that stalls past its 300 ms SLO is refused once its next MiB comes, and the
    connection, its body dropped, serves the next request."""
    s = own
    try:
        size = 3 << 20
        with socket.create_connection(("127.0.0.1", s.port), timeout=30) as c:
            c.sendall(f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: {size}\r\n\r\n"
                      .encode() + b"x" * (512 << 10))
            time.sleep(0.6)  # past the SLO, before the first check
            c.sendall(b"x" * (1 << 20))  # its first MiB is in: the answer comes now
            c.settimeout(10)  # (not after the whole body, nor at the 30 s body timeout)
            head = c.recv(65536)
            assert head.startswith(b"HTTP/1.1 429"), head
            body = json.loads(head.split(b"\r\n\r\n", 1)[1])
            assert body["reason"] and "SLO" in body["error"], body
            c.sendall(b"x" * (size - (512 << 10) - (1 << 20)))  # the rest, dropped
            c.sendall(f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: "
                      f"{len(_infer_json())}\r\n\r\n".encode() + _infer_json())
            again = c.recv(65536)
            assert again.startswith(b"HTTP/1.1 200"), again
        text = _get_text(s, "/metrics")
        late = histogram_counts(text, "dstack_refusal_seconds", model="tiny_cnn", stage="body")
        assert sum(late.counts) == 1
    finally:
        s.stop()


def _read_answer(c: socket.socket) -> bytes:
    """One HTTP answer on `c`, status line to body."""
    got = b""
    while b"\r\n\r\n" not in got:
        got += c.recv(65536)
    head, body = got.split(b"\r\n\r\n", 1)
    length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))  # type: ignore[union-attr]
    while len(body) < length:
        body += c.recv(65536)
    return head + b"\r\n\r\n" + body


def _stream(port: int, request: bytes, n: int, gap_s: float) -> list[bytes]:
    """`n` connections opened first, then the same request sent on each, `gap_s` apart:
    the answers (status line to body). (Sent all at once, a front end reads every header
    before the first answer is back, and no refusal is there yet to stand.)"""
    conns = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(n)]
    try:
        for c in conns:
            c.sendall(request)
            time.sleep(gap_s)
        return [_read_answer(c) for c in conns]
    finally:
        for c in conns:
            c.close()


def test_refusals_that_stand_at_a_front_end_answer_and_count_as_the_dispatch_process(
        own: ServerProcess) -> None:
    """Under a stream of requests over its capacity, a front end answers a model's
    requests with the dispatch process's refusal while it stands
    (`server.link.StandingRefusals`), without asking: the client reads the same 429, and
    stats and /metrics count every refusal once."""
    s = own
    try:
        refusals: list[bytes] = []
        reasons: dict[str, int] = {}
        for _ in range(5):  # batches enough for its latency estimate to refuse by
            status, answer, _ = _post(s, _infer_json())  # (on a busy machine, refused)
            if status == 429:
                reasons[answer["reason"]] = reasons.get(answer["reason"], 0) + 1
        warm_refused = sum(reasons.values())
        request = (f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: "
                   f"{len(_infer_json())}\r\n\r\n").encode() + _infer_json()
        standing = 0.0
        for _ in range(10):  # streams until some refusal stood (the first does, as a rule)
            answers = _stream(s.port, request, 60, 0.0003)
            assert all(a.startswith((b"HTTP/1.1 200", b"HTTP/1.1 429")) for a in answers)
            refusals += [a for a in answers if a.startswith(b"HTTP/1.1 429")]
            time.sleep(0.1)  # what stood is told within REPORT_S
            standing = _counter(s, "dstack_frontend_standing_refusals_total")
            if standing:
                break
        assert standing > 0
        for a in refusals:
            head, body = a.split(b"\r\n\r\n", 1)
            assert b"content-type: application/json" in head.lower()
            assert b"server-timing: total;dur=" in head.lower()
            reason = json.loads(body)["reason"]
            reasons[reason] = reasons.get(reason, 0) + 1
        assert set(reasons) <= {"work_ahead", "expired"}, reasons  # (a request queued late)
        text = _get_text(s, "/metrics")
        header = histogram_counts(text, "dstack_refusal_seconds", model="tiny_cnn",
                                  stage="header")
        body = histogram_counts(text, "dstack_refusal_seconds", model="tiny_cnn", stage="body")
        queue = histogram_counts(text, "dstack_refusal_seconds", model="tiny_cnn",
                                 stage="queue")
        assert (sum(header.counts) + sum(body.counts) + sum(queue.counts)
                == len(refusals) + warm_refused)
        assert sum(queue.counts) == reasons.get("expired", 0)  # dropped at launch, timed so
        stats = json.loads(_get_text(s, "/v2/models/tiny_cnn/stats"))
        assert stats["model_stats"][0]["inference_stats"]["fail"]["count"] == (
            len(refusals) + warm_refused)
        for reason, k in reasons.items():
            m = re.search(rf'^dstack_request_refused_by_rule\{{[^}}]*rule="{reason}"[^}}]*\}} '
                          r"(\S+)$", text, re.M)
            assert m is not None and float(m.group(1)) == k, (reason, k)
        assert standing <= reasons.get("work_ahead", 0)
    finally:
        s.stop()


def _late_headers(srv: ServerProcess, n: int) -> list[tuple[int, str]]:
    """`n` infer requests at once, each on its own connection, whose header comes whole
    only after the model's SLO (300 ms) has gone by since its first byte: (status, error)
    of each."""
    body = _infer_json()
    head = (f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n").encode()
    socks = [socket.create_connection(("127.0.0.1", srv.port), timeout=30) for _ in range(n)]
    try:
        for sock in socks:
            sock.sendall(head[:20])
        time.sleep(0.4)
        for sock in socks:
            sock.sendall(head[20:] + b"\r\n" + body)
        out = []
        for sock in socks:
            raw = b""
            while b"\r\n\r\n" not in raw or not raw.rstrip().endswith(b"}"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                raw += chunk
            head_text, _, payload = raw.partition(b"\r\n\r\n")
            out.append((int(head_text.split()[1]), json.loads(payload)["error"]))
        return out
    finally:
        for sock in socks:
            sock.close()


def _counter(srv: ServerProcess, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", _get_text(srv, "/metrics"), re.M)
    assert m is not None, name
    return float(m.group(1))


def test_a_front_end_refuses_what_a_stalled_dispatch_process_has_not_decided(
        own: ServerProcess) -> None:
    """`server.decision_timeout_ms`: once the server has been refusing (here: headers
    that took longer than the SLO to come), while the dispatch process is stopped
    (SIGSTOP: a loop that falls behind, at its worst), the front ends answer infer
    requests themselves once the time is up, 429 `work_ahead` (a chunked one too, which
    the front end asks about from its app rather than its connection); once it runs
    again it counts each of them once, and serves as before."""
    s = own
    try:
        assert _post(s, _infer_json())[0] == 200  # decided in time: served
        late = []  # refused, at each front end in turn (the other stopped): its bound is on
        fronts = _front_ends(s)
        assert len(fronts) == 2
        for stopped in fronts:
            os.kill(stopped, signal.SIGSTOP)
            try:
                late += _late_headers(s, 10)
            finally:
                os.kill(stopped, signal.SIGCONT)
        assert all(status == 429 for status, _ in late)
        late_undecided = sum("did not decide" in error for _, error in late)
        sent = 7
        os.kill(s.pid, signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(sent) as pool:
                answers = list(pool.map(
                    lambda k: _post(s, _infer_json()) if k else _post_chunked(s, _infer_json()),
                    range(sent)))
            # (all answered while it is stopped: by the front ends)
        finally:
            os.kill(s.pid, signal.SIGCONT)
        for status, payload, headers in answers:
            assert (status, payload["reason"]) == (429, "work_ahead")
            assert "did not decide on this request within 200 ms" in payload["error"]
            assert headers["server-timing"].startswith("total;dur=")
        assert _post(s, _infer_json())[0] == 200
        undecided = sent + late_undecided
        deadline = time.monotonic() + 10
        while _counter(s, "dstack_frontend_undecided_refusals_total") < undecided:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        text = _get_text(s, "/metrics")
        assert _counter(s, "dstack_frontend_undecided_refusals_total") == undecided
        refused = sent + len(late)
        header = histogram_counts(text, "dstack_refusal_seconds", model="tiny_cnn",
                                  stage="header")
        assert sum(header.counts) == refused
        m = re.search(r'^dstack_request_refused_by_rule\{[^}]*rule="work_ahead"[^}]*\} (\S+)$',
                      text, re.M)
        assert m is not None and float(m.group(1)) == refused
        stats = json.loads(_get_text(s, "/v2/models/tiny_cnn/stats"))
        inference = stats["model_stats"][0]["inference_stats"]
        assert (inference["fail"]["count"], inference["success"]["count"]) == (refused, 2)
    finally:
        s.stop()
