"""`dstack cluster serve` on a real local Ray cluster: two CPU nodes of one core each
(`ray.cluster_utils.Cluster`, every address 127.0.0.1), one KServe v2 ingress
(`server.cluster`), tritonclient and httpx requests.

In order, on one cluster: both nodes answer; /metrics has every node's counters and
/stats sums them; nothing listens beyond loopback; a move under load (forced by feeding
rates) loses no request; removing a Ray node re-places its models on the survivor and no
request hangs.

Slow (Ray's processes and one torch worker per model start in about a minute on a 2-core
machine): marked `slow`, bounded by the timeout below. Everything it starts is stopped in
the fixture's teardown."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.e2e.server_process import loopback

# Before Ray is imported: every node address is loopback (Ray's own switch for laptops),
# so nothing here listens on another interface.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parents[2]
MODELS = ("tiny_a", "tiny_b", "mob")
BODY = {"inputs": [{"name": "input", "shape": [1, 3, 32, 32], "datatype": "FP32",
                    "data": [0.5] * (3 * 32 * 32)}]}


def cluster_config():  # type: ignore[no-untyped-def]
    from dstack.cluster.config import parse_cluster

    node = {"device": "cpu", "profiles": str(ROOT / "profiles" / "cpu"), "memory_mb": 2048,
            "num_cpus": 1}
    return parse_cluster({
        "policy": "dstack",
        "adapt": {"enabled": False},
        "ingress": {"health_interval_s": 0.5, "ping_timeout_s": 2.0, "dead_after": 3},
        # Resident models keep tiny_a and mob on a, tiny_b on b.
        "nodes": [{**node, "name": "a", "cores": [0], "resident": ["tiny_a", "mob"]},
                  {**node, "name": "b", "cores": [1], "resident": ["tiny_b"]}],
        "models": [
            {"name": "tiny_a", "zoo_name": "tiny_cnn", "slo_ms": 500, "rate_rps": 20,
             "max_batch_size": 4, "max_replicas": 1},
            {"name": "tiny_b", "zoo_name": "tiny_cnn", "slo_ms": 500, "rate_rps": 20,
             "max_batch_size": 4, "max_replicas": 1},
            # 32 x 32 inputs (the profile's latencies are at 224: only the plan uses them)
            {"name": "mob", "zoo_name": "mobilenet_v3_small", "slo_ms": 1000, "rate_rps": 5,
             "max_batch_size": 4, "max_replicas": 1, "input_shape": [3, 32, 32]},
        ],
    })


@dataclass
class Ingress:
    url: str
    controller: Any
    run: Any  # server.cluster.ControllerRun
    cluster: Any  # ray.cluster_utils.Cluster

    def call(self, coro: Any, timeout_s: float = 240) -> Any:
        """Run `coro` on the ingress's event loop (the controller lives there)."""
        return asyncio.run_coroutine_threadsafe(coro, self.run.loop).result(timeout_s)

    def view(self) -> dict[str, Any]:
        import httpx

        return httpx.get(f"http://{self.url}/v1/cluster", timeout=10).json()


@pytest.fixture(scope="module")
def ingress() -> Iterator[Ingress]:
    from ray.cluster_utils import Cluster

    from dstack.cluster.control import ClusterController
    from dstack.cluster.planning import ClusterPlanner
    from dstack.cluster.serving import RayDeployer, start_ray, stop_ray
    from server.cluster import ControllerRun, cluster_app
    from server.main import _Serving, bind, server_config

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1,
                                                            "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    server = thread = None
    try:
        cfg = cluster_config()
        ray.init(address=cluster.address, log_to_driver=False)
        start_ray(cfg)
        planner = ClusterPlanner(cfg)
        controller = ClusterController(cfg, RayDeployer(cfg, planner), planner=planner)
        run = ControllerRun(controller)
        sock = bind("127.0.0.1", 0)
        ready = threading.Event()
        server = _Serving(server_config(cluster_app(controller), cfg.server,
                                        log_level="warning"), run, ready.set)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        assert ready.wait(300), "the cluster did not start in 300 s"
        yield Ingress(f"127.0.0.1:{sock.getsockname()[1]}", controller, run, cluster)
    finally:
        if server is not None:
            server.should_exit = True
        if thread is not None:
            thread.join(timeout=60)
        try:
            stop_ray()
        finally:
            cluster.shutdown()


