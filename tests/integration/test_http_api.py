"""The HTTP app over a small hand-written fake backend: every route, status code and
`{"error": ...}` body, the binary tensor extension end to end (with tritonclient's own
request builder and response parser), and that the server keeps serving after bad
requests."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from anyio.from_thread import BlockingPortal, start_blocking_portal

from dstack.common.types import ModelPlan, Plan, Schedule, Slot, SolverStatus
from server import codec
from server.app import create_app
from tests.integration.fakes import FakeBackend

LIMIT = 64 * 1024


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


class Client:
    """Synchronous calls into the ASGI app through httpx's ASGITransport (what
    starlette's Client does, without its deprecated httpx path)."""

    def __init__(self, portal: BlockingPortal, app: Any) -> None:
        self.portal = portal
        transport = httpx.ASGITransport(app=app)
        self.http = httpx.AsyncClient(transport=transport, base_url="http://test")

    def request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        content = kwargs.get("content")
        if isinstance(content, Iterator):  # streamed (chunked) body
            kwargs["content"] = _aiter(list(content))
        return self.portal.call(lambda: self.http.request(method, url, **kwargs))

    def get(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("GET", url, **kwargs)

    def post(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("POST", url, **kwargs)


async def _aiter(chunks: list[bytes]) -> AsyncIterator[bytes]:
    for c in chunks:
        yield c


@pytest.fixture
def client(backend: FakeBackend) -> Iterator[Client]:
    with start_blocking_portal() as portal:
        c = Client(portal, create_app(backend, max_body_bytes=LIMIT))
        yield c
        portal.call(c.http.aclose)


def good_request(client: Client) -> None:
    """A request that must succeed whatever came before it."""
    r = client.post("/v2/models/double/infer", json=json_infer([[1, 5, 2]]))
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == [2, 10, 4]


def json_infer(x: list[list[float]], **extra: object) -> dict:
    shape = [len(x), len(x[0])]
    inp = {"name": "x", "datatype": "FP32", "shape": shape, "data": sum(x, [])}
    return {"inputs": [inp], **extra}


def assert_error(r, status: int, *needles: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    for n in needles:
        assert n in body["error"], body["error"]


# --------------------------------------------------------------------------- server routes


def test_server_metadata_and_health(client: Client, backend: FakeBackend) -> None:
    meta = client.get("/v2").json()
    assert meta["name"] == "dstack" and "binary_tensor_data" in meta["extensions"]
    assert isinstance(meta["version"], str)
    assert client.get("/v2/health/live").status_code == 200
    assert client.get("/v2/health/ready").status_code == 200
    backend.ready["flip"] = False
    assert_error(client.get("/v2/health/ready"), 503, "not ready")
    assert client.get("/v2/health/live").status_code == 200
    index = client.post("/v2/repository/index").json()
    assert {m["name"]: m["state"] for m in index} == {
        "double": "READY",
        "flip": "UNAVAILABLE",
        "broken": "READY",
    }


def test_model_metadata_ready_and_versions(client: Client, backend: FakeBackend) -> None:
    for prefix in ("/v2/models/double", "/v2/models/double/versions/1"):
        meta = client.get(prefix).json()
        assert meta["name"] == "double" and meta["versions"] == ["1"]
        assert meta["platform"] == "pytorch_libtorch"
        assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 3]}]
        assert meta["outputs"][1] == {"name": "argmax", "datatype": "INT64", "shape": [-1]}
        assert client.get(prefix + "/ready").status_code == 200
    assert_error(client.get("/v2/models/double/versions/2"), 404, "no version '2'")
    assert_error(client.get("/v2/models/double/versions/2/ready"), 404, "no version '2'")
    assert_error(client.get("/v2/models/nope"), 404, "unknown model 'nope'")
    assert_error(client.get("/v2/models/nope/ready"), 404, "nope")
    backend.ready["double"] = False
    assert_error(client.get("/v2/models/double/ready"), 503, "model double is not ready")
    assert_error(client.get("/v2/nothing/here"), 404, "no route GET /v2/nothing/here")
    for prefix in ("/v2/models/double", "/v2/models/double/versions/1"):
        # the infer routes come first in the router: what they do not take goes on
        assert_error(client.get(prefix + "/infer"), 405, "Method Not Allowed")
        assert client.get(prefix + "/config").json()["name"] == "double"


def test_stats_count_requests_and_batches(client: Client) -> None:
    client.post("/v2/models/double/infer", json=json_infer([[1, 2, 3], [4, 5, 6]]))
    client.post("/v2/models/double/versions/1/infer", json=json_infer([[1, 2, 3]]))
    for prefix in ("/v2/models/double", "/v2/models/double/versions/1"):
        s = client.get(prefix + "/stats").json()["model_stats"][0]
        assert s["name"] == "double" and s["version"] == "1"
        assert s["inference_count"] == 3 and s["execution_count"] == 2
        assert s["inference_stats"]["success"]["count"] == 2
        assert s["inference_stats"]["queue"]["ns"] == 2000
        assert s["inference_stats"]["compute_infer"] == {"count": 2, "ns": 10000}
        assert s["dstack"]["avg_batch_size"] == 1.5
    assert_error(client.get("/v2/models/nope/stats"), 404, "nope")


