"""The cluster on Ray Serve: one deployment per node, and how the ingress reaches them.

- One Ray Serve deployment per node of the cluster file (`NodeServer`, one replica:
  `num_gpus: 1` on a GPU node, `num_cpus` on a CPU node, default its profiled cores), which
  runs a dstack `Runtime` for the models the placement puts there (`dstack.cluster.node`).
- `RayNodeClient`: the ingress's calls to a node, through its deployment handle.
- `RayDeployer`: starts and deletes the deployments; says when the Ray node a deployment
  ran on is dead (`ray.nodes()`), for the controller (`dstack.cluster.control`).
- Ray's own HTTP proxy is off (`proxy_location: Disabled`); a Ray started here binds
  `ray.host` (127.0.0.1 by default), and with a loopback `ray.host` each replica's gRPC
  server too (`replica_grpc_on_loopback`). The KServe v2 ingress is `server.cluster`.

No HTTP here: `server/` is above `dstack/`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import numpy as np

from dstack.cluster.config import ClusterConfig
from dstack.cluster.control import ClusterController
from dstack.cluster.node import NodeReply, NodeServer, NodeSnapshot
from dstack.cluster.planning import ClusterPlanner

log = logging.getLogger("dstack.cluster")


class RayNodeClient:
    """A node's `NodeServer` through its Serve deployment handle."""

    def __init__(self, name: str, handle: Any) -> None:
        self.name = name
        self.handle = handle

    async def infer(self, model: str, inputs: dict[str, np.ndarray]) -> NodeReply:
        return await self.handle.infer.remote(model, inputs)  # type: ignore[no-any-return]

    async def configure(self, cfg_json: dict[str, Any] | None,
                        profiles_json: dict[str, dict[str, Any]] | None) -> bool:
        return await self.handle.configure.remote(cfg_json, profiles_json)  # type: ignore[no-any-return]

    async def snapshot(self) -> NodeSnapshot:
        return await self.handle.snapshot.remote()  # type: ignore[no-any-return]

    async def ping(self) -> str:
        return await self.handle.ping.remote()  # type: ignore[no-any-return]

    async def stop(self) -> None:
        await self.handle.stop.remote()


def is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1")


def replica_grpc_on_loopback() -> None:
    """In a node's replica when the cluster is on loopback: Ray Serve 2.60 binds each
    replica's inter-deployment gRPC server to `[::]:0` (every interface) with no setting
    to change it; bind it to 127.0.0.1 instead."""
    from ray.serve._private import replica

    bind = replica.add_port_to_grpc_server

    def on_loopback(server: Any, address: str) -> int:
        if address.startswith("[::]:"):
            address = "127.0.0.1:" + address.rsplit(":", 1)[1]
        return bind(server, address)  # type: ignore[no-any-return]

    replica.add_port_to_grpc_server = on_loopback


class RayNodeServer(NodeServer):
    """`NodeServer` as a Serve replica: on a loopback cluster, its gRPC server on loopback
    too (the constructor runs before Serve starts that server)."""

    def __init__(self, node: str, *, drain_timeout_s: float = 30.0, loopback: bool = True
                 ) -> None:
        if loopback:
            replica_grpc_on_loopback()
        super().__init__(node, drain_timeout_s=drain_timeout_s)


def app_name(node: str) -> str:
    return f"dstack-{node}"


class RayDeployer:
    """Node deployments on Ray Serve (Ray initialised and Serve started: `start_ray`)."""

    def __init__(self, cfg: ClusterConfig, planner: ClusterPlanner) -> None:
        self.cfg = cfg
        self.planner = planner

    def actor_options(self, kind: str) -> dict[str, Any]:
        entry = self.planner.kinds[kind].entry
        if entry.device.value == "cuda":
            opts: dict[str, Any] = {"num_gpus": 1, "num_cpus": entry.num_cpus or 1}
        else:
            opts = {"num_cpus": entry.num_cpus or self.planner.kinds[kind].backend.total_units}
        return opts

    async def start(self, node: str, kind: str) -> RayNodeClient:
        from ray import serve

        app = serve.deployment(RayNodeServer).options(
            name=f"node-{node}", num_replicas=1, ray_actor_options=self.actor_options(kind),
            max_ongoing_requests=4096,
        ).bind(node, drain_timeout_s=self.cfg.ingress.drain_timeout_s,
               loopback=is_loopback(self.cfg.ray.host))
        # serve.run blocks until the replica is up (a NodeServer starts no workers yet).
        handle = await asyncio.to_thread(serve.run, app, name=app_name(node),
                                         route_prefix=None)
        return RayNodeClient(node, handle)

    async def remove(self, node: str) -> None:
        from ray import serve

        try:
            await asyncio.to_thread(serve.delete, app_name(node), _blocking=False)
        except Exception as e:  # noqa: BLE001 - Serve may be shutting down
            log.warning("deleting the deployment of node %s: %s", node, e)

    async def gone(self, ray_node_id: str) -> bool:
        import ray

        nodes = await asyncio.to_thread(ray.nodes)
        return any(n.get("NodeID") == ray_node_id and not n.get("Alive", True) for n in nodes)


def loopback_ray_env(cfg: ClusterConfig) -> None:
    """Before Ray is imported: Ray's switch that keeps every node address on loopback,
    when the cluster is local and its host is loopback."""
    if cfg.ray.address is None and is_loopback(cfg.ray.host):
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def start_ray(cfg: ClusterConfig) -> None:
    """Connect to `ray.address`, or start a local Ray bound to `ray.host`; then Serve with
    its HTTP proxy off (the ingress is `server.cluster`)."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        if cfg.ray.address:
            ray.init(address=cfg.ray.address, include_dashboard=False, log_to_driver=False)
        else:
            # "local": not the cluster RAY_ADDRESS or /tmp/ray's last one names (the
            # default), which may be another's, or dead: minutes of retries, then no start
            ray.init(address="local", _node_ip_address=cfg.ray.host, include_dashboard=False,
                     log_to_driver=False)
    serve.start(proxy_location="Disabled")


def stop_ray() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


async def start_cluster(cfg: ClusterConfig) -> ClusterController:
    """Ray must be up (`start_ray`). The controller, its nodes started and its models
    placed and ready (`controller.backend`); run `controller.run()` as a task."""
    planner = ClusterPlanner(cfg)
    controller = ClusterController(cfg, RayDeployer(cfg, planner), planner=planner)
    await controller.start()
    return controller
