"""End to end: a real `dstack serve` process with `server.allow_client_shm` on, driven by
unmodified `tritonclient.http` and `tritonclient.grpc` with `tritonclient.utils
.shared_memory` (inputs read from and outputs written into the client's regions, as the
README shows), and a small fuzzer of absurd region names, offsets and sizes over both
protocols: only 400 / INVALID_ARGUMENT, no 5xx, no hang, and the server still serving."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from tests.e2e.conftest import ROOT, free_port
from tests.e2e.server_process import TINY, ServerProcess

GRPC_ON = re.compile(r"gRPC \(KServe v2 / Triton\) on 127\.0\.0\.1:(\d+)")
SHAPE = (2, 3, 32, 32)
IN_BYTES = int(np.prod(SHAPE)) * 4
OUT_BYTES = 2 * 10 * 4


def server_config(tmp_path: Path) -> dict:
    """This module's server (tests/e2e/conftest.py `module_server`)."""
    return {"policy": "shared", "models": [TINY],
            "server": {"grpc_port": free_port(), "allow_client_shm": True}}


@pytest.fixture(scope="module")
def clients(module_server: ServerProcess) -> Iterator[tuple[Any, Any]]:
    m = GRPC_ON.search(module_server.text())
    assert m is not None, module_server.text()
    g = grpcclient.InferenceServerClient(f"127.0.0.1:{m.group(1)}")
    h = httpclient.InferenceServerClient(module_server.url, network_timeout=30)
    yield g, h
    g.close()
    h.close()


@dataclass
class Regions:
    """The client's input and output regions (as the README's example makes them)."""

    ins: Any
    outs: Any
    in_key: str
    out_key: str


@pytest.fixture
def regions() -> Iterator[Regions]:
    tag = f"{os.getpid()}_{random.randrange(1 << 30)}"
    r = Regions(None, None, f"/dstack_in_{tag}", f"/dstack_out_{tag}")
    r.ins = shm.create_shared_memory_region("input_data", r.in_key, IN_BYTES)
    r.outs = shm.create_shared_memory_region("output_data", r.out_key, OUT_BYTES)
    yield r
    shm.destroy_shared_memory_region(r.ins)
    shm.destroy_shared_memory_region(r.outs)


def _plain_http(h: Any, x: np.ndarray) -> np.ndarray:
    inp = httpclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    return h.infer("tiny_cnn", [inp]).as_numpy("output")  # type: ignore[no-any-return]


def test_extensions_are_listed(clients) -> None:  # noqa: ANN001
    g, h = clients
    assert "system_shared_memory" in h.get_server_metadata()["extensions"]
    assert "system_shared_memory" in g.get_server_metadata().extensions


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_inputs_and_outputs_through_shared_memory(clients, regions, protocol) -> None:  # noqa: ANN001
    g, h = clients
    client, lib = (h, httpclient) if protocol == "http" else (g, grpcclient)
    x = np.random.default_rng(1).standard_normal(SHAPE, dtype=np.float32)
    shm.set_shared_memory_region(regions.ins, [x])
    client.unregister_system_shared_memory()
    client.register_system_shared_memory("input_data", regions.in_key, IN_BYTES)
    client.register_system_shared_memory("output_data", regions.out_key, OUT_BYTES)
    status = client.get_system_shared_memory_status(**({"as_json": True}
                                                       if protocol == "grpc" else {}))
    names = (sorted(status["regions"]) if protocol == "grpc"
             else sorted(r["name"] for r in status))
    assert names == ["input_data", "output_data"]

    inp = lib.InferInput("input", list(SHAPE), "FP32")
    inp.set_shared_memory("input_data", IN_BYTES)
    out = lib.InferRequestedOutput("output")
    out.set_shared_memory("output_data", OUT_BYTES)
    result = client.infer("tiny_cnn", [inp], outputs=[out])
    got = shm.get_contents_as_numpy(regions.outs, np.float32, [2, 10])
    np.testing.assert_allclose(got, _plain_http(h, x), atol=1e-5)
    answer = result.get_output("output")
    params = answer["parameters"] if protocol == "http" else {
        k: v.string_param or v.int64_param for k, v in answer.parameters.items()}
    assert params["shared_memory_region"] == "output_data"
    assert params["shared_memory_byte_size"] == OUT_BYTES

    # a region unregistered is gone for the next request, which is answered 400
    client.unregister_system_shared_memory("input_data")
    with pytest.raises(InferenceServerException, match="no shared memory region 'input_data'"):
        client.infer("tiny_cnn", [inp], outputs=[out])
    client.unregister_system_shared_memory()


def _http(url: str, path: str, body: object) -> int:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{url}{path}", data=data, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


ABSURD_INTS: list[Any] = [-1, 0, 1, 2**31, 2**53, 2**62, 2**63 - 1, IN_BYTES - 1,
                          IN_BYTES + 1, 7]
