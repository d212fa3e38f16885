"""`GET /dashboard` and `GET /v1/dashboard/data` over the fake backend: the page and
every asset it names are served by the app, none from elsewhere; the data carries the
cycle and per-model series whose counts are what was sent."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from dstack.common.errors import DeadlineRefused
from dstack.common.types import Schedule, Slot
from server import codec
from server.app import create_app
from tests.integration.fakes import FakeBackend

SCHEDULE = Schedule(12.0, (Slot("double", 0.0, 8.0, 50.0), Slot("flip", 8.0, 4.0, 50.0),
                           Slot("broken", 0.0, 12.0, 50.0)))


class RefusingBackend(FakeBackend):
    """The fake plus the runtime's refusal and batch-cap hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.schedule_ = SCHEDULE
        self.refuse = False
        self.expired = 0

    def refusals(self, model: str) -> dict[str, int]:
        return {"queue_full": 0, "expired": self.expired if model == "double" else 0}

    def current_batch_cap(self, model: str) -> int:
        return 4

    async def infer(self, model: str, inputs: dict[str, np.ndarray],
                    since_received_s: float = 0.0) -> dict[str, np.ndarray]:
        if self.refuse:
            self.expired += 1
            raise DeadlineRefused("too late")
        return await super().infer(model, inputs)


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


async def post(http: httpx.AsyncClient, model: str, arrays: dict[str, np.ndarray]) -> int:
    body, hlen = codec.encode_request(arrays)
    headers = {codec.HEADER_LENGTH: str(hlen)} if hlen is not None else {}
    r = await http.post(f"/v2/models/{model}/infer", content=body, headers=headers)
    return r.status_code


def test_page_and_assets_are_served_by_the_app_only() -> None:
    async def go() -> None:
        async with client(create_app(FakeBackend(), max_body_bytes=4096)) as http:
            page = await http.get("/dashboard")
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
            assert "default-src 'self'" in page.headers["content-security-policy"]
            refs = [r for r in re.findall(r'(?:src|href)="([^"]+)"', page.text)
                    if r != "data:,"]  # the empty icon: no request for /favicon.ico
            assert len(refs) == 3  # the stylesheet and the two scripts
            texts = [page.text]
            for ref in refs:
                assert ref.startswith("/"), ref  # this server, not another host
                r = await http.get(ref)
                assert r.status_code == 200, ref
                texts.append(r.text)
            js = "\n".join(texts[1:])
            for url in re.findall(r'fetch\("([^"]+)"', js):  # what the script polls
                assert (await http.get(url)).status_code == 200, url
            for text in texts:
                assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/", text, re.I)
                assert "@import" not in text
            assert (await http.get("/dashboard/static/missing.js")).status_code == 404

    asyncio.run(go())


def test_data_has_the_schedule_and_counts_of_what_was_sent() -> None:
    backend = RefusingBackend()
    app = create_app(backend, max_body_bytes=4096)
    hist = app.state.dashboard

    async def go() -> dict[str, Any]:
        async with client(app) as http:
            hist.sample(100.0)
            sizes = (1, 2, 3, 4, 2)
            for n in sizes:
                assert await post(http, "double", {"x": np.ones((n, 3), np.float32)}) == 200
            assert await post(http, "flip", {"mask": np.zeros((2, 2), bool),
                                             "k": np.ones((2, 2), np.uint8)}) == 200
            assert await post(http, "broken", {"x": np.zeros(1, np.int32)}) == 500
            assert await post(http, "double", {"x": np.ones((1, 4), np.float32)}) == 400
            backend.refuse = True
            for _ in range(3):
                assert await post(http, "double", {"x": np.ones((1, 3), np.float32)}) == 429
            hist.sample(101.0)
            r = await http.get("/v1/dashboard/data")
            assert r.status_code == 200
            assert r.json()["schedule"] == (await http.get("/v1/schedule")).json()
            return dict(r.json())

    d = asyncio.run(go())
    assert d["schedule"]["cycle_ms"] == 12.0 and len(d["schedule"]["slots"]) == 3
    assert d["policy"] == "fake" and d["t"] == [0.0]
    m = {x["name"]: x for x in d["models"]}
    assert list(m) == ["double", "flip", "broken"]
    dbl = m["double"]
    assert dbl["totals"]["success"] == 5 and dbl["totals"]["items"] == 12
    assert dbl["totals"]["answered_timed"] == 5  # only the 200s are timed
    assert dbl["goodput_rps"] == [5.0] and dbl["answered_rps"] == [5.0]
    assert dbl["batch"] == [2.4] and dbl["batch_cap"] == [4]
    assert dbl["refused_rps"]["expired"] == [3.0] and dbl["totals"]["refused"]["expired"] == 3
    assert dbl["p99_ms"][0] is not None and dbl["p99_ms"][0] > 0
    assert dbl["slo_ms"] == 250.0
    assert m["flip"]["totals"]["success"] == 1 and m["flip"]["goodput_rps"] == [1.0]
    assert m["broken"]["totals"]["failure"] == 1 and m["broken"]["p99_ms"] == [None]


def test_the_latency_histogram_is_on_metrics() -> None:
    async def go() -> str:
        async with client(create_app(FakeBackend(), max_body_bytes=4096)) as http:
            for _ in range(4):
                assert await post(http, "double", {"x": np.ones((1, 3), np.float32)}) == 200
            return (await http.get("/metrics")).text

    fams = {f.name: f for f in text_string_to_metric_families(asyncio.run(go()))}
    h = fams["dstack_request_duration_seconds"]
    assert h.type == "histogram"
    inf = [s for s in h.samples if s.name.endswith("_bucket") and s.labels["le"] == "+Inf"]
    assert [(s.labels["model"], s.value) for s in inf] == [("double", 4.0)]


def test_the_app_lifespan_samples_by_itself() -> None:
    app = create_app(FakeBackend(), max_body_bytes=4096)
    with TestClient(app) as http:
        deadline = time.monotonic() + 10
        while len(app.state.dashboard.samples) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        d = http.get("/v1/dashboard/data").json()
    assert len(d["t"]) >= 1 and [m["name"] for m in d["models"]] == ["double", "flip", "broken"]


def test_grafana_and_prometheus_examples_use_what_metrics_exports() -> None:
    root = Path(__file__).resolve().parents[2] / "deploy"
    scrape = yaml.safe_load((root / "prometheus.yml").read_text())
    job = scrape["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["127.0.0.1:8000"]

    async def go() -> str:
        async with client(create_app(RefusingBackend(), max_body_bytes=4096)) as http:
            return (await http.get("/metrics")).text

    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", asyncio.run(go()), re.M))
    dash = json.loads((root / "grafana" / "dstack.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs.append(dash["templating"]["list"][1]["query"]["query"])
    used = {n for e in exprs for n in re.findall(r"\b((?:nv|dstack)_[a-z_]+)", e)}
    assert len(used) >= 12
    for name in used:
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in types or types.get(base) == "histogram", name