def test_plan_and_schedule_views(client: Client, backend: FakeBackend) -> None:
    assert_error(client.get("/v1/plan"), 404, "policy fake makes no plan")
    assert_error(client.get("/v1/schedule"), 404, "policy fake has no schedule")
    backend.plan_ = Plan(
        (ModelPlan("double", 4, 50.0, 10.0, 200.0, 100.0, 100.0, 50.0),),
        cycle_ms=20.0,
        objective=1.0,
        status=SolverStatus.OPTIMAL,
    )
    backend.schedule_ = Schedule(20.0, (Slot("double", 0.0, 10.0, 50.0, (0,)),))
    plan = client.get("/v1/plan").json()
    assert plan["cycle_ms"] == 20.0 and plan["models"][0]["batch"] == 4
    assert Plan.from_dict(plan) == backend.plan_
    assert Schedule.from_dict(client.get("/v1/schedule").json()) == backend.schedule_


# --------------------------------------------------------------------------- infer


def test_json_infer_with_id_and_requested_outputs(client: Client) -> None:
    body = json_infer([[1, 5, 2], [9, 0, 3]], id="req-7", outputs=[{"name": "argmax"}])
    r = client.post("/v2/models/double/infer", json=body)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert codec.HEADER_LENGTH.lower() not in r.headers
    assert r.json() == {
        "model_name": "double",
        "model_version": "1",
        "id": "req-7",
        "outputs": [{"name": "argmax", "datatype": "INT64", "shape": [2], "data": [1, 0]}],
    }


def test_binary_infer_end_to_end_with_our_codec(client: Client) -> None:
    mask = np.array([[True, False], [False, False]])
    k = np.array([[0, 1], [255, 0]], np.uint8)
    body, hlen = codec.encode_request({"mask": mask, "k": k})
    r = client.post(
        "/v2/models/flip/versions/1/infer",
        content=body,
        headers={codec.HEADER_LENGTH: str(hlen), "Content-Type": "application/octet-stream"},
    )
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream"
    resp = codec.decode_response(r.content, r.headers[codec.HEADER_LENGTH])
    np.testing.assert_array_equal(resp.outputs["out"], ~mask ^ (k > 0))


@pytest.mark.parametrize("binary_in", [True, False], ids=["bin-in", "json-in"])
@pytest.mark.parametrize("binary_out", [True, False], ids=["bin-out", "json-out"])
def test_tritonclient_request_and_response_are_compatible(
    client: Client, binary_in: bool, binary_out: bool
) -> None:
    """tritonclient builds the request and parses the response: no running server
    needed to prove the wire format."""
    x = np.array([[0.25, -1.5, 3.0], [7.0, 2.0, 1e-3]], np.float32)
    inp = triton.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary_in)
    outs = [
        triton.InferRequestedOutput("y", binary_data=binary_out),
        triton.InferRequestedOutput("argmax", binary_data=binary_out),
    ]
    body, hlen = triton.InferenceServerClient.generate_request_body(
        [inp], outputs=outs, request_id="t-1"
    )
    headers = {} if hlen is None else {codec.HEADER_LENGTH: str(hlen)}
    r = client.post("/v2/models/double/infer", content=body, headers=headers)
    assert r.status_code == 200, r.text
    got_hlen = r.headers.get(codec.HEADER_LENGTH)
    assert (got_hlen is not None) == binary_out
    result = triton.InferResult.from_response_body(
        r.content, header_length=None if got_hlen is None else int(got_hlen)
    )
    np.testing.assert_array_equal(result.as_numpy("y"), x * 2)
    np.testing.assert_array_equal(result.as_numpy("argmax"), [2, 0])
    assert result.get_response()["id"] == "t-1"


def test_tritonclient_default_outputs_come_back_binary(client: Client) -> None:
    x = np.ones((1, 3), np.float32)
    inp = triton.InferInput("x", [1, 3], "FP32")
    inp.set_data_from_numpy(x)
    body, hlen = triton.InferenceServerClient.generate_request_body([inp])
    r = client.post(
        "/v2/models/double/infer", content=body, headers={codec.HEADER_LENGTH: str(hlen)}
    )
    assert r.status_code == 200, r.text
    result = triton.InferResult.from_response_body(
        r.content, header_length=int(r.headers[codec.HEADER_LENGTH])
    )
    np.testing.assert_array_equal(result.as_numpy("y"), x * 2)
    np.testing.assert_array_equal(result.as_numpy("argmax"), [0])


# --------------------------------------------------------------------------- errors


