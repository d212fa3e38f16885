"""The app on a real uvicorn socket, driven by the real `tritonclient.http` client:
real HTTP framing, headers and keep-alive, with the fake backend behind it. Also the
lifespan of `server.main.build_app`: the runtime starts before serving and stops after."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from dstack.common.config import parse_config
from server.main import bind, build_app, make_server
from tests.integration.fakes import FakeBackend


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, FakeBackend]]:
    backend = FakeBackend()
    cfg = parse_config({"server": {"max_body_bytes": 4096}, "models": [{"name": "double"}]})
    server = make_server(build_app(cfg, backend), log_level="warning")
    sock = bind("127.0.0.1", 0)
    url = f"127.0.0.1:{sock.getsockname()[1]}"
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started and backend.started, "server did not start"
    yield url, backend
    server.should_exit = True
    thread.join(10)
    sock.close()
    assert backend.stopped, "lifespan did not stop the runtime"


@pytest.fixture
def client(served: tuple[str, FakeBackend]) -> Iterator[triton.InferenceServerClient]:
    c = triton.InferenceServerClient(served[0])
    yield c
    c.close()


def test_health_and_metadata(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("double") and not client.is_model_ready("nope")
    assert client.get_server_metadata()["name"] == "dstack"
    meta = client.get_model_metadata("double")
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 3]}]
    stats = client.get_inference_statistics("double")
    assert stats["model_stats"][0]["name"] == "double"


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_infer(client: triton.InferenceServerClient, binary: bool) -> None:
    x = np.array([[1.5, -2.0, 0.25], [3.0, 9.0, -1.0]], np.float32)
    inp = triton.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    outs = [triton.InferRequestedOutput(n, binary_data=binary) for n in ("y", "argmax")]
    result = client.infer("double", [inp], outputs=outs, request_id="abc")
    np.testing.assert_array_equal(result.as_numpy("y"), x * 2)
    np.testing.assert_array_equal(result.as_numpy("argmax"), [0, 1])
    assert result.get_response()["id"] == "abc"


def test_errors_reach_the_client_and_it_keeps_working(
    client: triton.InferenceServerClient,
) -> None:
    bad = triton.InferInput("x", [1, 4], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 4), np.float32))
    with pytest.raises(InferenceServerException, match="dimension 1 is 4, expected 3"):
        client.infer("double", [bad])
    ok = triton.InferInput("x", [1, 3], "FP32")
    ok.set_data_from_numpy(np.ones((1, 3), np.float32))
    with pytest.raises(InferenceServerException, match="exceeds the limit of 4096"):
        client.infer("double", [ok], request_id="x" * 4096)  # body above the 4 KiB limit
    with pytest.raises(InferenceServerException, match="unknown model 'nope'"):
        client.infer("nope", [bad])
    np.testing.assert_array_equal(client.infer("double", [ok]).as_numpy("y"), [[2, 2, 2]])


def test_accepted_connections_get_tcp_nodelay() -> None:
    """Without TCP_NODELAY every small response waits ~40 ms for the client's delayed
    ACK (a 1 ms request took 44 ms); asyncio sets it only on sockets that say TCP."""
    sock = bind("127.0.0.1", 0)
    nodelay: list[int] = []

    async def main() -> None:
        async def on_connect(_: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            s = w.get_extra_info("socket")
            nodelay.append(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            w.close()

        server = await asyncio.start_server(on_connect, sock=sock)
        _, w = await asyncio.open_connection(*sock.getsockname())
        while not nodelay:
            await asyncio.sleep(0.01)
        w.close()
        server.close()

    asyncio.run(main())
    assert nodelay == [1]
