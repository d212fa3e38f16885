"""`dstack cluster serve`: the placement served on Ray Serve behind one KServe v2 endpoint.

- One Ray Serve deployment per node (`NodeServer`, one replica: `num_gpus: 1` on a GPU
  node, the node's cores on a CPU node); it runs a dstack `Runtime` for the models the
  placement put there (its own plan, workers and re-planner, as `dstack serve` would).
- One ingress: `server.app.create_app` over `ClusterBackend`, which sends each request to
  a node holding its model, the one with the fewest requests in flight from here first,
  and to the next such node when a node fails (its deployment is gone or broken: never
  for a refusal, which is an answer). `GET /v1/cluster`: the placement, per node its
  models, state and answers.
- Ray's own HTTP proxy is off (`proxy_location: Disabled`); the ingress binds
  `server.host` (127.0.0.1 by default) and a Ray started here binds `ray.host`.

Messages between the ingress and the nodes are typed (`NodeReply`), never tuples.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from dstack.cluster.config import ClusterConfig
from dstack.common import errors
from dstack.common.backend import ModelStats
from dstack.common.config import DeployConfig
from dstack.common.errors import DStackError, ModelNotFound, Unavailable
from dstack.common.types import ModelSpec, Plan, Schedule

log = logging.getLogger("dstack.cluster")


class ReplyKind(StrEnum):
    OK = "ok"
    ERROR = "error"  # a DStackError raised by the node's runtime: an answer, passed on


@dataclass(frozen=True, slots=True)
class NodeReply:
    kind: ReplyKind
    outputs: dict[str, np.ndarray] | None = None
    error_class: str = ""  # a class of dstack.common.errors
    message: str = ""


class NodeServer:
    """The body of one node's deployment (a Ray actor): a dstack Runtime for `cfg`."""

    def __init__(self, node: str, cfg_json: dict[str, Any]) -> None:
        from dstack.runtime.serving import Runtime

        self.node = node
        self.cfg = DeployConfig.model_validate(cfg_json)
        self.runtime = Runtime(self.cfg)
        self._started = False

    async def start(self) -> bool:
        """Start the workers (idempotent); True once every model is ready."""
        if not self._started:
            self._started = True
            await self.runtime.start()
        return self.runtime.is_ready()

    async def infer(self, model: str, inputs: dict[str, np.ndarray]) -> NodeReply:
        try:
            out = await self.runtime.infer(model, inputs)
        except DStackError as e:
            return NodeReply(ReplyKind.ERROR, None, type(e).__name__, str(e))
        return NodeReply(ReplyKind.OK, out)

    def stats(self, model: str) -> ModelStats:
        return self.runtime.stats(model)

    def ready(self) -> bool:
        return self._started and self.runtime.is_ready()

    async def stop(self) -> None:
        if self._started:
            await self.runtime.stop()
            self._started = False


def _error(reply: NodeReply, node: str) -> DStackError:
    cls = getattr(errors, reply.error_class, None)
    if isinstance(cls, type) and issubclass(cls, DStackError):
        return cls(reply.message)
    return errors.BackendError(f"node {node}: {reply.error_class}: {reply.message}")


@dataclass
class NodeState:
    name: str
    models: tuple[str, ...]
    handle: Any  # ray.serve.handle.DeploymentHandle
    in_flight: int = 0
    answered: int = 0
    failed: bool = False
    last_error: str = ""
    ready: bool = False
    per_model: dict[str, int] = field(default_factory=dict)


