"""The live dashboard: `GET /dashboard` (a page and its assets under `/dashboard/static/`,
all served from `server/static/`, nothing from elsewhere) and the JSON it polls,
`GET /v1/dashboard/data`.

`install_dashboard` is the one hook `create_app` calls. It adds:
- a `LatencyHistogram` (`History.latency`), into which the infer route times each request
  answered 200 (from the request reaching the app, its body read, to its answer), also
  exported at `/metrics` as the histogram `dstack_request_duration_seconds`;
- a `History` (ring buffer of the backend's counters), sampled once a second by a task
  that the app's lifespan starts and stops. Without a lifespan (tests over ASGI) nothing
  samples by itself: call `app.state.dashboard.sample(now)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from dstack.common.backend import InferenceBackend
from server.history import History, LatencyHistogram
from server.metrics import Metrics

log = logging.getLogger("dstack.server")

STATIC = Path(__file__).parent / "static"
# The page runs only its own scripts and styles and talks only to this server.
CSP = "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'"


class LatencyCollector(Collector):
    """`dstack_request_duration_seconds{model,version}`: the histogram above, at scrape."""

    def __init__(self, latency: LatencyHistogram, version: str) -> None:
        self.latency = latency
        self.version = version

    def collect(self) -> Iterator[Metric]:
        h = HistogramMetricFamily(
            "dstack_request_duration_seconds",
            "Infer requests answered 200, by time from reaching the server's app to the "
            "response starting (seconds)",
            labels=["model", "version"],
        )
        lat = self.latency
        for m in lat.models():
            cum, buckets = 0, []
            for bound, c in zip((*lat.bounds, float("inf")), lat.counts(m), strict=True):
                cum += c
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cum))
            h.add_metric([m, self.version], buckets, lat.sum_s(m))
        yield h


def dashboard_data(backend: InferenceBackend, history: History) -> dict[str, Any]:
    """What the page draws: the cycle (as `/v1/schedule`, None under a policy without
    one) and per model its SLO, slice and the sampled series (`History.series`)."""
    sched = backend.schedule()
    slo = {m.name: m.slo_ms for m in backend.deploy_config().models}
    slice_of = getattr(backend, "current_slice", None)
    data = history.series()
    for m in data["models"]:
        sl = slice_of(m["name"]) if slice_of is not None else None
        m["slo_ms"] = slo.get(m["name"])
        m["slice_percent"] = sl.percent if sl is not None else None
    return {
        "policy": backend.policy_name(),
        "interval_s": history.interval_s,
        "window_s": history.window_s,
        "p99_window_s": history.p99_window_s,
        "schedule": sched.to_dict() if sched is not None else None,
        **data,
    }


async def _sample_forever(history: History) -> None:
    while True:
        try:
            history.sample(time.monotonic())
        except Exception:  # a failed read must not end the sampling
            log.exception("dashboard: sampling the backend's counters failed")
        await asyncio.sleep(history.interval_s)


def install_dashboard(app: FastAPI, backend: InferenceBackend, metrics: Metrics,
                      version: str) -> History:
    latency = LatencyHistogram()
    history = History(backend, latency)
    app.state.dashboard = history
    metrics.registry.register(LatencyCollector(latency, version))

    router = APIRouter()

    @router.get("/dashboard", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "dashboard.html",
                            headers={"Content-Security-Policy": CSP,
                                     "Cache-Control": "no-cache"})

    @router.get("/v1/dashboard/data")
    async def data() -> dict[str, Any]:
        return dashboard_data(backend, history)

    app.include_router(router)
    app.mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard-static")

    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a: FastAPI) -> AsyncIterator[Any]:
        async with inner(a) as state:
            task = asyncio.create_task(_sample_forever(history))
            try:
                yield state
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    app.router.lifespan_context = lifespan
    return history
