"""A JSON request that the dispatch core would refuse by its batch size is refused once its
header is read, before its numbers are parsed (`Runtime.check_batch`; real tiny_cnn worker)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import httpx
import numpy as np
import pytest

from dstack.common.config import DeployConfig, parse_config
from dstack.policies.latency import LinearLatency
from dstack.runtime.serving import Runtime
from server import json_tensors
from server.app import create_app


def _json_body(n: int) -> bytes:
    x = np.random.default_rng(n).random((n, 3, 32, 32)).astype(np.float32)
    return json.dumps({"inputs": [{"name": "input", "datatype": "FP32",
                                   "shape": [n, 3, 32, 32], "data": x.ravel().tolist()}]}).encode()


@contextlib.asynccontextmanager
async def _served(cfg: DeployConfig, per_item_s: float
                  ) -> AsyncIterator[tuple[Runtime, httpx.AsyncClient]]:
    """A started runtime whose tiny_cnn estimate is trusted at `per_item_s` per item, and
    an HTTP client of its app."""
    rt = Runtime(cfg)
    await rt.start()
    try:
        rt.core.set_estimate("tiny_cnn", LinearLatency(0.0, per_item_s, observations=10))
        transport = httpx.ASGITransport(app=create_app(rt, max_body_bytes=1 << 24))
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     timeout=60) as http:
            yield rt, http
    finally:
        await rt.stop()


def test_a_batch_over_its_slo_is_refused_before_its_numbers_are_parsed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    parsed: list[int] = []
    real = json_tensors.decode_flat

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        parsed.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(json_tensors, "decode_flat", spy)
    cfg = parse_config({"models": [{"name": "tiny_cnn", "slo_ms": 200, "max_batch_size": 8,
                                    "max_queue_delay_ms": 1}]})

    async def main() -> None:
        # 40 ms per item, trusted: a batch of 1 fits the 200 ms SLO, one of 8 cannot.
        async with _served(cfg, 0.04) as (rt, http):
            r = await http.post("/v2/models/tiny_cnn/infer", content=_json_body(8))
            assert r.status_code == 429, r.text
            assert r.json()["reason"] == "work_ahead"
            assert parsed == []  # refused on its header alone
            assert rt.stats("tiny_cnn").refused == 1  # counted as any refusal
            r = await http.post("/v2/models/tiny_cnn/infer", content=_json_body(1))
            assert r.status_code == 200, r.text
            assert parsed == [1]

    asyncio.run(main())


def test_a_json_body_that_would_be_parsed_past_its_slo_is_refused_after_its_first_piece(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """64 items of 50-digit floats (10 MB of JSON) take ~55 ms to parse here, against an
    SLO of 20 ms that the batch itself (6.4 ms) fits: refused once the first piece has
    shown the pace, the rest never parsed."""
    pieces: list[int] = []
    real = json_tensors.decode_flat

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        pieces.append(0)
        for done in real(*args, **kwargs):
            pieces[-1] += 1
            yield done

    monkeypatch.setattr(json_tensors, "decode_flat", counting)
    cfg = parse_config({"models": [{"name": "tiny_cnn", "slo_ms": 20, "max_batch_size": 64,
                                    "max_queue_delay_ms": 1}]})
    x = np.random.default_rng(0).random(64 * 3 * 32 * 32)
    data = ",".join(np.char.mod("%.48f", x).tolist())
    slow = ('{"inputs":[{"name":"input","datatype":"FP32","shape":[64,3,32,32],"data":['
            + data + ']}]}').encode()

    async def main() -> None:
        async with _served(cfg, 0.0001) as (rt, http):
            r = await http.post("/v2/models/tiny_cnn/infer", content=slow)
            assert r.status_code == 429, r.text
            assert r.json()["reason"] == "work_ahead"
            assert "more to arrive or parse" in r.json()["error"]
            assert pieces == [1]  # of about 40
            assert rt.stats("tiny_cnn").refused == 1
            r = await http.post("/v2/models/tiny_cnn/infer", content=_json_body(1))
            assert r.status_code == 200, r.text

    asyncio.run(main())
