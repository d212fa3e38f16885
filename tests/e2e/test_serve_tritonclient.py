"""End to end: a real server process, driven by the real tritonclient and by raw HTTP."""

from __future__ import annotations

import http.client
import json
import multiprocessing as mp
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import models
from tests.e2e.server_process import ServerProcess


def _weights(tmp_path: Path, name: str) -> Path:
    torch.manual_seed(0)
    path = tmp_path / f"{name}.pt"
    torch.save(models.load_model(name).state_dict(), path)
    return path


def _direct(name: str, weights: Path, x: np.ndarray) -> np.ndarray:
    m = models.load_model(name, weights=weights)
    with torch.inference_mode():
        return m(torch.from_numpy(x)).numpy()


def server_config(tmp_path: Path) -> dict:
    """This module's server (tests/e2e/conftest.py `module_server`), its weights files in
    `tmp_path`."""
    return {
        "policy": "shared",
        "server": {"max_body_bytes": 8 * 1024 * 1024},
        "models": [
            {"name": "tiny_cnn", "slo_ms": 5000, "max_batch_size": 8, "max_queue_delay_ms": 20,
             "weights": str(_weights(tmp_path, "tiny_cnn"))},
            {"name": "mobilenet_v3_small", "slo_ms": 10000, "max_batch_size": 4,
             "max_queue_delay_ms": 5, "weights": str(_weights(tmp_path, "mobilenet_v3_small"))},
        ],
    }


@pytest.fixture(scope="module")
def two_models(module_server: ServerProcess):  # noqa: ANN201
    return module_server, module_server.log.parent  # the weights are beside its log


def test_tritonclient_binary_and_json_match_the_model_run_directly(two_models) -> None:  # noqa: ANN001
    srv, tmp_path = two_models
    client = httpclient.InferenceServerClient(srv.url)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("tiny_cnn")
    meta = client.get_model_metadata("mobilenet_v3_small")
    assert meta["inputs"][0]["shape"] == [-1, 3, 224, 224]
    assert meta["inputs"][0]["datatype"] == "FP32"

    rng = np.random.default_rng(0)
    for name, shape in (("tiny_cnn", (3, 3, 32, 32)), ("mobilenet_v3_small", (2, 3, 224, 224))):
        x = rng.standard_normal(shape, dtype=np.float32)
        want = _direct(name, tmp_path / f"{name}.pt", x)
        for binary in (True, False):
            inp = httpclient.InferInput("input", list(x.shape), "FP32")
            inp.set_data_from_numpy(x, binary_data=binary)
            out = httpclient.InferRequestedOutput("output", binary_data=binary)
            got = client.infer(name, [inp], outputs=[out]).as_numpy("output")
            np.testing.assert_allclose(got, want, atol=1e-4, err_msg=f"{name} binary={binary}")
    client.close()


def _client_proc(url: str, n: int, q: mp.Queue) -> None:
    """One tritonclient per process: the client is gevent-based and not thread-safe."""
    client = httpclient.InferenceServerClient(url)
    x = np.ones((1, 3, 32, 32), np.float32)
    ok = 0
    for _ in range(n):
        inp = httpclient.InferInput("input", [1, 3, 32, 32], "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        r = client.infer("tiny_cnn", [inp])
        ok += r.as_numpy("output").shape == (1, 10)
    q.put(ok)


def test_concurrent_requests_are_all_answered_and_batched(two_models) -> None:  # noqa: ANN001
    srv, _ = two_models
    client = httpclient.InferenceServerClient(srv.url, concurrency=32)
    before = client.get_inference_statistics("tiny_cnn")["model_stats"][0]
    x = np.ones((1, 3, 32, 32), np.float32)
    pending = []
    for _ in range(32):
        inp = httpclient.InferInput("input", [1, 3, 32, 32], "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        pending.append(client.async_infer("tiny_cnn", [inp]))
    outs = [p.get_result().as_numpy("output") for p in pending]
    assert all(o.shape == (1, 10) for o in outs)
    np.testing.assert_allclose(outs[0], outs[-1], atol=1e-6)
    # and from several processes at once
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_client_proc, args=(srv.url, 8, q)) for _ in range(4)]
    for p in procs:
        p.start()
    assert sum(q.get(timeout=120) for _ in procs) == 32
    for p in procs:
        p.join(10)
    stats = client.get_inference_statistics("tiny_cnn")["model_stats"][0]
    inferences = stats["inference_count"] - before["inference_count"]
    executions = stats["execution_count"] - before["execution_count"]
    assert inferences == 64
    assert inferences / executions > 1, "32 requests in flight were never batched"
    client.close()