class ClusterBackend:
    """The ingress's `InferenceBackend`: routes to the nodes (module docstring)."""

    def __init__(self, cfg: ClusterConfig, nodes: list[NodeState], placement: dict[str, Any]
                 ) -> None:
        from dstack.runtime.serving import served_spec

        self.cfg = cfg
        self.nodes = nodes
        self.placement = placement
        self.specs: dict[str, ModelSpec] = {m.name: served_spec(m) for m in cfg.models}
        entry = cfg.nodes[0]
        self._deploy = DeployConfig(device=entry.device, policy=cfg.policy,
                                    profiles=entry.profiles, rate_headroom=cfg.rate_headroom,
                                    reuse_idle=cfg.reuse_idle, server=cfg.server,
                                    models=list(cfg.models))

    def model_names(self) -> list[str]:
        return list(self.specs)

    def spec(self, model: str) -> ModelSpec:
        try:
            return self.specs[model]
        except KeyError:
            raise ModelNotFound(
                f"unknown model {model!r}; served models: {', '.join(self.specs)}") from None

    def holders(self, model: str) -> list[NodeState]:
        return [n for n in self.nodes if model in n.models]

    def is_ready(self) -> bool:
        return all(self.is_model_ready(m) for m in self.specs)

    def is_model_ready(self, model: str) -> bool:
        self.spec(model)
        return any(n.ready and not n.failed for n in self.holders(model))

    async def infer(self, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.spec(model)
        tried: list[str] = []
        # Least in flight first; a node that failed before goes last (it may be back).
        for node in sorted(self.holders(model), key=lambda n: (n.failed, n.in_flight)):
            tried.append(node.name)
            node.in_flight += 1
            try:
                reply: NodeReply = await node.handle.infer.remote(model, inputs)
            except Exception as e:  # the node's actor is gone or broken: try another
                node.failed = True
                node.last_error = f"{type(e).__name__}: {e}"[:300]
                log.warning("node %s failed on %s: %s", node.name, model, node.last_error)
                continue
            finally:
                node.in_flight -= 1
            node.failed = False
            if reply.kind is ReplyKind.ERROR:
                raise _error(reply, node.name)
            node.answered += 1
            node.per_model[model] = node.per_model.get(model, 0) + 1
            assert reply.outputs is not None
            return reply.outputs
        raise Unavailable(f"model {model}: no node could answer (tried {', '.join(tried)})"
                          if tried else f"model {model}: placed on no node")

    def stats(self, model: str) -> ModelStats:
        self.spec(model)
        n = sum(node.per_model.get(model, 0) for node in self.nodes)
        pending = sum(node.in_flight for node in self.holders(model))
        return ModelStats(model, n, 0, n, 0, 0, 0, 0, 0, pending)

    def plan(self) -> Plan | None:
        return None

    def schedule(self) -> Schedule | None:
        return None

    def policy_name(self) -> str:
        return self.cfg.policy.value

    def deploy_config(self) -> DeployConfig:
        return self._deploy

    def cluster_view(self) -> dict[str, Any]:
        return {
            "placement": self.placement,
            "nodes": [{"name": n.name, "models": list(n.models), "ready": n.ready,
                       "failed": n.failed, "in_flight": n.in_flight, "answered": n.answered,
                       "answered_per_model": dict(n.per_model), "last_error": n.last_error}
                      for n in self.nodes],
        }


def deploy_nodes(cfg: ClusterConfig, *, start_timeout_s: float = 300.0
                 ) -> tuple[ClusterBackend, dict[str, Any]]:
    """Place the models, start one Serve deployment per node holding some, wait until
    each reports ready. Ray must be initialised (`ray.init`) and Serve started."""
    from ray import serve

    from dstack.cluster.planning import ClusterPlanner

    planner = ClusterPlanner(cfg)
    specs = planner.nodes()
    placement = planner.place(nodes=specs)
    entries = {e.name: e for e in cfg.nodes}
    view = {"method": placement.method, "predicted_weighted_goodput_rps": placement.value,
            "copies": placement.copies, "served_rps": placement.served}
    states = []
    for s in specs:
        node_cfg = planner.node_config(s, placement)
        if node_cfg is None:
            continue
        entry = entries[s.kind]
        opts: dict[str, Any] = {}
        if entry.device.value == "cuda":
            opts = {"num_gpus": 1, "num_cpus": entry.num_cpus or 1}
        else:
            opts = {"num_cpus": entry.num_cpus or
                    planner.kinds[s.kind].backend.total_units}
        app = serve.deployment(NodeServer).options(
            name=f"node-{s.name}", num_replicas=1, ray_actor_options=opts,
            max_ongoing_requests=4096).bind(s.name, node_cfg.model_dump(mode="json"))
        handle = serve.run(app, name=f"dstack-{s.name}", route_prefix=None)
        states.append(NodeState(s.name, tuple(m.name for m in node_cfg.models), handle))

    async def wait_ready() -> None:
        async def one(n: NodeState) -> None:
            n.ready = await n.handle.start.remote()

        await asyncio.wait_for(asyncio.gather(*(one(n) for n in states)), start_timeout_s)

    asyncio.run(wait_ready())
    return ClusterBackend(cfg, states, view), view


def cluster_app(backend: ClusterBackend):  # type: ignore[no-untyped-def]
    """The ingress app: `dstack serve`'s routes and codec, plus `GET /v1/cluster`."""
    from server.app import create_app

    app = create_app(backend, max_body_bytes=backend.cfg.server.max_body_bytes)

    @app.get("/v1/cluster")
    async def cluster() -> dict[str, Any]:
        return backend.cluster_view()

    return app


def start_ray(cfg: ClusterConfig) -> None:
    """Connect to `ray.address`, or start a local Ray bound to `ray.host`; then Serve with
    its HTTP proxy off (the ingress is ours)."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        if cfg.ray.address:
            ray.init(address=cfg.ray.address, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(_node_ip_address=cfg.ray.host, include_dashboard=False,
                     log_to_driver=False)
    serve.start(proxy_location="Disabled")


def serve_cluster(cfg: ClusterConfig, *, host: str | None = None, port: int | None = None
                  ) -> int:
    """`dstack cluster serve`: Ray, the node deployments, then the ingress until Ctrl-C."""
    import os

    if cfg.ray.address is None and cfg.ray.host in ("127.0.0.1", "localhost"):
        # Before Ray is imported: Ray's switch that keeps every node address on loopback.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    import uvicorn
    from ray import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    start_ray(cfg)
    try:
        backend, view = deploy_nodes(cfg)
        log.info("placement: %s", view["copies"])
        app = cluster_app(backend)
        uvicorn.run(app, host=host or cfg.server.host,
                    port=cfg.server.port if port is None else port,
                    log_level=cfg.server.log_level)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
