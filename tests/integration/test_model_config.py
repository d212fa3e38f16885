"""Triton's model configuration extension, read by the real `tritonclient.http` client on a
real uvicorn socket: the fields match the deployment, dstack's own values sit under
`parameters` in Triton's form, and unknown models or versions are 404 `{"error"}`."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from dstack.common.types import ModelPlan, Plan, SolverStatus
from server.main import bind, build_app, make_server
from tests.integration.fakes import DEPLOY, FakeBackend


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, FakeBackend]]:
    backend = FakeBackend()
    server = make_server(build_app(DEPLOY, backend), log_level="warning")
    sock = bind("127.0.0.1", 0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started, "server did not start"
    yield f"127.0.0.1:{sock.getsockname()[1]}", backend
    server.should_exit = True
    thread.join(10)
    sock.close()


@pytest.fixture
def client(served: tuple[str, FakeBackend]) -> Iterator[triton.InferenceServerClient]:
    c = triton.InferenceServerClient(served[0])
    yield c
    c.close()


def params(config: dict) -> dict[str, str]:
    return {k: v["string_value"] for k, v in config["parameters"].items()}


def test_tritonclient_reads_the_config_and_it_matches_the_deployment(
    client: triton.InferenceServerClient,
) -> None:
    cfg = client.get_model_config("double")
    assert cfg == client.get_model_config("double", model_version="1")
    assert (cfg["name"], cfg["platform"], cfg["backend"]) == (
        "double", "pytorch_libtorch", "pytorch")
    assert cfg["max_batch_size"] == 4
    assert cfg["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [3]}]
    assert cfg["output"] == [
        {"name": "y", "data_type": "TYPE_FP32", "dims": [3]},
        {"name": "argmax", "data_type": "TYPE_INT64", "dims": []},
    ]
    assert cfg["dynamic_batching"] == {
        "preferred_batch_size": [], "max_queue_delay_microseconds": 3000}
    assert cfg["instance_group"] == [
        {"name": "double", "kind": "KIND_CPU", "count": 1, "gpus": []}]
    # No plan and no live batch or slice in the fake: those two are left out.
    assert params(cfg) == {"slo_ms": "250", "priority": "high", "rate_rps": "20",
                           "max_queue": "64", "policy": "fake"}
    flip = client.get_model_config("flip")
    assert flip["input"][1] == {"name": "k", "data_type": "TYPE_UINT8", "dims": [2]}
    assert params(flip)["slo_ms"] == "100"  # the config's default
    with pytest.raises(InferenceServerException, match="unknown model 'nope'"):
        client.get_model_config("nope")


def test_a_plan_gives_the_planned_batch_and_slice(
    served: tuple[str, FakeBackend], client: triton.InferenceServerClient,
) -> None:
    backend = served[1]
    backend.plan_ = Plan((ModelPlan("double", batch=2, percent=37.5, latency_ms=9.0,
                                    throughput_rps=100.0, expected_rps=20.0, served_rps=20.0,
                                    slo_ms=250.0),),
                         cycle_ms=20.0, objective=20.0, status=SolverStatus.OPTIMAL)
    try:
        cfg = client.get_model_config("double")
    finally:
        backend.plan_ = None
    assert cfg["dynamic_batching"]["preferred_batch_size"] == [2]
    assert params(cfg)["planned_batch_size"] == "2"
    assert params(cfg)["slice_percent"] == "37.5"


@pytest.mark.parametrize("path, needle", [
    ("/v2/models/nope/config", "unknown model 'nope'"),
    ("/v2/models/double/versions/2/config", "no version '2'"),
])
def test_unknown_model_or_version_is_404(
    served: tuple[str, FakeBackend], path: str, needle: str
) -> None:
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://{served[0]}{path}", timeout=5)
    assert e.value.code == 404
    body = json.loads(e.value.read())
    assert set(body) == {"error"} and needle in body["error"], body


def test_server_metadata_lists_the_extension(client: triton.InferenceServerClient) -> None:
    assert "model_configuration" in client.get_server_metadata()["extensions"]
