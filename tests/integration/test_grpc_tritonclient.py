"""The gRPC endpoint (`server.grpc_server`) on a real grpcio asyncio server on 127.0.0.1,
driven by the unmodified `tritonclient.grpc` clients (sync, streaming, aio), with the fake
backend behind the same `ServingApi` the HTTP app builds. Each test runs twice: served by
the process that decides, and as a front end serves it (`server.frontends` > 1: the calls
cross a real link to the deciding process's servicer)."""

from __future__ import annotations

import asyncio
import queue
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.grpc.aio as triton_aio
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc
from tritonclient.utils import InferenceServerException

from dstack.common.config import ServerConfig
from dstack.common.errors import Overloaded
from server.app import create_app
from server.grpc_server import FrontEndGrpc, GrpcEndpoint
from server.link import Dispatch, Link
from tests.integration.certs import self_signed
from tests.integration.fakes import FakeBackend

TOKEN = "s3cret"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Served:
    """A gRPC endpoint over a fresh fake backend, on its own event loop in a thread.
    `linked`: the endpoint is a front end's (`FrontEndGrpc`), linked over a Unix socket to
    the servicer of the app's process (`Dispatch`), as with `server.frontends` > 1."""

    def __init__(self, token: str | None = None, backend: FakeBackend | None = None,
                 linked: bool = False, folder: Path | None = None,
                 tls: tuple[Path, Path] | None = None) -> None:
        self.backend = backend or FakeBackend()
        self.app = create_app(self.backend, max_body_bytes=4096)
        cfg = ServerConfig(max_body_bytes=4096, body_budget_bytes=4096,
                           tls_certfile=tls and tls[0], tls_keyfile=tls and tls[1])
        self.endpoint = GrpcEndpoint(self.app.state.api, cfg, "127.0.0.1", _free_port(), token)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        if linked:
            assert folder is not None
            self.call(self._link(cfg, folder / "link"))
        self.call(self._start())
        self.url = f"127.0.0.1:{self.endpoint.port}"

    async def _link(self, cfg: ServerConfig, path: Path) -> None:
        dispatch = Dispatch(self.app, None, "1", self.endpoint.servicer)
        self.listening = await dispatch.listen(path)
        link = Link(lambda: None)
        await asyncio.get_running_loop().create_unix_connection(lambda: link, str(path))
        self.endpoint = FrontEndGrpc(link, cfg, "127.0.0.1", _free_port())

    async def _start(self) -> None:
        self.endpoint.bind()
        await self.endpoint.start()

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def close(self) -> None:
        self.call(self.endpoint.stop(1))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module", params=[False, True], ids=["direct", "front end"])
