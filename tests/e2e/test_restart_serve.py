"""A worker killed under a real `dstack serve`: while it restarts, a request whose SLO can
wait for it is answered once it is back, one whose SLO cannot is refused at once with 503
and Retry-After; /stats and /metrics count the same failures; the log says it once. Workers,
restarted ones too, run `worker_nice` nicer than the server and as batch work (`SCHED_BATCH`),
every thread of them, and on the host's cores while the front end keeps to its own
(`server.cores`)."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from email.message import Message
from pathlib import Path

import numpy as np
import pytest

from server import codec
from tests.e2e.server_process import ServerProcess


def _infer(url: str, model: str) -> tuple[int, Message]:
    x = np.zeros((1, 3, 32, 32), np.float32)
    body, hlen = codec.encode_request({"input": x})
    req = urllib.request.Request(f"http://{url}/v2/models/{model}/infer", data=body,
                                 headers={codec.HEADER_LENGTH: str(hlen)}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=90) as r:
            return r.status, r.headers
    except urllib.error.HTTPError as e:
        return e.code, e.headers


def _niceness(pid: int) -> set[tuple[int, int]]:
    """The niceness and scheduling policy of each thread of process `pid` (fields 19 and
    41 of /proc/PID/task/TID/stat)."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        stat = open(f"/proc/{pid}/task/{tid}/stat").read()  # noqa: SIM115
        fields = stat.rsplit(")", 1)[1].split()
        out.add((int(fields[16]), int(fields[38])))
    return out


def _affinity(pid: int) -> set[frozenset[int]]:
    """The CPU affinity of each thread of process `pid`."""
    return {frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")}


def _worker_pids(log: str) -> dict[str, int]:
    return {m: int(p) for m, p in re.findall(r"worker (\w+) ready (?:in \S+ s )?\(pid (\d+)", log)}


def _failures(text: str, model: str) -> float:
    return sum(float(v) for v in re.findall(
        rf'^nv_inference_request_failure\{{[^}}]*model="{model}"[^}}]*\}} (\S+)$', text, re.M))


def server_config(tmp_path: Path) -> dict:
    """This module's server (tests/e2e/conftest.py `module_server`)."""
    front = max(os.sched_getaffinity(0))
    return {
        "policy": "shared",  # every worker on every core
        "server": {"cores": [front]},
        "worker_nice": 5,
        "models": [
            {"name": "patient", "zoo_name": "tiny_cnn", "slo_ms": 60000, "max_batch_size": 2},
            {"name": "hasty", "zoo_name": "tiny_cnn", "slo_ms": 300, "max_batch_size": 2},
        ],
    }


@pytest.mark.slow
def test_a_killed_worker_restarts_and_requests_wait_or_are_told_when(
        module_server: ServerProcess) -> None:
    host = frozenset(os.sched_getaffinity(0))
    front = frozenset({max(host)})
    srv = module_server
    for m in ("patient", "hasty"):
        assert _infer(srv.url, m)[0] == 200
    pids = _worker_pids(srv.log.read_text())
    server_nice = os.getpriority(os.PRIO_PROCESS, srv.proc.pid)
    worker = {(server_nice + 5, os.SCHED_BATCH)}
    assert {m: _niceness(p) for m, p in pids.items()} == {m: worker for m in pids}
    assert _affinity(srv.proc.pid) == {front}
    assert {m: _affinity(p) for m, p in pids.items()} == {m: {host} for m in pids}
    for m in ("patient", "hasty"):
        os.kill(pids[m], signal.SIGKILL)
    time.sleep(0.5)  # the deaths are seen
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(_infer, srv.url, "patient")  # can wait out the restart
        refused = [_infer(srv.url, "hasty") for _ in range(3)]
        assert all(code == 503 for code, _ in refused), refused
        assert all(int(h.get("Retry-After", "0")) >= 1 for _, h in refused), refused
        assert waiting.result(timeout=90)[0] == 200
    deadline = time.monotonic() + 60
    while _infer(srv.url, "hasty")[0] != 200:  # back once its worker is
        assert time.monotonic() < deadline, "hasty did not come back"
        time.sleep(0.5)
    stats = urllib.request.urlopen(f"http://{srv.url}/v2/models/hasty/stats", timeout=10)
    fail = int(json.loads(stats.read())["model_stats"][0]["inference_stats"]["fail"]["count"])
    metrics = urllib.request.urlopen(f"http://{srv.url}/metrics", timeout=10).read().decode()
    assert fail == _failures(metrics, "hasty") >= 3  # one count, both views
    log = srv.log.read_text()
    assert len(re.findall(r"hasty.*restarted in", log)) == 1, log[-3000:]
    assert _niceness(_worker_pids(log)["hasty"]) == worker
    assert _affinity(_worker_pids(log)["hasty"]) == {host}  # not the front end's core
    assert _affinity(srv.proc.pid) == {front}
