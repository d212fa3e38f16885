"""`/metrics` over the fake backend: Triton's names and labels, values read from the
backend at scrape time, failures counted by reason, one registry per app."""

from __future__ import annotations

import asyncio
import math

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from dstack.common.errors import DeadlineRefused
from dstack.common.slices import SliceSpec
from server import codec
from server.app import create_app
from tests.integration.fakes import FakeBackend


class GaugedBackend(FakeBackend):
    """The fake plus the runtime's gauge hooks and a refusing model."""

    refuse = False

    def current_batch_cap(self, model: str) -> int:
        return 3

    def current_slice(self, model: str) -> SliceSpec | None:
        return SliceSpec(50.0, (1,))

    async def infer(self, model: str, inputs: dict[str, np.ndarray],
                    since_received_s: float = 0.0) -> dict[str, np.ndarray]:
        if self.refuse:
            raise DeadlineRefused("too late")
        return await super().infer(model, inputs)


def samples(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            # The parser names counter samples `<family>_total`; ours have no suffix.
            name = fam.name if s.name == fam.name + "_total" else s.name
            out.setdefault(name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def mv(model: str, **extra: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"model": model, "version": "1", **extra}.items()))


async def _drive(backend: GaugedBackend) -> tuple[str, str]:
    app = create_app(backend, max_body_bytes=4096)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://t"
    ) as http:
        for n in (1, 2, 3):
            body, hlen = codec.encode_request({"x": np.ones((n, 3), np.float32)})
            headers = {codec.HEADER_LENGTH: str(hlen)} if hlen is not None else {}
            r = await http.post("/v2/models/double/infer", content=body, headers=headers)
            assert r.status_code == 200
        bad, hlen = codec.encode_request({"x": np.ones((1, 4), np.float32)})
        r = await http.post(
            "/v2/models/double/infer", content=bad, headers={codec.HEADER_LENGTH: str(hlen)}
        )
        assert r.status_code == 400
        backend.refuse = True
        body, hlen = codec.encode_request({"x": np.ones((1, 3), np.float32)})
        r = await http.post(
            "/v2/models/double/infer", content=body, headers={codec.HEADER_LENGTH: str(hlen)}
        )
        assert r.status_code == 429
        backend.refuse = False
        body, hlen = codec.encode_request({"x": np.ones((1,), np.int32)})
        for _ in range(2):  # one BackendError, then one unexpected RuntimeError
            r = await http.post(
                "/v2/models/broken/infer", content=body, headers={codec.HEADER_LENGTH: str(hlen)}
            )
            assert r.status_code == 500
            body, hlen = codec.encode_request({"x": np.ones((1,), np.int32)})
        backend.ready["flip"] = False
        r = await http.post("/v2/models/flip/infer", content=b"{}")
        assert r.status_code == 503
        r = await http.post("/v2/models/nope/infer", content=b"{}")
        assert r.status_code == 404
        m = await http.get("/metrics")
        assert m.status_code == 200
        assert m.headers["content-type"].startswith("text/plain")
        return m.text, (await http.get("/metrics")).text


def test_metrics_names_values_and_failure_reasons() -> None:
    backend = GaugedBackend()
    text, again = asyncio.run(_drive(backend))
    s = samples(text)
    st = backend.stats("double")
    assert s["nv_inference_request_success"][mv("double")] == st.request_success == 3
    assert s["nv_inference_count"][mv("double")] == 6  # items: 1 + 2 + 3
    assert s["nv_inference_exec_count"][mv("double")] == 3
    assert s["nv_inference_queue_duration_us"][mv("double")] == st.queue_ns / 1000
    assert s["nv_inference_compute_infer_duration_us"][mv("double")] == st.compute_ns / 1000
    assert s["nv_inference_pending_request_count"][mv("double")] == 0
    fail = s["nv_inference_request_failure"]
    assert fail[mv("double", reason="rejected")] == 1
    assert fail[mv("double", reason="slo_refused")] == 1
    assert fail[mv("broken", reason="backend")] == 2
    assert fail[mv("flip", reason="unavailable")] == 1
    assert not any(dict(k)["model"] == "nope" for k in fail)  # no label per unknown name
    assert s["dstack_slice_percent"][(("model", "double"),)] == 50.0
    assert s["dstack_batch_size"][(("model", "flip"),)] == 3
    assert s["dstack_slo_attainment"][(("model", "double"),)] == 1.0
    assert math.isnan(s["dstack_slo_attainment"][(("model", "flip"),)])  # nothing served yet
    # Triton's exposition: counters without a `_total` suffix, in the samples and headers.
    assert "# TYPE nv_inference_request_success counter" in text
    assert "_total" not in text
    # Scraping reads, it does not count: a second scrape shows the same values.
    assert samples(again)["nv_inference_request_success"] == s["nv_inference_request_success"]


def test_each_app_has_its_own_registry() -> None:
    a, b = GaugedBackend(), GaugedBackend()
    text_a, _ = asyncio.run(_drive(a))
    text_b, _ = asyncio.run(_drive(b))  # would raise "Duplicated timeseries" if global
    assert samples(text_a).keys() == samples(text_b).keys()
