"""End to end: a real `dstack serve` process with its gRPC endpoint on, driven by the
unmodified `tritonclient.grpc` client beside `tritonclient.http` (127.0.0.1 only)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.e2e.conftest import ROOT, free_port
from tests.e2e.server_process import TINY, ServerProcess

GRPC_ON = re.compile(r"gRPC \(KServe v2 / Triton\) on 127\.0\.0\.1:(\d+)")


def server_config(tmp_path: Path) -> dict:
    """This module's server (tests/e2e/conftest.py `module_server`)."""
    return {"policy": "shared", "server": {"grpc_port": free_port()}, "models": [TINY]}


@pytest.fixture(scope="module")
def clients(module_server: ServerProcess):  # noqa: ANN201
    m = GRPC_ON.search(module_server.text())
    assert m is not None, module_server.text()
    g = grpcclient.InferenceServerClient(f"127.0.0.1:{m.group(1)}")
    h = httpclient.InferenceServerClient(module_server.url)
    yield g, h
    g.close()
    h.close()


def _grpc_input(x: np.ndarray, name: str = "input") -> grpcclient.InferInput:
    inp = grpcclient.InferInput(name, list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return inp


def test_health_metadata_and_outputs_as_over_http(clients) -> None:  # noqa: ANN001
    g, h = clients
    assert g.is_server_live() and g.is_server_ready() and g.is_model_ready("tiny_cnn")
    assert g.get_server_metadata().name == "dstack"
    meta = g.get_model_metadata("tiny_cnn")
    assert [list(t.shape) for t in meta.inputs] == [[-1, 3, 32, 32]]
    assert g.get_model_config("tiny_cnn").config.max_batch_size == 8

    x = np.random.default_rng(0).standard_normal((2, 3, 32, 32), dtype=np.float32)
    got = g.infer("tiny_cnn", [_grpc_input(x)]).as_numpy("output")
    inp = httpclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    want = h.infer("tiny_cnn", [inp]).as_numpy("output")
    assert got.shape == (2, 10)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_errors_have_their_codes_and_serving_goes_on(clients) -> None:  # noqa: ANN001
    g, h = clients
    with pytest.raises(InferenceServerException, match="input 'input'.*dimension 2") as e:
        g.infer("tiny_cnn", [_grpc_input(np.zeros((1, 3, 31, 32), np.float32))])
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException, match="unknown input 'x'") as e:
        g.infer("tiny_cnn", [_grpc_input(np.zeros((1, 3, 32, 32), np.float32), "x")])
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException, match="nope") as e:
        g.infer("nope", [_grpc_input(np.zeros((1, 3, 32, 32), np.float32))])
    assert e.value.status() == "StatusCode.NOT_FOUND"
    out = g.infer("tiny_cnn", [_grpc_input(np.ones((1, 3, 32, 32), np.float32))])
    assert out.as_numpy("output").shape == (1, 10)
    assert h.is_server_ready()
    # the refusals are the HTTP path's: counted in the same statistics
    stats = h.get_inference_statistics("tiny_cnn")["model_stats"][0]
    assert stats["inference_stats"]["fail"]["count"] >= 2


def test_a_grpc_port_in_use_is_a_one_line_start_up_error(tmp_path: Path) -> None:
    cfg = tmp_path / "deploy.yaml"
    cfg.write_text("models: [{name: tiny_cnn, slo_ms: 10000}]\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        proc = subprocess.run(
            [sys.executable, "-m", "dstack.cli", "serve", "--config", str(cfg), "--host",
             "127.0.0.1", "--port", "0", "--grpc-port", str(busy.getsockname()[1])],
            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("error: cannot listen for gRPC"), errors