ABSURD_ANY: list[Any] = [*ABSURD_INTS, -(2**63), 2**64, 2**200, 1.5, "12", None, True, [],
                         {}]
NAMES: list[Any] = ["input_data", "nope", "", "x" * 5000, "../../etc/passwd", "\u00e9\u0000",
                    7, None]


def test_fuzzed_shm_fields_are_refused_cleanly(clients, regions, module_server) -> None:  # noqa: ANN001
    g, h = clients
    key = regions.in_key
    h.unregister_system_shared_memory()
    h.register_system_shared_memory("input_data", key, IN_BYTES)
    rng = random.Random(65)
    statuses: list[int] = []
    codes: set[str] = set()
    for _ in range(60):
        # HTTP: any JSON value in any field of the input's parameters, or of a register
        params: dict[str, Any] = {"shared_memory_region": rng.choice(NAMES),
                                  "shared_memory_byte_size": rng.choice(ABSURD_ANY)}
        if rng.random() < 0.7:
            params["shared_memory_offset"] = rng.choice(ABSURD_ANY)
        body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": list(SHAPE),
                            "parameters": params}]}
        if rng.random() < 0.3:
            body["outputs"] = [{"name": "output", "parameters": dict(params)}]
        statuses.append(_http(module_server.url, "/v2/models/tiny_cnn/infer", body))
        reg = {"key": rng.choice([key, "/nope", "", "/../x", 5, None]),
               "offset": rng.choice(ABSURD_ANY), "byte_size": rng.choice(ABSURD_ANY)}
        statuses.append(_http(module_server.url,
                              f"/v2/systemsharedmemory/region/fuzz{rng.randrange(3)}/register",
                              reg))
        # gRPC: what tritonclient lets through (int64 offsets and sizes, any name)
        name = rng.choice([n for n in NAMES if isinstance(n, str)])
        inp = grpcclient.InferInput("input", list(SHAPE), "FP32")
        size = rng.choice(ABSURD_INTS)
        offset = rng.choice(ABSURD_INTS)
        inp.set_shared_memory(name, size, offset)
        try:
            g.infer("tiny_cnn", [inp], client_timeout=20)
            codes.add("OK")
        except InferenceServerException as e:
            codes.add(str(e.status()))
        try:
            g.register_system_shared_memory(f"gfuzz{rng.randrange(3)}",
                                            rng.choice([key, "/nope", "/../x"]),
                                            rng.choice([1, IN_BYTES, 2**40]),
                                            rng.choice([0, 4096, 2**62]))
            codes.add("OK")
        except InferenceServerException as e:
            codes.add(str(e.status()))
    assert all(s == 200 or 400 <= s < 500 for s in statuses), sorted(set(statuses))
    assert codes <= {"OK", "StatusCode.INVALID_ARGUMENT", "StatusCode.NOT_FOUND"}, codes
    assert 400 in statuses and "StatusCode.INVALID_ARGUMENT" in codes
    # still serving, both ways
    h.unregister_system_shared_memory()
    x = np.ones(SHAPE, np.float32)
    assert _plain_http(h, x).shape == (2, 10)
    inp = grpcclient.InferInput("input", list(SHAPE), "FP32")
    inp.set_data_from_numpy(x)
    assert g.infer("tiny_cnn", [inp]).as_numpy("output").shape == (2, 10)
    assert module_server.proc.poll() is None


@pytest.mark.parametrize("protocol", ["grpc", "shm"])
def test_make_loadtest_protocol(module_server, protocol, tmp_path: Path) -> None:  # noqa: ANN001
    """`make loadtest PROTOCOL=grpc|shm`: every request answered through that protocol,
    counted as the server counts them, and the users' regions gone afterwards."""
    m = GRPC_ON.search(module_server.text())
    assert m is not None
    venv = Path(sys.executable).parents[1]
    out = tmp_path / "loadtest"
    before = set(Path("/dev/shm").glob("locust_*"))
    run = subprocess.run(
        ["make", "-s", "-o", f"{venv}/.installed-stamp", "loadtest",
         f"HOST=http://{module_server.url}", f"PROTOCOL={protocol}",
         f"GRPC_URL=127.0.0.1:{m.group(1)}", "DURATION=3s", "USERS=2", "RATE=10",
         f"LOADTEST_OUT={out}", f"VENV={venv}"],
        cwd=ROOT, env={**os.environ, "MAKEFLAGS": ""}, capture_output=True, text=True,
        timeout=90)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    r = json.loads((out / "summary.json").read_text())["models"]["tiny_cnn"]
    assert r["requests"] > 0 and r["error"] == 0, r
    assert r["server"]["requests_match"], r
    assert set(Path("/dev/shm").glob("locust_*")) <= before  # each user's regions removed
