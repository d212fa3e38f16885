"""A model with replicas on a real `dstack serve`: one served name, two workers, every
request answered, the same answer whichever worker ran it, and one set of counters."""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.e2e.conftest import ROOT
from tests.e2e.server_process import ServerProcess


def _get(url: str, path: str, body: bytes | None = None) -> dict:
    req = urllib.request.Request(f"http://{url}{path}", data=body,
                                 method="POST" if body is not None else "GET")
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def server_config(tmp_path: Path) -> dict:
    """This module's server (tests/e2e/conftest.py `module_server`)."""
    # resnet18 at 50 rps within 300 ms: one worker on both cores serves ~30 rps in time
    # (committed CPU profiles), one per core at batch 1 more: the planner picks two. The
    # plan is made from those profiles as they are (`profile_margin: null`), whatever this
    # machine's speed: what is tested is two workers under one name, not the plan.
    return {
        "device": "cpu", "policy": "dstack", "profiles": str(ROOT / "profiles" / "cpu"),
        "profile_margin": None,
        "adapt": {"enabled": False},
        "models": [{"name": "resnet18", "slo_ms": 300, "max_batch_size": 16,
                    "rate_rps": 50}],
    }


@pytest.mark.slow
def test_a_hot_model_is_served_by_two_workers_under_one_name(
        module_server: ServerProcess) -> None:
    srv = module_server
    plan = _get(srv.url, "/v1/plan")
    lanes = [lane["models"] for lane in plan["lanes"]]
    assert sorted(m for ms in lanes for m in ms) == ["resnet18", "resnet18#1"], plan
    index = _get(srv.url, "/v2/repository/index", b"{}")
    assert [m["name"] for m in index] == ["resnet18"]  # replicas are not served names

    log = srv.log.read_text()
    assert "worker resnet18 ready" in log and "worker resnet18#1 ready" in log, log
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224), dtype=np.float32)

    def infer(_: int) -> np.ndarray:
        client = httpclient.InferenceServerClient(srv.url)  # one per thread (gevent)
        try:
            inp = httpclient.InferInput("input", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            # 300 ms may be tight for this machine: a refused request is sent again, as a
            # client would (the server paces it: a refusal is held while it stands)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    return client.infer("resnet18", [inp]).as_numpy("output")
                except InferenceServerException as e:
                    if e.status() != "429":
                        raise
            raise AssertionError("refused for 120 s")
        finally:
            client.close()

    with ThreadPoolExecutor(2) as pool:  # two at a time: one for each idle worker
        outs = list(pool.map(infer, range(12)))
    for out in outs:  # the same weights in both workers
        np.testing.assert_allclose(out, outs[0], rtol=1e-4, atol=1e-4)
    stats = _get(srv.url, "/v2/models/resnet18/stats")["model_stats"][0]
    assert stats["inference_stats"]["success"]["count"] == 12
    metrics = urllib.request.urlopen(f"http://{srv.url}/metrics", timeout=10).read().decode()
    assert "resnet18#1" not in metrics
