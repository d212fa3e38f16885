"""A server given profiles that do not fit its machine says so in one line and plans with
what its workers measured, before it serves its first request."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tritonclient.http as th

from dstack.common.types import load_profile, scaled
from tests.e2e.conftest import Server

ROOT = Path(__file__).resolve().parents[2]


def test_profiles_a_hundred_times_too_fast_are_corrected_before_the_first_request(
        serve: Callable[[dict], Server], tmp_path: Path) -> None:
    # profiles/cpu's tiny_cnn as if measured on a machine 100 times faster than any this
    # runs on: its warm-up batches disagree by far more than profile_margin, whatever the
    # machine's speed
    given = load_profile(ROOT / "profiles/cpu/tiny_cnn.json")
    fast = tmp_path / "fast-profiles"
    scaled(given, 0.01).save(fast / "tiny_cnn.json")
    srv = serve({"device": "cpu", "policy": "dstack", "profiles": str(fast),
                 "models": [{"name": "tiny_cnn", "slo_ms": 2000, "max_batch_size": 8,
                             "rate_rps": 10}]})
    log = srv.log.read_text()
    [line] = [ln for ln in log.splitlines() if "disagree with the profiles" in ln]
    assert "tiny_cnn" in line and "planning with those latencies scaled" in line
    assert log.index("disagree with the profiles") < log.index("runtime ready")
    with urllib.request.urlopen(f"http://{srv.url}/v1/plan", timeout=5) as r:
        [planned] = json.loads(r.read())["models"]
    # planned with what this machine measured, not with the profile's hundredth of it
    said_ms = 0.01 * given.latency_ms(planned["batch"], planned["percent"])
    assert planned["latency_ms"] > 10 * said_ms
    client = th.InferenceServerClient(srv.url)
    x = th.InferInput("input", [1, 3, 32, 32], "FP32")
    x.set_data_from_numpy(np.zeros((1, 3, 32, 32), np.float32))
    assert client.infer("tiny_cnn", [x]).as_numpy("output").shape == (1, 10)
    client.close()
