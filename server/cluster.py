"""`dstack cluster serve`'s ingress: one KServe v2 endpoint in front of the cluster's nodes.

The app is `create_app` (the same routes and codec as `dstack serve`, so tritonclient and
Locust work unchanged) over `dstack.cluster.routing.ClusterBackend`, plus:

- `GET /v1/cluster`: the placement, what each node serves, planned and measured rates,
  the nodes' state and the recent events (moves, dead nodes);
- `/metrics`: the Triton-named families summed over the nodes (as `dstack serve` has
  them), plus each node's own counters as `dstack_node_*{node, model}` families (a
  separate name, so that `sum()` over a family never counts a request twice);
  `/v2/models/{m}/stats`: the nodes' counts summed. Both fetch the nodes' counters
  (one Ray call per node) before answering.

The controller (nodes, placement, re-placement: `dstack.cluster.control`) starts before
the socket listens and stops after it closes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Receive, Scope, Send

from dstack.cluster.config import ClusterConfig
from dstack.cluster.control import ClusterController
from dstack.cluster.routing import ClusterBackend
from server.app import create_app
from server.main import guard

log = logging.getLogger("dstack.cluster")

#: (family, help, ModelStats field, scale) of the per-node counters.
_NODE_COUNTERS = (
    ("dstack_node_request_success", "Successful requests, by node", "request_success", 1),
    ("dstack_node_request_failure", "Failed or refused requests, by node", "request_failure", 1),
    ("dstack_node_inference_count", "Items inferred, by node", "inference_count", 1),
    ("dstack_node_exec_count", "Batches run, by node", "execution_count", 1),
    ("dstack_node_queue_duration_us", "Time requests spent queued (us), by node", "queue_ns",
     1e-3),
    ("dstack_node_compute_infer_duration_us", "Time batches ran (us), by node", "compute_ns",
     1e-3),
    ("dstack_node_request_slo_met", "Successes within their SLO, by node", "slo_met", 1),
    ("dstack_node_request_refused", "Requests refused (queue full or deadline), by node",
     "refused", 1),
)


class NodeCollector(Collector):
    """Each node's counters as of the last refresh, labelled with the node."""

    def __init__(self, backend: ClusterBackend) -> None:
        self.backend = backend

    def collect(self) -> Iterator[Metric]:
        fams = {name: Metric(name, doc, "counter") for name, doc, _, _ in _NODE_COUNTERS}
        pending = GaugeMetricFamily("dstack_node_pending_request_count",
                                    "Requests queued or running now, by node",
                                    labels=["node", "model"])
        attain = GaugeMetricFamily("dstack_node_slo_attainment",
                                   "SLO met / successful requests on the node (NaN before any)",
                                   labels=["node", "model"])
        batch = GaugeMetricFamily("dstack_node_batch_size", "Batch size the node's policy aims "
                                  "for now", labels=["node", "model"])
        up = GaugeMetricFamily("dstack_node_up", "1 while the node is alive and ready, else 0",
                               labels=["node"])
        for n in self.backend.nodes.values():
            snap = n.snapshot
            up.add_metric([n.name], 0.0 if n.dead or snap is None or not snap.ready else 1.0)
            if snap is None:
                continue
            for model, ms in snap.per_model.items():
                labels = {"node": n.name, "model": model}
                s = ms.stats
                for name, _, attr, scale in _NODE_COUNTERS:
                    fams[name].add_sample(name + "_total", labels, getattr(s, attr) * scale)
                pending.add_metric([n.name, model], 0 if n.dead else s.pending)
                attain.add_metric([n.name, model], s.slo_met / s.request_success
                                  if s.request_success else math.nan)
                batch.add_metric([n.name, model], ms.batch_cap)
        yield from fams.values()
        yield from (pending, attain, batch, up)


class _RefreshFirst:
    """Fetch the nodes' counters before the routes that show them."""

    def __init__(self, app: ASGIApp, backend: ClusterBackend) -> None:
        self.app = app
        self.backend = backend

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "GET":
            path: str = scope["path"]
            if path in ("/metrics", "/v1/cluster", "/dashboard/data") or \
                    path.endswith("/stats"):
                await self.backend.refresh()
        await self.app(scope, receive, send)


def cluster_app(controller: ClusterController, *, lifespan: Any = None,
                auth_token: str | None = None) -> FastAPI:
    """The ingress app over `controller.backend` (module docstring), behind the limits of
    `dstack serve` (`server.main.guard`: body limits and budget, and, given `auth_token`,
    bearer authentication). `lifespan`: starts and stops the controller (None: the caller
    does)."""
    backend = controller.backend
    s = controller.cfg.server
    app = create_app(backend, max_body_bytes=s.max_body_bytes, lifespan=lifespan,
                     title="dstack cluster")
    app.state.metrics.registry.register(NodeCollector(backend))
    app.add_middleware(_RefreshFirst, backend=backend)

    @app.get("/v1/cluster")
    async def cluster() -> dict[str, Any]:
        return controller.view()

    return guard(app, backend, s, auth_token)


class ControllerRun:
    """The controller as `server.main`'s startable: nodes placed and ready before the
    socket listens, its health/rates loop running while it does, everything stopped after."""

    def __init__(self, controller: ClusterController) -> None:
        self.controller = controller
        self._task: asyncio.Task[None] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the ingress's (for tests, benches)

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.controller.start()
        self._task = asyncio.create_task(self.controller.run(), name="dstack-cluster")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping anyway
                pass
        await self.controller.stop()


def serve_cluster(cfg: ClusterConfig, *, host: str | None = None, port: int | None = None
                  ) -> int:
    """`dstack cluster serve`: Ray, the node deployments, then the ingress until SIGINT or
    SIGTERM (both drain, exit 0); a start-up error is one line on stderr and exit 2, as
    `dstack serve` (`server.main.run_until_stopped`)."""
    from dstack.cluster.serving import loopback_ray_env

    loopback_ray_env(cfg)  # before Ray is imported
    from dstack.cluster.planning import ClusterPlanner
    from dstack.cluster.serving import RayDeployer, start_ray, stop_ray
    from dstack.common.pauses import prompt_gil_handoffs
    from server.auth import load_token
    from server.connection import server_config
    from server.main import _Serving, listen, run_until_stopped

    logging.basicConfig(level=cfg.server.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ray_started = False

    def prepare() -> tuple[_Serving, socket.socket]:
        nonlocal ray_started
        at = host or cfg.server.host
        token = load_token(cfg.server)
        prompt_gil_handoffs(cfg.server.switch_interval_ms / 1000)
        sock = listen(at, cfg.server.port if port is None else port, cfg.server, token)
        start_ray(cfg)
        ray_started = True
        planner = ClusterPlanner(cfg)
        controller = ClusterController(cfg, RayDeployer(cfg, planner), planner=planner)
        app = cluster_app(controller, auth_token=token)

        def ready() -> None:
            log.info("dstack cluster serving %s://%s:%d (%d nodes, models %s)",
                     "https" if cfg.server.tls_certfile else "http", at,
                     sock.getsockname()[1], len(controller.backend.nodes),
                     ", ".join(m.name for m in cfg.models))

        return _Serving(server_config(app, cfg.server), ControllerRun(controller),  # type: ignore[arg-type]
                        ready), sock

    try:
        return run_until_stopped(prepare, "dstack cluster")
    finally:
        if ray_started:
            stop_ray()
