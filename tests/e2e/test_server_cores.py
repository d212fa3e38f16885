"""Where a real `dstack serve` puts its own process when `server.cores` is unset: on the
cores its workers leave free, else beside the worker of the model with the longest SLO,
off the core of the one whose SLO is tight (docs/decisions.md)."""

from __future__ import annotations

import os
import re
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.server_process import launch, wait_ready
from tests.integration.test_runtime_policies import write_cpu_profiles


def _affinity(pid: int) -> set[frozenset[int]]:
    """The CPU affinity of each thread of process `pid`."""
    return {frozenset(os.sched_getaffinity(int(t))) for t in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_unpinned_the_server_runs_on_the_core_of_the_longest_slo(tmp_path: Path) -> None:
    write_cpu_profiles(tmp_path)
    host = os.sched_getaffinity(0)
    two = sorted(host)[:2]
    model = {"zoo_name": "tiny_cnn", "max_batch_size": 8, "max_queue_delay_ms": 2,
             "rate_rps": 5}
    os.sched_setaffinity(0, two)  # the server may use these two only: no core to spare
    try:
        srv = launch({"policy": "spatial", "profiles": str(tmp_path), "cores": two,
                      "models": [{"name": "tiny_a", "slo_ms": 200, **model},   # tight
                                 {"name": "tiny_b", "slo_ms": 5000, **model}]},  # loose
                     tmp_path)
    finally:
        os.sched_setaffinity(0, host)
    try:
        wait_ready(srv)
        pids = {m: int(p) for m, p in re.findall(r"worker (\w+) ready (?:in \S+ s )?\(pid (\d+)",
                                                 srv.text())}
        tight, loose = (frozenset(os.sched_getaffinity(pids[m])) for m in ("tiny_a", "tiny_b"))
        assert len(tight) == len(loose) == 1 and tight != loose  # spatial: a core each
        assert _affinity(srv.pid) == {loose}, srv.text()
        assert f"the server's own process on cores {sorted(loose)}" in srv.text()
        with urllib.request.urlopen(f"http://{srv.url}/v2/health/ready", timeout=10) as r:
            assert r.status == 200
    finally:
        srv.stop()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_unpinned_the_server_runs_on_the_cores_its_workers_leave_free(tmp_path: Path) -> None:
    first, *rest = sorted(os.sched_getaffinity(0))
    srv = launch({"policy": "shared", "cores": [first],
                  "models": [{"name": "tiny_cnn", "slo_ms": 200, "max_batch_size": 8}]},
                 tmp_path)
    try:
        wait_ready(srv)
        assert _affinity(srv.pid) == {frozenset(rest)}, srv.text()
    finally:
        srv.stop()