# Each model's client sends some 12 requests a second across a move and has one in
# flight about 40% of the time (a request takes ~30 ms here): load across every switch,
# drain and retire, light enough that the nodes' new workers, starting on one core each,
# start in ~20% less time than under 20 ms pauses (~50 requests a second in all).
PAUSE_S = 0.05
REFUSED_PAUSE_S = 0.25


class Load:
    """A closed loop of httpx clients per model in threads; every status counted."""

    def __init__(self, url: str, models: tuple[str, ...], per_model: int = 2) -> None:
        self.url = url
        self.stop = threading.Event()
        self.codes: dict[str, dict[int, int]] = {m: {} for m in models}
        self.errors: list[str] = []
        self.slowest_s = 0.0
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._loop, args=(m,), daemon=True)
                        for m in models for _ in range(per_model)]

    def _loop(self, model: str) -> None:
        import httpx

        with httpx.Client(timeout=30) as http:
            while not self.stop.is_set():
                t0 = time.monotonic()
                try:
                    r = http.post(f"http://{self.url}/v2/models/{model}/infer", json=BODY)
                    code, text = r.status_code, r.text[:200]
                    if "retry-after" in r.headers:
                        text = f"(retry after {r.headers['retry-after']} s) {text}"
                except httpx.HTTPError as e:
                    code, text = -1, repr(e)
                with self.lock:
                    self.slowest_s = max(self.slowest_s, time.monotonic() - t0)
                    self.codes[model][code] = self.codes[model].get(code, 0) + 1
                    if code != 200:
                        self.errors.append(f"{model}: {code} {text}")
                # Refused for want of a node (503 with Retry-After, while a dead node's
                # models start elsewhere): wait longer, as a client told to retry later
                # does, rather than ask ~40 times a second for half a minute.
                time.sleep(REFUSED_PAUSE_S if code == 503 else PAUSE_S)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)


def test_tritonclient_requests_are_answered_by_both_nodes(ingress: Ingress) -> None:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(ingress.url)
    try:
        assert client.is_server_ready()
        for model in MODELS:
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
    view = ingress.view()
    answered = {n["name"]: n["answered_per_model"] for n in view["nodes"]}
    assert answered == {"a": {"tiny_a": 3, "mob": 3}, "b": {"tiny_b": 3}}
    assert view["placement"]["copies"] == {"a": {"mob": 1, "tiny_a": 1}, "b": {"tiny_b": 1}}
    assert {n["name"]: bool(n["ray_node_id"]) for n in view["nodes"]} == {"a": True, "b": True}


def test_metrics_carry_each_nodes_counters_and_stats_sum_them(ingress: Ingress) -> None:
    import httpx

    text = httpx.get(f"http://{ingress.url}/metrics", timeout=10).text
    assert 'dstack_node_request_success_total{model="tiny_a",node="a"} 3.0' in text
    assert 'dstack_node_request_success_total{model="tiny_b",node="b"} 3.0' in text
    assert 'dstack_node_exec_count_total{model="mob",node="a"}' in text
    assert 'dstack_node_up{node="a"} 1.0' in text and 'dstack_node_up{node="b"} 1.0' in text
    assert 'nv_inference_request_success{model="tiny_a",version="1"} 3' in text
    stats = httpx.get(f"http://{ingress.url}/v2/models/tiny_b/stats", timeout=10).json()
    inf = stats["model_stats"][0]["inference_stats"]
    assert inf["success"]["count"] == 3
    assert stats["model_stats"][0]["inference_count"] == 6  # 3 requests of 2 items


def _listening(pids: list[int]) -> list[tuple[int, str, str, int]]:
    import psutil

    out = []
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for c in conns:
            tcp_listen = c.status == psutil.CONN_LISTEN
            udp_bound = c.type == 2 and c.laddr  # SOCK_DGRAM: bound is listening
            if tcp_listen or udp_bound:
                out.append((pid, psutil.Process(pid).name(), c.laddr.ip, c.laddr.port))
    return out