def _post(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://{url}", data=body, headers=headers or {},
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _announce_huge_body(url: str, path: str) -> tuple[int, dict]:
    """Announce a 9 MiB body and send none of it: the server must refuse from the
    Content-Length alone, before reading (sending it would only be reset)."""
    host, port = url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", path)
    conn.putheader("Content-Length", str(9 * 1024 * 1024))
    conn.endheaders()
    r = conn.getresponse()
    out = r.status, json.loads(r.read() or b"{}")
    conn.close()
    return out


BAD_REQUESTS = [
    ("malformed JSON", "tiny_cnn", b'{"inputs": [', {}, 400, "JSON"),
    ("missing input", "tiny_cnn", json.dumps({"inputs": []}).encode(), {}, 400, "input"),
    ("wrong shape", "tiny_cnn", json.dumps({"inputs": [
        {"name": "input", "shape": [1, 3, 31, 32], "datatype": "FP32",
         "data": [0.0] * (3 * 31 * 32)}]}).encode(), {}, 400, "shape"),
    ("wrong datatype", "tiny_cnn", json.dumps({"inputs": [
        {"name": "input", "shape": [1, 3, 32, 32], "datatype": "INT64",
         "data": [0] * 3072}]}).encode(), {}, 400, "datatype"),
    ("data length", "tiny_cnn", json.dumps({"inputs": [
        {"name": "input", "shape": [1, 3, 32, 32], "datatype": "FP32",
         "data": [0.0] * 100}]}).encode(), {}, 400, ""),
    ("unknown model", "nope", b"{}", {}, 404, "nope"),
    ("batch above max", "mobilenet_v3_small", json.dumps({"inputs": [
        {"name": "input", "shape": [5, 3, 224, 224], "datatype": "FP32",
         "parameters": {"binary_data_size": 5 * 3 * 224 * 224 * 4}}]}).encode()
     + bytes(5 * 3 * 224 * 224 * 4), "HEADER", 400, "batch"),
    ("binary size mismatch", "tiny_cnn", None, "BINSIZE", 400, "binary_data_size"),
    ("body over the limit", "mobilenet_v3_small", None, "HUGE", 413, "limit"),
]


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_input_gets_a_4xx_naming_the_problem_and_serving_goes_on(two_models, case) -> None:  # noqa: ANN001
    srv, _ = two_models
    _, model, body, headers, status, word = case
    if headers == "BINSIZE":
        header = json.dumps({"inputs": [{"name": "input", "shape": [1, 3, 32, 32],
                                         "datatype": "FP32",
                                         "parameters": {"binary_data_size": 12288}}]}).encode()
        body = header + bytes(100)
        headers = {"Inference-Header-Content-Length": str(len(header))}
    elif headers == "HEADER":
        hlen = body.index(b"}]}") + 3
        headers = {"Inference-Header-Content-Length": str(hlen)}
    if headers == "HUGE":
        code, payload = _announce_huge_body(srv.url, f"/v2/models/{model}/infer")
    else:
        code, payload = _post(f"{srv.url}/v2/models/{model}/infer", body, headers)
    assert code == status, payload
    assert "error" in payload and word.lower() in payload["error"].lower(), payload
    # the server keeps serving
    client = httpclient.InferenceServerClient(srv.url)
    inp = httpclient.InferInput("input", [1, 3, 32, 32], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 3, 32, 32), np.float32))
    assert client.infer("tiny_cnn", [inp]).as_numpy("output").shape == (1, 10)
    with pytest.raises(InferenceServerException):
        client.get_model_metadata("nope")
    client.close()
