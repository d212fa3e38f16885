"""Requests that arrive while a killed worker restarts (real tiny_cnn workers, SIGKILL):
the ones whose deadline outlasts the restart wait for it and are answered; the others get
a 503 with Retry-After at once; /stats and /metrics count the same failures; the log says
it once per restart."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import httpx
import numpy as np
import pytest

from dstack.common.config import parse_config
from dstack.runtime.serving import Runtime
from dstack.runtime.supervisor import SlotState
from server import codec
from server.app import create_app
from tests.integration.test_metrics import samples

X = np.zeros((1, 3, 32, 32), np.float32)


def _model(name: str, slo_ms: float) -> dict:
    return {"name": name, "zoo_name": "tiny_cnn", "slo_ms": slo_ms, "max_batch_size": 8}


async def _post(http: httpx.AsyncClient, model: str) -> httpx.Response:
    body, hlen = codec.encode_request({"input": X})
    return await http.post(f"/v2/models/{model}/infer", content=body,
                           headers={codec.HEADER_LENGTH: str(hlen)})


def test_requests_during_a_restart_wait_for_it_or_get_503_with_retry_after(
        caplog: pytest.LogCaptureFixture) -> None:
    # patient's deadline (60 s) outlasts a restart (a few seconds: spawn, import torch,
    # warm up); hasty's (300 ms) cannot.
    cfg = parse_config({"models": [_model("patient", 60_000), _model("hasty", 300)]})

    async def main() -> None:
        rt = Runtime(cfg)
        await rt.start()
        app = create_app(rt, max_body_bytes=1 << 22)
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                         timeout=120) as http:
                for m in ("patient", "hasty"):
                    assert (await _post(http, m)).status_code == 200
                pids = {m: rt.supervisor.worker(m).pid for m in ("patient", "hasty")}  # type: ignore[union-attr]
                for pid in pids.values():
                    os.kill(pid, signal.SIGKILL)  # type: ignore[arg-type]
                for _ in range(500):
                    if all(rt.supervisor.state(m) is SlotState.RESTARTING  # type: ignore[attr-defined]
                           for m in pids):
                        break
                    await asyncio.sleep(0.01)
                t0 = time.monotonic()
                waiting = asyncio.create_task(_post(http, "patient"))
                refused = [await _post(http, "hasty") for _ in range(5)]
                for r in refused:
                    assert r.status_code == 503, r.text
                    assert int(r.headers["Retry-After"]) >= 1
                    body = r.json()
                    assert body["reason"] == "restarting"
                    assert "hasty" in body["error"] and "restarting" in body["error"]
                assert not waiting.done()  # it waits for the worker...
                r = await waiting
                assert r.status_code == 200, r.text  # ...and is answered once it is back
                assert rt.supervisor.worker("patient").pid != pids["patient"]  # type: ignore[union-attr]
                waited_s = time.monotonic() - t0
                for _ in range(600):
                    if rt.is_model_ready("hasty"):
                        break
                    await asyncio.sleep(0.05)
                assert (await _post(http, "hasty")).status_code == 200

                metrics = samples((await http.get("/metrics")).text)
                for m, failed in (("patient", 0), ("hasty", 5)):
                    stats = (await http.get(f"/v2/models/{m}/stats")).json()["model_stats"][0]
                    fail = stats["inference_stats"]["fail"]["count"]
                    by_reason = sum(v for k, v in metrics["nv_inference_request_failure"].items()
                                    if dict(k)["model"] == m)
                    assert fail == by_reason == failed, (m, fail, by_reason)
                    key = (("model", m), ("version", "1"))
                    assert metrics["dstack_model_restart_count"][key] == 1
                    assert 0 < metrics["dstack_model_restart_duration_us"][key] < 120e6
                    assert metrics["dstack_model_restarting"][key] == 0
                rule = (("model", "hasty"), ("rule", "restarting"), ("version", "1"))
                assert metrics["dstack_request_refused_by_rule"][rule] == 5
                assert waited_s > 0
        finally:
            await rt.stop()

    caplog.set_level(logging.INFO)
    asyncio.run(main())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert not any("Unavailable" in w for w in warnings), warnings  # none per request
    hasty = [w for w in warnings if "model hasty" in w]
    assert len(hasty) == 1 and "5 requests were refused" in hasty[0], warnings
    patient = [r.getMessage() for r in caplog.records if "model patient: worker" in r.getMessage()]
    assert len(patient) == 1 and "1 waited" in patient[0], patient