def linked(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


@pytest.fixture(scope="module")
def served(linked: bool, tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Served]:
    s = _Served(linked=linked, folder=tmp_path_factory.mktemp("link"))
    yield s
    s.close()


@pytest.fixture
def client(served: _Served) -> Iterator[triton.InferenceServerClient]:
    c = triton.InferenceServerClient(served.url)
    yield c
    c.close()


def _x(x: np.ndarray, name: str = "x", datatype: str = "FP32") -> triton.InferInput:
    inp = triton.InferInput(name, list(x.shape), datatype)
    inp.set_data_from_numpy(x)
    return inp


def _code(e: pytest.ExceptionInfo[InferenceServerException]) -> str | None:
    return e.value.status()


def test_health_metadata_config_stats_and_index(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("double") and not client.is_model_ready("nope")
    assert client.get_server_metadata(as_json=True)["name"] == "dstack"
    meta = client.get_model_metadata("double", as_json=True)
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": ["-1", "3"]}]
    config = client.get_model_config("double", as_json=True)["config"]
    assert config["max_batch_size"] == 4
    assert config["input"][0]["data_type"] == "TYPE_FP32"
    assert config["parameters"]["slo_ms"]["string_value"] == "250"
    stats = client.get_inference_statistics("double", as_json=True)["model_stats"]
    assert [s["name"] for s in stats] == ["double"]
    index = client.get_model_repository_index(as_json=True)["models"]
    assert {m["name"] for m in index} == {"double", "flip", "broken"}


def test_infer_raw_matches_the_model(client: triton.InferenceServerClient) -> None:
    x = np.array([[1.5, -2.0, 0.25], [3.0, 9.0, -1.0]], np.float32)
    outs = [triton.InferRequestedOutput(n) for n in ("y", "argmax")]
    result = client.infer("double", [_x(x)], outputs=outs, request_id="abc")
    np.testing.assert_array_equal(result.as_numpy("y"), x * 2)
    np.testing.assert_array_equal(result.as_numpy("argmax"), [0, 1])
    assert result.get_response().id == "abc"
    # no outputs named: all of them; BOOL and UINT8 through raw contents
    mask = np.array([[True, False]])
    k = np.array([[0, 3]], np.uint8)
    got = client.infer("flip", [_x(mask, "mask", "BOOL"), _x(k, "k", "UINT8")])
    np.testing.assert_array_equal(got.as_numpy("out"), ~mask ^ (k > 0))


def test_typed_contents_are_read_and_checked(served: _Served) -> None:
    """Inputs in `contents` (as other KServe clients send them): the same values as raw."""
    with grpc.insecure_channel(served.url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        req = pb.ModelInferRequest(model_name="double")
        t = req.inputs.add(name="x", datatype="FP32", shape=[1, 3])
        t.contents.fp32_contents.extend([1.0, 2.0, -4.5])
        resp = stub.ModelInfer(req, timeout=10)
        y = np.frombuffer(resp.raw_output_contents[0], np.float32)
        np.testing.assert_array_equal(y, [2.0, 4.0, -9.0])
        t.contents.ClearField("fp32_contents")
        t.contents.int_contents.extend([1, 2, 3])
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(req, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "contents.fp32_contents, not int_contents" in e.value.details()


def test_errors_get_triton_status_codes_and_it_keeps_serving(
    served: _Served, client: triton.InferenceServerClient
) -> None:
    with pytest.raises(InferenceServerException, match="dimension 1 is 4, expected 3") as e:
        client.infer("double", [_x(np.zeros((1, 4), np.float32))])
    assert _code(e) == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException, match="datatype FP64, model double expects"
                       ) as e:
        client.infer("double", [_x(np.zeros((1, 3)), datatype="FP64")])
    assert _code(e) == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException, match="unknown model 'nope'") as e:
        client.infer("nope", [_x(np.zeros((1, 3), np.float32))])
    assert _code(e) == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException) as e:  # over max_body_bytes (4 KiB)
        client.infer("double", [_x(np.zeros((1, 3), np.float32))], request_id="x" * 8192)
    assert _code(e) == "StatusCode.RESOURCE_EXHAUSTED"
    with pytest.raises(InferenceServerException, match="worker for broken died") as e:
        client.infer("broken", [_x(np.zeros(1, np.int32), datatype="INT32")])
    assert _code(e) == "StatusCode.INTERNAL"
    served.backend.ready["double"] = False
    try:
        assert not client.is_server_ready() and not client.is_model_ready("double")
        with pytest.raises(InferenceServerException, match="not ready") as e:
            client.infer("double", [_x(np.ones((1, 3), np.float32))])
        assert _code(e) == "StatusCode.UNAVAILABLE"
    finally:
        served.backend.ready["double"] = True
    with pytest.raises(InferenceServerException, match="allow_client_shm") as e:
        client.get_system_shared_memory_status()  # off unless allowed
    assert _code(e) == "StatusCode.INVALID_ARGUMENT"
    # still serving, and every failure of a known model counted as HTTP counts it
    got = client.infer("double", [_x(np.ones((1, 3), np.float32))]).as_numpy("y")
    np.testing.assert_array_equal(got, [[2, 2, 2]])
    stats = client.get_inference_statistics("double", as_json=True)["model_stats"][0]
    assert int(stats["inference_stats"]["fail"]["count"]) >= 4


def test_stream_answers_every_request_errors_included(
        client: triton.InferenceServerClient) -> None:
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for i in range(3):
            x = np.full((1, 3), i, np.float32)
            client.async_stream_infer("double", [_x(x)], request_id=f"r{i}")
        client.async_stream_infer("double", [_x(np.zeros((1, 2), np.float32))], request_id="bad")
        got = [answers.get(timeout=10) for _ in range(4)]
    finally:
        client.stop_stream()
    ok = {r.get_response().id: r.as_numpy("y") for r, err in got if err is None}
    assert sorted(ok) == ["r0", "r1", "r2"]
    for i in range(3):
        np.testing.assert_array_equal(ok[f"r{i}"], np.full((1, 3), 2 * i))
    errors = [err for _, err in got if err is not None]
    assert len(errors) == 1 and "dimension 1 is 2, expected 3" in str(errors[0])


def test_aio_client(served: _Served) -> None:
    async def main() -> np.ndarray:
        async with triton_aio.InferenceServerClient(served.url) as c:
            assert await c.is_server_live()
            inp = triton_aio.InferInput("x", [1, 3], "FP32")
            inp.set_data_from_numpy(np.array([[1, 2, 3]], np.float32))
            return (await c.infer("double", [inp])).as_numpy("y")

    np.testing.assert_array_equal(asyncio.run(main()), [[2, 4, 6]])


def test_token_required_as_http_requires_it(linked: bool, tmp_path: Path) -> None:
    s = _Served(token=TOKEN, linked=linked, folder=tmp_path)
    c = triton.InferenceServerClient(s.url)
    try:
        assert c.is_server_live()  # /v2/health/ is open, as over HTTP
        x = [_x(np.ones((1, 3), np.float32))]
        with pytest.raises(InferenceServerException, match="unauthorized") as e:
            c.infer("double", x)
        assert _code(e) == "StatusCode.UNAUTHENTICATED"
        with pytest.raises(InferenceServerException) as e:
            c.infer("double", x, headers={"authorization": "Bearer wrong"})
        assert _code(e) == "StatusCode.UNAUTHENTICATED"
        y = c.infer("double", x, headers={"authorization": f"Bearer {TOKEN}"}).as_numpy("y")
        np.testing.assert_array_equal(y, [[2, 2, 2]])
    finally:
        c.close()
        s.close()


def test_tls_with_the_http_servers_certificate(linked: bool, tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    s = _Served(linked=linked, folder=tmp_path, tls=(cert, key))
    secure = triton.InferenceServerClient(s.url, ssl=True, root_certificates=str(cert))
    plain = triton.InferenceServerClient(s.url)
    try:
        y = secure.infer("double", [_x(np.ones((1, 3), np.float32))]).as_numpy("y")
        np.testing.assert_array_equal(y, [[2, 2, 2]])
        with pytest.raises(InferenceServerException) as e:  # no TLS: no answer
            plain.is_server_live(client_timeout=5)
        assert _code(e) in ("StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED")
    finally:
        secure.close()
        plain.close()
        s.close()


class _Refusing(FakeBackend):
    """Refuses a request of more than one item for the work ahead of it, as the runtime's
    `check_batch` does (429 `work_ahead`, with a time to retry after)."""

    def check_batch(self, model: str, n: int, since_s: float = 0.0,
                    ready_s: float = 0.0) -> None:
        if n > 1:
            e = Overloaded(f"model {model}: {n} items would be late")
            e.rule, e.retry_after_s = "work_ahead", 1.5
            raise e


def test_a_refusal_is_unavailable_with_its_rule_as_triton_answers_a_full_queue(
        linked: bool, tmp_path: Path) -> None:
    s = _Served(backend=_Refusing(), linked=linked, folder=tmp_path)
    try:
        with grpc.insecure_channel(s.url) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            req = pb.ModelInferRequest(model_name="double")
            req.inputs.add(name="x", datatype="FP32", shape=[2, 3])
            req.raw_input_contents.append(np.ones((2, 3), np.float32).tobytes())
            with pytest.raises(grpc.RpcError) as e:
                stub.ModelInfer(req, timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "2 items would be late" in e.value.details()
            assert ("dstack-reason", "work_ahead") in e.value.trailing_metadata()
            assert ("retry-after", "2") in e.value.trailing_metadata()
            del req.inputs[0].shape[:]
            req.inputs[0].shape.extend([1, 3])
            req.raw_input_contents[0] = np.ones((1, 3), np.float32).tobytes()
            assert stub.ModelInfer(req, timeout=10).outputs[0].name == "y"
        assert s.app.state.metrics.failures.total("double") == 1
    finally:
        s.close()


def test_malformed_and_fuzzed_messages_are_invalid_argument_never_internal(
        served: _Served) -> None:
    """Bytes that are not a ModelInferRequest, and real requests with bytes flipped: each
    is answered (OK or INVALID_ARGUMENT / NOT_FOUND), none as our fault, none hangs."""
    rng = np.random.default_rng(0)
    good = pb.ModelInferRequest(model_name="double")
    good.inputs.add(name="x", datatype="FP32", shape=[1, 3])
    good.raw_input_contents.append(np.ones((1, 3), np.float32).tobytes())
    wire = good.SerializeToString()
    payloads = [b"\xff\xff\xff", b"\x0a\x05ab"]
    for _ in range(200):
        b = bytearray(wire)
        for i in rng.integers(0, len(b), rng.integers(1, 4)):
            b[i] = int(rng.integers(0, 256))
        payloads.append(bytes(b))
    codes: set[grpc.StatusCode] = set()
    with grpc.insecure_channel(served.url) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        for payload in payloads:
            try:
                call(payload, timeout=10)
                codes.add(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                codes.add(e.code())
                assert e.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                    grpc.StatusCode.NOT_FOUND), (payload, e.details())
        with pytest.raises(grpc.RpcError) as e:
            call(b"\xff\xff\xff", timeout=10)
        assert "malformed ModelInferRequest" in e.value.details()
        stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                       response_deserializer=pb.ModelStreamInferResponse.FromString)
        answers = list(stream(iter([b"\xff\xff\xff", wire]), timeout=10))
    assert grpc.StatusCode.INVALID_ARGUMENT in codes
    assert sorted(bool(a.error_message) for a in answers) == [False, True]
    assert any("malformed" in a.error_message for a in answers)


class _Timing(FakeBackend):
    """Keeps how long each request had waited when it ran."""

    def __init__(self) -> None:
        super().__init__()
        self.waited: list[float] = []

    async def infer(self, model: str, inputs: dict[str, np.ndarray],
                    since_received_s: float = 0.0) -> dict[str, np.ndarray]:
        self.waited.append(since_received_s)
        return await super().infer(model, inputs, since_received_s)


def test_a_front_ends_call_counts_its_deadline_from_when_the_front_end_had_it() -> None:
    """A call that waited in its front end (a busy link, a stalled loop) has that much
    less time: the servicer answers it from the front end's time, not its own."""
    s = _Served(backend=_Timing())
    try:
        req = pb.ModelInferRequest(model_name="double")
        req.inputs.add(name="x", datatype="FP32", shape=[1, 3])
        req.raw_input_contents.append(np.ones((1, 3), np.float32).tobytes())
        servicer = s.endpoint.servicer
        assert servicer is not None
        code, _, _, out = s.call(servicer.answer_linked(
            "ModelInfer", req.SerializeToString(), "ipv4:127.0.0.1:5", [],
            time.monotonic() - 2.0))
        assert code == 0 and pb.ModelInferResponse.FromString(out).outputs[0].name == "y"
        assert s.backend.waited[-1] >= 2.0  # type: ignore[attr-defined]
        code, details, _, _ = s.call(servicer.answer_linked(
            "NoSuchMethod", b"", None, [], time.monotonic()))
        assert code == grpc.StatusCode.UNIMPLEMENTED.value[0] and "NoSuchMethod" in details
    finally:
        s.close()
