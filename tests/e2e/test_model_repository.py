"""Triton's model repository extension on a real server (policy dstack, so that a load
and an unload re-plan the lanes and move the other model's slice through a shadow
worker): tritonclient loads a second model with its config, infers on it, unloads it
while another model is under light load (which sees no failure), and the index shows
the states. Bad configs get 400 naming the field (weights that cannot be read too, in one
line), unknown models 404."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.e2e.server_process import ServerProcess
from tests.integration.test_runtime_policies import write_cpu_profiles

B_CONFIG = {"zoo_name": "tiny_cnn", "slo_ms": 3000, "max_batch_size": 8,
            "max_queue_delay_ms": 5, "rate_rps": 20}


def _post(url: str, path: str, body: object | None = None) -> tuple[int, dict | list]:
    data = b"" if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{url}{path}", data=data, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _states(url: str) -> dict[str, tuple[str, str]]:
    _, index = _post(url, "/v2/repository/index")
    return {e["name"]: (e["state"], e.get("reason", "")) for e in index}  # type: ignore[union-attr]


def _infer(client: httpclient.InferenceServerClient, model: str) -> np.ndarray:
    x = np.zeros((1, 3, 32, 32), np.float32)
    inp = httpclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return client.infer(model, [inp]).as_numpy("output")


def server_config(tmp_path: Path) -> dict:
    """This module's server (tests/e2e/conftest.py `module_server`)."""
    write_cpu_profiles(tmp_path)
    return {
        "policy": "dstack", "profiles": str(tmp_path), "cores": [0, 1],
        "adapt": {"enabled": False},
        "models": [{"name": "tiny_a", **B_CONFIG}],
    }


@pytest.mark.slow
def test_load_infer_unload_under_load_and_the_index(module_server: ServerProcess) -> None:
    srv = module_server
    client = httpclient.InferenceServerClient(srv.url, network_timeout=120)
    assert _states(srv.url) == {"tiny_a": ("READY", "")}

    # 400 naming the field; 404 for a model never seen and no config
    code, body = _post(srv.url, "/v2/repository/models/tiny_b/load",
                       {"parameters": {"config": json.dumps({**B_CONFIG, "slo_ms": -5})}})
    assert code == 400 and "config.slo_ms" in body["error"], body  # type: ignore[index]
    code, body = _post(srv.url, "/v2/repository/models/tiny_b/load",
                       {"parameters": {"config": "{not json"}})
    assert code == 400 and "parameters.config" in body["error"], body  # type: ignore[index]
    code, body = _post(srv.url, "/v2/repository/models/nope/load")
    assert code == 404 and "nope" in body["error"], body  # type: ignore[index]
    code, body = _post(srv.url, "/v2/repository/models/nope/unload")
    assert code == 404, body
    # weights that are not weights: 400 in one line (the worker's traceback, with the
    # server's paths in it, went to the client in a 500), the index says why
    code, body = _post(srv.url, "/v2/repository/models/tiny_b/load", {"parameters": {
        "config": json.dumps({**B_CONFIG, "weights": str(srv.log)})}})
    assert code == 400 and "cannot read weights" in body["error"], body  # type: ignore[index]
    assert "\n" not in body["error"] and "Traceback" not in body["error"]  # type: ignore[index]
    state, reason = _states(srv.url)["tiny_b"]
    assert state == "UNAVAILABLE" and "cannot read weights" in reason

    # Load: the index says LOADING while the worker starts, READY after.
    seen: set[str] = set()
    got: list[tuple[int, object]] = []
    loading = threading.Thread(target=lambda: got.append(_post(  # tritonclient: gevent, one
        srv.url, "/v2/repository/models/tiny_b/load",           # thread only
        {"parameters": {"config": json.dumps(B_CONFIG)}})))
    loading.start()
    while loading.is_alive():
        seen.add(_states(srv.url).get("tiny_b", ("-", ""))[0])
        time.sleep(0.05)
    loading.join()
    assert got[0][0] == 200, got
    assert "LOADING" in seen, seen
    assert _states(srv.url) == {"tiny_a": ("READY", ""), "tiny_b": ("READY", "")}
    assert client.is_model_ready("tiny_b")
    assert _infer(client, "tiny_b").shape == (1, 10)
    # the same config again: nothing to do
    t0 = time.monotonic()
    client.load_model("tiny_b", config=json.dumps(B_CONFIG))
    assert time.monotonic() - t0 < 2.0

    # Unload tiny_b while tiny_a is under light load: no tiny_a request fails.
    failures: list[BaseException] = []
    answered = [0]
    stop = threading.Event()

    body = {"inputs": [{"name": "input", "shape": [1, 3, 32, 32], "datatype": "FP32",
                        "data": [0.0] * (3 * 32 * 32)}]}

    def light_load() -> None:
        while not stop.is_set():
            try:
                code, out = _post(srv.url, "/v2/models/tiny_a/infer", body)
                if code != 200:
                    raise AssertionError(f"{code}: {out}")
                answered[0] += 1
            except Exception as e:  # noqa: BLE001 - every failure is the test's failure
                failures.append(e)
            time.sleep(0.02)

    load = threading.Thread(target=light_load)
    load.start()
    try:
        time.sleep(0.5)
        before = answered[0]
        client.unload_model("tiny_b")
        time.sleep(0.5)
    finally:
        stop.set()
        load.join()
    assert not failures, failures[:3]
    assert answered[0] > before
    states = _states(srv.url)
    assert states["tiny_a"] == ("READY", "")
    assert states["tiny_b"][0] == "UNAVAILABLE" and "unload" in states["tiny_b"][1]
    with pytest.raises(InferenceServerException, match="not loaded"):
        _infer(client, "tiny_b")
    ready_only = [e["name"] for e in client.get_model_repository_index() if e["state"] == "READY"]
    assert ready_only == ["tiny_a"]

    # Loaded again with the config it was known by.
    client.load_model("tiny_b")
    assert _infer(client, "tiny_b").shape == (1, 10)
