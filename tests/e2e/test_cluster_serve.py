"""A real `dstack cluster serve` process (a local Ray, one CPU node) holds the same start-up,
shutdown and security rules as `dstack serve`: a start-up error is one line and exit 2;
the bearer token, when set, is required of every route but health and metrics; nothing it
starts listens beyond loopback; SIGTERM drains, exits 0 and leaves none of the processes
it started (Ray's included)."""

from __future__ import annotations

import importlib.util
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.server_process import ROOT, launch, loopback, wait_ready

psutil = pytest.importorskip("psutil")

# Not imported here: Ray reads its loopback switches from the environment when first
# imported (tests/integration/test_cluster_ray.py sets them before it imports Ray).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300),
              pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                 reason="the [ray] extra is not installed")]

TOKEN = "e2e-cluster-token"
CLUSTER = {
    "ray": {"address": None, "host": "127.0.0.1"},
    "adapt": {"enabled": False},
    "nodes": [{"name": "a", "device": "cpu", "profiles": str(ROOT / "profiles" / "cpu"),
               "memory_mb": 2048, "num_cpus": 1, "cores": [0]}],
    "models": [{"name": "tiny", "zoo_name": "tiny_cnn", "slo_ms": 2000, "rate_rps": 5,
                "max_batch_size": 4}],
}
BODY = json.dumps({"inputs": [{"name": "input", "shape": [1, 3, 32, 32], "datatype": "FP32",
                               "data": [0.5] * 3072}]}).encode()


def _post(url: str, token: str | None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(f"http://{url}/v2/models/tiny/infer", data=BODY,
                                 headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_start_up_error_is_one_line_and_exit_2(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:  # the port is in use
        port = taken.getsockname()[1]
        path = tmp_path / "cluster.yaml"
        path.write_text(json.dumps({**CLUSTER, "server": {"host": "127.0.0.1", "port": port}}))
        run = subprocess.run([sys.executable, "-m", "dstack.cli", "cluster", "serve",
                              "--config", str(path)], cwd=ROOT, capture_output=True, text=True,
                             timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [
        f"error: cannot listen on 127.0.0.1:{port}: Address already in use"]
    assert "serving" not in run.stdout


def test_the_token_is_required_and_sigterm_drains_exits_0_and_leaves_no_process(
        tmp_path: Path) -> None:
    """...and with `ray.address: null` it starts a Ray of its own: not the one Ray's default
    joins, named by RAY_ADDRESS (here) or by /tmp/ray's last cluster, which may be gone
    (its start retried for minutes) or another's."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        gone = f"127.0.0.1:{s.getsockname()[1]}"  # closed once this block ends
    srv = launch(CLUSTER, tmp_path, env={"DSTACK_AUTH_TOKEN": TOKEN, "RAY_ADDRESS": gone},
                 command=("cluster", "serve"))
    try:
        wait_ready(srv, timeout_s=240)  # health is open without the token
        status, body = _post(srv.url, None)
        assert status == 401 and "token" in body["error"] and TOKEN not in json.dumps(body)
        assert _post(srv.url, "wrong")[0] == 401
        status, body = _post(srv.url, TOKEN)
        assert status == 200, body
        assert len(body["outputs"][0]["data"]) == 10
        assert srv.get("/metrics") == 200  # open by default, as with `dstack serve`
        assert srv.get("/v1/cluster") == 401
        started = psutil.Process(srv.pid).children(recursive=True)
        assert started  # Ray's processes, the node's worker
        listening = [(p.name(), c.laddr.ip, c.laddr.port)
                     for p in (psutil.Process(srv.pid), *started)
                     for c in p.net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN or (c.type == 2 and c.laddr)]
        assert any(port == srv.port for _, _, port in listening)
        exposed = [s for s in listening if not loopback(s[1])]
        assert exposed == [], f"listening beyond loopback: {exposed}"
        assert srv.stop(signal.SIGTERM, timeout_s=120) == 0, srv.text()
        assert "dstack cluster stopped" in srv.text()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(p.is_running() for p in started):
            time.sleep(0.2)
        left = [f"{p.pid} {p.name()}" for p in started if p.is_running()]
        assert left == [], left
    finally:
        srv.kill()
