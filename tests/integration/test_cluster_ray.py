"""`dstack cluster serve` on a real local Ray cluster: two CPU nodes of one core each
(`ray.cluster_utils.Cluster`), one KServe v2 ingress, tritonclient requests.

Slow (Ray's processes and one torch worker per node start in about a minute on a
2-core machine): marked `slow`; bounded by the timeout below. Everything it starts is
stopped in the fixture's teardown."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

# Before Ray is imported: every node address is loopback (Ray's own switch for laptops),
# so nothing here listens on another interface.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parents[2]


def cluster_config():  # type: ignore[no-untyped-def]
    from dstack.cluster.config import parse_cluster

    node = {"device": "cpu", "profiles": str(ROOT / "profiles" / "cpu"), "memory_mb": 2048,
            "num_cpus": 1}
    return parse_cluster({
        "policy": "dstack",
        "adapt": {"enabled": False},
        # Each model is resident on its own node, so the placement keeps them apart.
        "nodes": [{**node, "name": "a", "resident": ["tiny_a"]},
                  {**node, "name": "b", "resident": ["tiny_b"]}],
        "models": [
            {"name": "tiny_a", "zoo_name": "tiny_cnn", "slo_ms": 500, "rate_rps": 20,
             "max_batch_size": 4, "max_replicas": 1},
            {"name": "tiny_b", "zoo_name": "tiny_cnn", "slo_ms": 500, "rate_rps": 20,
             "max_batch_size": 4, "max_replicas": 1},
        ],
    })


@pytest.fixture(scope="module")
def ingress() -> Iterator[tuple[str, object]]:
    import uvicorn
    from ray import serve
    from ray.cluster_utils import Cluster

    from dstack.cluster.serving import cluster_app, deploy_nodes, start_ray

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1,
                                                            "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    server = thread = None
    try:
        cfg = cluster_config()
        ray.init(address=cluster.address, log_to_driver=False)
        start_ray(cfg)
        backend, _ = deploy_nodes(cfg, start_timeout_s=240)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(cluster_app(backend), log_level="warning"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        yield f"127.0.0.1:{port}", backend
    finally:
        if server is not None:
            server.should_exit = True
        if thread is not None:
            thread.join(timeout=10)
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()


def test_tritonclient_requests_are_answered_by_both_nodes(ingress) -> None:  # type: ignore[no-untyped-def]
    import httpx
    import tritonclient.http as httpclient

    url, backend = ingress
    client = httpclient.InferenceServerClient(url)
    try:
        assert client.is_server_ready()
        for model in ("tiny_a", "tiny_b"):
            meta = client.get_model_metadata(model)
            shape = [2, *[int(d) for d in meta["inputs"][0]["shape"][1:]]]
            x = np.random.default_rng(0).random(shape, dtype=np.float32)
            inp = httpclient.InferInput(meta["inputs"][0]["name"], shape, "FP32")
            inp.set_data_from_numpy(x, binary_data=True)
            for _ in range(3):
                out = client.infer(model, [inp]).as_numpy(meta["outputs"][0]["name"])
                assert out.shape[0] == 2 and np.isfinite(out).all()
    finally:
        client.close()
    view = httpx.get(f"http://{url}/v1/cluster", timeout=10).json()
    answered = {n["name"]: n["answered_per_model"] for n in view["nodes"]}
    assert answered == {"a": {"tiny_a": 3}, "b": {"tiny_b": 3}}
    assert view["placement"]["copies"] == {"a": {"tiny_a": 1}, "b": {"tiny_b": 1}}


def test_a_dead_node_fails_fast_and_the_other_keeps_answering(ingress) -> None:  # type: ignore[no-untyped-def]
    import httpx
    from ray import serve

    url, backend = ingress
    serve.delete("dstack-a")  # node a's deployment goes away
    body = {"inputs": [{"name": "input", "shape": [1, 3, 32, 32], "datatype": "FP32",
                        "data": [0.5] * (3 * 32 * 32)}]}
    t0 = time.monotonic()
    r = httpx.post(f"http://{url}/v2/models/tiny_a/infer", json=body, timeout=60)
    assert r.status_code == 503 and "tried a" in r.json()["error"]
    assert time.monotonic() - t0 < 30
    r = httpx.post(f"http://{url}/v2/models/tiny_b/infer", json=body, timeout=60)
    assert r.status_code == 200
