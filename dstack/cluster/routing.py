"""The ingress's routing over the cluster's nodes: an `InferenceBackend` (no HTTP here;
`server.cluster` puts the KServe v2 app in front of it).

- A request goes to a node that serves its model (the routing table, which the
  controller changes as models move), the one with the fewest requests in flight from
  here first; a node that failed lately goes last.
- Every call to a node has a timeout from the request's SLO (`call_timeout_slo_factor` x
  SLO + `call_timeout_grace_ms`): a node that hangs costs a request that long at most.
- A node that raises (its actor is gone) or times out is reported to the controller
  (`on_node_error`); the request is retried once on another node serving its model if
  `retry_min_slo_fraction` of its SLO is left. A node that answers `MISSING` (the model
  moved away a moment ago) is skipped without counting as a failure or as the retry.
- With no node left: 503 (504 after a timeout) naming each node tried and what happened.
- While no live node serves a model (its node died and it is being placed again): 503
  with the rule `no_node` and a `Retry-After` of what a node's start took last, less the
  time since, before the body is read (`check_admission`); counted as failures, so that
  the stats and `/metrics` agree, and logged once per outage, when it ends.
- A refusal (429) or a bad request from a node is an answer, passed on as is.
- Arrivals per model feed a `RateTracker` (the controller re-places when rates drift).
- Counters (`stats`, per-node `snapshots`) are the nodes' own, fetched by `refresh`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import numpy as np

from dstack.cluster.config import ClusterConfig
from dstack.cluster.node import NodeReply, NodeSnapshot, ReplyKind
from dstack.common import errors
from dstack.common.backend import ModelStats
from dstack.common.config import DeployConfig
from dstack.common.errors import DStackError, ModelNotFound, Unavailable
from dstack.common.types import ModelSpec, Plan, Schedule
from dstack.runtime.adapt import RateTracker

log = logging.getLogger("dstack.cluster")


#: The rule a request is refused by while no live node serves its model (503).
NO_NODE = "no_node"


@dataclass
class Outage:
    """A model that no live node serves, from `since` (the backend's clock), and why."""

    since: float
    why: str
    refused: int = 0  # requests answered 503 meanwhile


class NodeTimeout(Unavailable):
    """A node did not answer within the request's call timeout (504)."""

    status_code = 504


class NodeClient(Protocol):
    """One node as the ingress calls it (a Ray deployment handle, or a fake in tests)."""

    name: str

    async def infer(self, model: str, inputs: dict[str, np.ndarray]) -> NodeReply: ...
    async def configure(self, cfg_json: dict[str, Any] | None,
                        profiles_json: dict[str, dict[str, Any]] | None) -> bool: ...
    async def snapshot(self) -> NodeSnapshot: ...
    async def ping(self) -> str: ...
    async def stop(self) -> None: ...


@dataclass
class NodeState:
    """The ingress's view of one node."""

    name: str
    client: NodeClient
    serving: set[str] = field(default_factory=set)  # models routed here
    in_flight: dict[str, int] = field(default_factory=dict)
    answered: dict[str, int] = field(default_factory=dict)
    errors_in_row: int = 0  # failed calls or pings since the last good one
    dead: bool = False
    last_error: str = ""
    snapshot: NodeSnapshot | None = None
    ray_node_id: str = ""

    def load(self) -> int:
        return sum(self.in_flight.values())


def _error(reply: NodeReply, node: str) -> DStackError:
    cls = getattr(errors, reply.error_class, None)
    if isinstance(cls, type) and issubclass(cls, DStackError):
        return cls(reply.message)
    return errors.BackendError(f"node {node}: {reply.error_class}: {reply.message}")


def _sum(stats: list[ModelStats], model: str) -> ModelStats:
    total = ModelStats(model, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    for s in stats:
        total = ModelStats(model, *(getattr(total, f.name) + getattr(s, f.name)
                                    for f in fields(ModelStats) if f.name != "model"))
    return total


class ClusterBackend:
    """The ingress's `InferenceBackend` (module docstring)."""

    def __init__(self, cfg: ClusterConfig, nodes: list[NodeState], *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        from dstack.runtime.specs import served_spec

        self.cfg = cfg
        self.nodes = {n.name: n for n in nodes}
        self.specs: dict[str, ModelSpec] = {m.name: served_spec(m) for m in cfg.models}
        self.slo_s = {m.name: m.slo_ms / 1000 for m in cfg.models}
        self.tracker = RateTracker(list(self.specs), alpha=cfg.adapt.ewma_alpha)
        self.clock = clock
        self.on_node_error: Callable[[str], None] = lambda node: None
        self.outages: dict[str, Outage] = {}  # models no live node serves now
        self.start_s: float | None = None  # how long a node's start took last (controller)
        self.failed: dict[str, int] = {}  # requests that failed here (no node answered)
        entry = cfg.nodes[0]
        self._deploy = DeployConfig(device=entry.device, policy=cfg.policy,
                                    profiles=entry.profiles, rate_headroom=cfg.rate_headroom,
                                    reuse_idle=cfg.reuse_idle, server=cfg.server,
                                    models=list(cfg.models))

    # -- InferenceBackend ---------------------------------------------------------------

    def model_names(self) -> list[str]:
        return list(self.specs)

    def spec(self, model: str) -> ModelSpec:
        try:
            return self.specs[model]
        except KeyError:
            raise ModelNotFound(
                f"unknown model {model!r}; served models: {', '.join(self.specs)}") from None

    def holders(self, model: str) -> list[NodeState]:
        """Live nodes serving `model`, least loaded first (a node that failed lately last)."""
        return sorted((n for n in self.nodes.values() if model in n.serving and not n.dead),
                      key=lambda n: (n.errors_in_row > 0, n.in_flight.get(model, 0), n.load()))

    def is_ready(self) -> bool:
        return all(self.is_model_ready(m) for m in self.specs)

    def lost(self, model: str, why: str) -> None:
        """No live node serves `model` from now (`why`), until `routes_changed` sees one."""
        self.outages.setdefault(model, Outage(self.clock(), why))

    def routes_changed(self) -> None:
        """The controller changed what the nodes serve: an outage ends (one log line, with
        what it cost) for each model a live node serves again."""
        for model, out in list(self.outages.items()):
            nodes = [n.name for n in self.holders(model)]
            if nodes:
                del self.outages[model]
                log.log(logging.WARNING if out.refused else logging.INFO,
                        "model %s: served again by %s, %.1f s after %s; meanwhile %d "
                        "requests were refused (503 %s)", model, ", ".join(nodes),
                        self.clock() - out.since, out.why, out.refused, NO_NODE)

    def check_admission(self, model: str) -> None:
        """Before a request's body is read: while no live node serves `model`, raise the
        503 (`NO_NODE`) it is answered with, counted here and logged once per outage."""
        self.spec(model)
        if not self.holders(model):
            raise self._no_node(model)

    def _no_node(self, model: str) -> Unavailable:
        now = self.clock()
        out = self.outages.setdefault(model, Outage(now, "placed on no live node"))
        out.refused += 1
        self.failed[model] = self.failed.get(model, 0) + 1
        left = max(1.0, (self.start_s or 0.0) - (now - out.since))
        err = Unavailable(f"model {model}: no node serves it now ({out.why}); retry after "
                          f"{math.ceil(left)} s")
        err.rule = NO_NODE
        err.retry_after_s = left
        err.logged = True  # once per outage, when it ends (`routes_changed`)
        return err

    def is_model_ready(self, model: str) -> bool:
        self.spec(model)
        return bool(self.holders(model))

    def call_timeout_s(self, model: str) -> float:
        ing = self.cfg.ingress
        return self.slo_s[model] * ing.call_timeout_slo_factor + ing.call_timeout_grace_ms / 1000

    async def infer(self, model: str, inputs: dict[str, np.ndarray],
                    since_received_s: float = 0.0) -> dict[str, np.ndarray]:
        self.spec(model)
        now = self.clock()
        self.tracker.record(model, now)
        deadline = now - since_received_s + self.call_timeout_s(model)
        retry_left_s = self.slo_s[model] * self.cfg.ingress.retry_min_slo_fraction
        tried: list[str] = []
        attempts = 0
        timed_out = False
        holders = self.holders(model)
        if not holders:
            raise self._no_node(model)
        for node in holders:
            left = deadline - self.clock()
            if attempts >= 2 or (attempts == 1 and left < retry_left_s) or left <= 0:
                break
            what = await self._call(node, model, inputs, left)
            if isinstance(what, NodeReply):
                if what.kind is ReplyKind.MISSING:
                    tried.append(f"{node.name} (no longer holds it)")
                    continue
                if what.kind is ReplyKind.ERROR:
                    raise _error(what, node.name)
                assert what.outputs is not None
                return what.outputs
            attempts += 1
            timed_out = timed_out or what == "timeout"
            tried.append(f"{node.name} ({what})")
        self.failed[model] = self.failed.get(model, 0) + 1
        if not tried:  # it waited past its call timeout before reaching here
            raise NodeTimeout(f"model {model}: its call timeout "
                              f"({self.call_timeout_s(model) * 1000:.0f} ms) ran out before "
                              "a node was called")
        msg = f"model {model}: no node could answer (tried {'; '.join(tried)})"
        raise NodeTimeout(msg) if timed_out else Unavailable(msg)

    async def _call(self, node: NodeState, model: str, inputs: dict[str, np.ndarray],
                    timeout_s: float) -> NodeReply | str:
        """The node's reply, or what went wrong ('timeout', 'failed: ...')."""
        node.in_flight[model] = node.in_flight.get(model, 0) + 1
        try:
            reply = await asyncio.wait_for(node.client.infer(model, inputs), timeout_s)
        except TimeoutError:
            self._node_error(node, f"no answer within {timeout_s * 1000:.0f} ms")
            return "timeout"
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the node's actor is gone or broken
            self._node_error(node, f"{type(e).__name__}: {e}"[:300])
            return f"failed: {type(e).__name__}"
        finally:
            node.in_flight[model] -= 1
        node.errors_in_row = 0
        if reply.kind is not ReplyKind.MISSING:
            node.answered[model] = node.answered.get(model, 0) + 1
        return reply

    def _node_error(self, node: NodeState, what: str) -> None:
        node.errors_in_row += 1
        node.last_error = what
        log.warning("node %s: %s", node.name, what)
        self.on_node_error(node.name)

    def stats(self, model: str) -> ModelStats:
        """The nodes' counts summed (as of the last `refresh`), plus requests that no node
        answered here."""
        self.spec(model)
        got = [n.snapshot.per_model[model].stats for n in self.nodes.values()
               if n.snapshot is not None and model in n.snapshot.per_model]
        s = _sum(got, model)
        extra = self.failed.get(model, 0)
        live = sum(n.snapshot.per_model[model].stats.pending for n in self.nodes.values()
                   if not n.dead and n.snapshot is not None and model in n.snapshot.per_model)
        return ModelStats(model, s.request_success, s.request_failure + extra,
                          s.inference_count, s.execution_count, s.queue_ns, s.compute_ns,
                          s.refused, s.slo_met, live)

    def refusals(self, model: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for n in self.nodes.values():
            if n.snapshot is not None and model in n.snapshot.per_model:
                for rule, k in n.snapshot.per_model[model].refused_by_rule.items():
                    out[rule] = out.get(rule, 0) + k
        return out

    async def refresh(self, timeout_s: float = 2.0) -> None:
        """Fetch every live node's counters (a node that does not answer keeps its last)."""
        async def one(n: NodeState) -> None:
            try:
                n.snapshot = await asyncio.wait_for(n.client.snapshot(), timeout_s)
                n.ray_node_id = n.snapshot.ray_node_id or n.ray_node_id
            except Exception as e:  # noqa: BLE001 - a dead node keeps its last counts
                log.debug("node %s: no snapshot: %s", n.name, e)

        await asyncio.gather(*(one(n) for n in self.nodes.values() if not n.dead))

    def plan(self) -> Plan | None:
        return None

    def schedule(self) -> Schedule | None:
        return None

    def policy_name(self) -> str:
        return self.cfg.policy.value

    def deploy_config(self) -> DeployConfig:
        return self._deploy

    def forget_device_memory(self, handle: bytes) -> None:
        """Nothing to close: inputs reach the nodes as host arrays (`DeviceInput`)."""

    def node_view(self) -> list[dict[str, Any]]:
        out = []
        for n in self.nodes.values():
            snap = n.snapshot
            out.append({"name": n.name, "serving": sorted(n.serving), "dead": n.dead,
                        "ready": bool(snap and snap.ready), "ray_node_id": n.ray_node_id,
                        "in_flight": n.load(), "answered_per_model": dict(n.answered),
                        "errors_in_row": n.errors_in_row, "last_error": n.last_error,
                        "runtimes_started": snap.runtimes_started if snap else 0})
        return out