def test_nothing_listens_beyond_loopback(ingress: Ingress) -> None:
    psutil = pytest.importorskip("psutil")
    me = psutil.Process()
    pids = [me.pid, *(p.pid for p in me.children(recursive=True))]
    socks = _listening(pids)
    assert len(pids) > 10 and socks  # Ray's processes, the nodes' workers, the ingress
    port = int(ingress.url.rsplit(":", 1)[1])
    assert any(s[3] == port for s in socks)
    exposed = [s for s in socks if not loopback(s[2])]
    assert exposed == [], f"listening beyond loopback: {exposed}"


def test_a_move_under_load_loses_no_request(ingress: Ingress) -> None:
    with Load(ingress.url, MODELS, per_model=1) as load:
        time.sleep(1.0)
        # mobilenet's rate up 30x: it needs node a to itself, so tiny_a moves to b.
        placement = ingress.call(ingress.controller.feed_rates({"mob": 150}))
        time.sleep(1.0)
    assert placement.copies == {"a": {"mob": 1}, "b": {"tiny_a": 1, "tiny_b": 1}}
    # Lost: a 5xx, a hang, a dropped connection. A refusal is an answer: tiny_a's worker
    # starting on b's one core can stall tiny_b's batch, and the estimate then refuses
    # (429 work_ahead, seen once in four runs on a busy machine) until it re-measures.
    lost = [e for e in load.errors if not e.split(": ", 1)[1].startswith("429 ")]
    assert lost == []
    for m in MODELS:
        assert load.codes[m].get(200, 0) > 5, load.codes
        assert load.codes[m].get(429, 0) <= 0.1 * sum(load.codes[m].values()), load.codes
    view = ingress.view()
    assert view["serving"] == {"a": {"mob": 1}, "b": {"tiny_a": 1, "tiny_b": 1}}
    events = [e["event"] for e in view["events"]]
    assert events[-1] == "placed" and events.count("configured") >= 2


def test_a_removed_node_is_replaced_and_no_request_hangs(ingress: Ingress) -> None:
    cluster = ingress.cluster
    worker = next(n for n in cluster.list_all_nodes() if n is not cluster.head_node)
    view = ingress.view()
    victim = next(n for n in view["nodes"] if n["ray_node_id"] == worker.node_id)
    survivor = next(n["name"] for n in view["nodes"] if n is not victim)
    with Load(ingress.url, MODELS, per_model=1) as load:
        time.sleep(0.5)
        cluster.remove_node(worker)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            v = ingress.view()
            if sorted(v["serving"].get(survivor, {})) == sorted(MODELS):
                break
            time.sleep(0.5)
        time.sleep(1.0)
    v = ingress.view()
    assert next(n for n in v["nodes"] if n["name"] == victim["name"])["dead"]
    assert sorted(v["serving"][survivor]) == sorted(MODELS), v["events"]
    # Requests in flight on the dead node fail fast with 5xx naming it; those sent while
    # its models had no node are refused at once with a time to retry after (503
    # no_node); none hangs (each call is bounded by its SLO).
    for e in load.errors:
        assert " 503 " in e or " 504 " in e, e
        if "no node serves it now" in e:
            assert "(retry after " in e and f"its node {victim['name']} went down" in e, e
        else:
            assert f"tried {victim['name']} " in e, e
    assert load.slowest_s < 10
    import httpx

    # every failure counted once, in the stats as in /metrics
    text = httpx.get(f"http://{ingress.url}/metrics", timeout=10).text
    for m in MODELS:
        stats = httpx.get(f"http://{ingress.url}/v2/models/{m}/stats", timeout=10).json()
        failed = stats["model_stats"][0]["inference_stats"]["fail"]["count"]
        in_metrics = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                         if line.startswith("nv_inference_request_failure{")
                         and f'model="{m}"' in line)
        assert failed == in_metrics, (m, failed, in_metrics)

    for m in MODELS:
        r = httpx.post(f"http://{ingress.url}/v2/models/{m}/infer", json=BODY, timeout=30)
        assert r.status_code == 200, r.text