def bad_requests() -> list[tuple[str, dict, int, tuple[str, ...]]]:
    x = np.zeros((1, 3), np.float32)
    bin_body, hlen = codec.encode_request({"x": x})
    bin_headers = {codec.HEADER_LENGTH: str(hlen)}
    return [
        ("malformed JSON", {"content": b'{"inputs": [}'}, 400, ("malformed JSON",)),
        ("missing inputs", {"json": {"outputs": []}}, 400, ("no 'inputs'",)),
        (
            "wrong shape",
            {
                "json": {
                    "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [0] * 4}]
                }
            },
            400,
            ("shape [1,4]", "dimension 1 is 4, expected 3"),
        ),
        (
            "wrong datatype",
            {
                "json": {
                    "inputs": [{"name": "x", "datatype": "INT32", "shape": [1, 3], "data": [0] * 3}]
                }
            },
            400,
            ("datatype INT32", "expects FP32"),
        ),
        (
            "missing input",
            {
                "json": {
                    "inputs": [{"name": "z", "datatype": "FP32", "shape": [1, 3], "data": [0] * 3}]
                }
            },
            400,
            ("unknown input 'z'",),
        ),
        (
            "data length",
            {
                "json": {
                    "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [0] * 2}]
                }
            },
            400,
            ("2 values", "needs 3"),
        ),
        (
            "batch above max",
            {"json": json_infer([[0, 0, 0]] * 5)},
            400,
            ("batch dimension 5 is outside 1..4",),
        ),
        (
            "binary_data_size vs body",
            {"content": bin_body[:-2], "headers": bin_headers},
            400,
            ("binary_data_size 12", "runs past the end"),
        ),
        (
            "header length beyond body",
            {"content": bin_body, "headers": {codec.HEADER_LENGTH: "99999"}},
            400,
            ("Inference-Header-Content-Length 99999 is beyond",),
        ),
        ("unknown model", {"json": json_infer([[0, 0, 0]]), "model": "nope"}, 404, ("nope",)),
        (
            "body above limit",
            {"content": b" " * (LIMIT + 1)},
            413,
            (f"exceeds the limit of {LIMIT}",),
        ),
        (
            "chunked body above limit",
            {"content": iter([b" " * 40000, b" " * 40000])},
            413,
            (f"request body exceeds the limit of {LIMIT}",),
        ),
        ("backend error", {"json": {"inputs": [_int32(0)]}, "model": "broken"}, 500, ("died",)),
        (
            "unexpected exception",
            {"json": {"inputs": [_int32(1)]}, "model": "broken"},
            500,
            ("internal error: RuntimeError: boom",),
        ),
    ]


def _int32(v: int) -> dict:
    return {"name": "x", "datatype": "INT32", "shape": [1], "data": [v]}


BAD = bad_requests()


@pytest.mark.parametrize(
    ("kwargs", "status", "needles"), [b[1:] for b in BAD], ids=[b[0] for b in BAD]
)
def test_bad_request_is_named_and_server_keeps_serving(
    client: Client, kwargs: dict, status: int, needles: tuple[str, ...]
) -> None:
    kwargs = dict(kwargs)
    model = kwargs.pop("model", "double")
    assert_error(client.post(f"/v2/models/{model}/infer", **kwargs), status, *needles)
    good_request(client)


def test_not_ready_model_gets_503_and_others_still_serve(
    client: Client, backend: FakeBackend
) -> None:
    backend.ready["double"] = False
    r = client.post("/v2/models/double/infer", json=json_infer([[1, 2, 3]]))
    assert_error(r, 503, "model double is not ready")
    assert backend.calls["double"] == []
    mask = np.zeros((1, 2), bool)
    body, hlen = codec.encode_request({"mask": mask, "k": np.zeros((1, 2), np.uint8)})
    r = client.post("/v2/models/flip/infer", content=body, headers={codec.HEADER_LENGTH: str(hlen)})
    assert r.status_code == 200
    backend.ready["double"] = True
    good_request(client)


def raw_asgi_post(app: Any, headers: list[tuple[bytes, bytes]], receive: Any) -> list[dict]:
    """POST to the double model's infer route straight through ASGI, with our own
    `receive` (to see whether and how the body is read); returns the sent messages."""
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v2/models/double/infer",
        "raw_path": b"/v2/models/double/infer",
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    anyio.run(app, scope, receive, send)
    return sent


def test_oversized_content_length_is_refused_before_the_body_is_read(backend: FakeBackend) -> None:
    """413 from the header alone: the app never asks for the body."""

    async def receive() -> dict:
        raise AssertionError("the body was read")

    app = create_app(backend, max_body_bytes=LIMIT)
    sent = raw_asgi_post(app, [(b"content-length", str(10 * LIMIT).encode())], receive)
    assert sent[0]["status"] == 413
    assert "exceeds the limit" in json.loads(sent[1]["body"])["error"]


def test_client_disconnect_mid_body_is_not_an_internal_error(
    backend: FakeBackend, caplog: pytest.LogCaptureFixture
) -> None:
    messages = iter(
        [
            {"type": "http.request", "body": b'{"inputs": ', "more_body": True},
            {"type": "http.disconnect"},
        ]
    )

    async def receive() -> dict:
        return next(messages)

    app = create_app(backend, max_body_bytes=LIMIT)
    sent = raw_asgi_post(app, [(b"content-length", b"1000")], receive)
    assert sent[0]["status"] == 400
    assert "client disconnected after 11 bytes" in json.loads(sent[1]["body"])["error"]
    assert "unhandled" not in caplog.text
