"""The cluster's controller: the placement applied to the nodes, kept alive as nodes die
and rates drift. Plain asyncio over `NodeClient`s (Ray's in `dstack.cluster.serving`,
fakes in tests); the routing it changes is `ClusterBackend`'s.

- **Moves** (`apply`): a model placed on a new node is started there first (the node's
  shadow runtime, `dstack.cluster.node`) while its old node keeps serving it; once the new
  node is ready the routing table sends it there; the old node stops it when the requests
  it still has are answered (`drain_timeout_s`). No request of a moving model fails for the
  move. Nodes change in parallel; a node that cannot start its new set keeps its old one.
- **Dead nodes**: a node whose Ray node is gone, or that failed `dead_after` pings or calls
  in a row, is taken out of the routing (its requests in flight fail fast or are retried,
  `routing`), its deployment deleted, and the placement run again on the survivors, each
  with what it serves now as resident (Compass: a model stays where it is loaded unless
  moving it gains goodput).
- **Drift**: every `adapt.sample_s` the arrival rates measured at the ingress are sampled;
  when `ReplanTrigger` says they drifted, the placement is run again at the measured rates
  (residency preferred) and applied. `feed_rates` does the same at given rates, now.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from dstack.cluster.config import ClusterConfig
from dstack.cluster.planning import ClusterPlanner
from dstack.cluster.routing import ClusterBackend, NodeClient, NodeState
from dstack.runtime.adapt import ReplanTrigger
from optimizer.placement import NodeSpec, Placement

log = logging.getLogger("dstack.cluster")


class Deployer(Protocol):
    """Starts and removes node deployments (Ray Serve in `dstack.cluster.serving`)."""

    async def start(self, node: str, kind: str) -> NodeClient:
        """The node's deployment, up, serving no model yet."""
        ...

    async def remove(self, node: str) -> None: ...

    async def gone(self, ray_node_id: str) -> bool:
        """True when the (Ray) node the deployment ran on is known to be dead."""
        ...


class ClusterController:
    """See the module docstring. Call `start`, then run `run()` as a task; `stop` at the end."""

    def __init__(self, cfg: ClusterConfig, deployer: Deployer, *,
                 planner: ClusterPlanner | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.deployer = deployer
        self.planner = planner or ClusterPlanner(cfg)
        self.clock = clock
        self.specs = {s.name: s for s in self.planner.nodes()}
        # The routing exists before the nodes do (the app is built on it); `start` adds them.
        self.backend = ClusterBackend(cfg, [], clock=clock)
        self.backend.on_node_error = self._on_node_error
        self.placement: Placement | None = None
        self.copies: dict[str, dict[str, int]] = {}  # node -> model -> copies it runs now
        self.rates: dict[str, float] = {m.name: m.rate_rps for m in cfg.models}
        self.trigger = ReplanTrigger(dict(self.rates), drift=cfg.adapt.drift,
                                     hold_s=cfg.adapt.hold_s, down_hold_s=cfg.adapt.down_hold_s)
        self.measured: dict[str, float] = {}  # the last rates sampled at the ingress
        self.events: deque[dict[str, Any]] = deque(maxlen=200)
        self.replacements = 0
        self._lock = asyncio.Lock()
        self._checking: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- life ---------------------------------------------------------------------------

    async def start(self) -> ClusterBackend:
        """Start every node's deployment, place the models, start them; the backend."""
        for s in self.specs.values():
            self.backend.nodes[s.name] = NodeState(s.name,
                                                   await self.deployer.start(s.name, s.kind))
        await self.check_nodes()  # which Ray node each runs on
        placement = await asyncio.to_thread(self.planner.place, nodes=list(self.specs.values()))
        async with self._lock:
            await self._apply(placement, None, "start")
        return self.backend

    async def run(self) -> None:
        """Health checks every `health_interval_s`; rates sampled every `adapt.sample_s`."""
        ing = self.cfg.ingress
        next_sample = self.clock() + self.cfg.adapt.sample_s
        while True:
            await asyncio.sleep(ing.health_interval_s)
            await self.check_nodes()
            now = self.clock()
            if self.cfg.adapt.enabled and now >= next_sample:
                next_sample = now + self.cfg.adapt.sample_s
                rates = self.backend.tracker.sample(now)
                self.measured = rates
                if self.cfg.ingress.replace_on_drift and self.trigger.should_replan(now, rates):
                    await self.replace(rates, "rates drifted")

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        for n in self.backend.nodes.values():
            if not n.dead:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(n.client.stop(), 30)
            with contextlib.suppress(Exception):
                await self.deployer.remove(n.name)

    def _event(self, kind: str, **detail: Any) -> None:
        e = {"t": round(self.clock(), 3), "event": kind, **detail}
        self.events.append(e)
        log.info("cluster: %s %s", kind, detail)

    # -- health -------------------------------------------------------------------------

    def _on_node_error(self, node: str) -> None:
        """A call to `node` raised: check it now rather than at the next health tick."""
        if node not in self._checking:
            self._spawn(self.check_node(node))

    def _spawn(self, coro: Any) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def check_nodes(self) -> None:
        await asyncio.gather(*(self.check_node(n.name) for n in self.backend.nodes.values()
                               if not n.dead))

    async def check_node(self, name: str) -> None:
        """Ping `name`; declare it dead when Ray says its node is gone or it failed
        `dead_after` times in a row."""
        node = self.backend.nodes[name]
        if node.dead or name in self._checking:
            return
        self._checking.add(name)
        try:
            try:
                rid = await asyncio.wait_for(node.client.ping(), self.cfg.ingress.ping_timeout_s)
                node.ray_node_id = rid or node.ray_node_id
                node.errors_in_row = 0
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - any failure of a ping counts
                node.errors_in_row += 1
                node.last_error = f"ping: {type(e).__name__}: {e}"[:300]
            gone = bool(node.ray_node_id) and await self.deployer.gone(node.ray_node_id)
            if gone or node.errors_in_row >= self.cfg.ingress.dead_after:
                await self.node_died(name, "its Ray node is gone" if gone else node.last_error)
        finally:
            self._checking.discard(name)

    async def node_died(self, name: str, why: str) -> None:
        """Route around `name`, delete its deployment, re-place its models on the survivors."""
        node = self.backend.nodes[name]
        if node.dead:
            return
        node.dead = True
        lost = sorted(node.serving)
        node.serving = set()
        self._event("node_dead", node=name, why=why, models=lost)
        for m in lost:
            if not self.backend.holders(m):
                self.backend.lost(m, f"its node {name} went down: {why}")
        self._spawn(self.deployer.remove(name))
        if self.cfg.ingress.replace_dead and any(not n.dead for n in self.backend.nodes.values()):
            await self.replace(None, f"node {name} died")

    # -- re-placement -------------------------------------------------------------------

    async def feed_rates(self, rates: Mapping[str, float]) -> Placement:
        """Place again at `rates` (as if measured), now, and apply it."""
        full = {**self.rates, **{m: float(r) for m, r in rates.items()}}
        return await self.replace(full, "rates fed")

    async def replace(self, rates: Mapping[str, float] | None, reason: str) -> Placement:
        """Run the placement on the live nodes (each resident with what it serves now) at
        `rates` (None: the current ones) and apply it."""
        async with self._lock:
            rates = dict(rates) if rates is not None else dict(self.rates)
            live = [NodeSpec(s.name, s.kind, s.memory_mb,
                             frozenset(self.copies.get(s.name, {})) or s.resident)
                    for s in self.specs.values() if not self.backend.nodes[s.name].dead]
            placement = await asyncio.to_thread(self.planner.place, nodes=live, rates=rates)
            await self._apply(placement, rates, reason)
            self.replacements += 1
            return placement

    async def _apply(self, new: Placement, rates: dict[str, float] | None, reason: str) -> None:
        """The move protocol (module docstring). Caller holds the lock."""
        b = self.backend
        live = [s for s in self.specs.values() if not b.nodes[s.name].dead]
        old = {s.name: dict(self.copies.get(s.name, {})) for s in live}
        moves = {m: (sorted(n for n in old if m in old[n]),
                     sorted(n for n, c in new.copies.items() if m in c))
                 for m in self.planner.models}
        moves = {m: v for m, v in moves.items() if v[0] != v[1]}
        self._event("placement", reason=reason, copies=new.copies, moves=moves,
                    rates=rates or {})
        # 1. Start: every node that gains a model (or changes a copy count) starts its
        #    new set, keeping the models it is about to lose.
        started: dict[str, dict[str, int]] = {}

        async def grow(s: NodeSpec) -> None:
            cur, nxt = old[s.name], new.copies.get(s.name, {})
            if all(cur.get(m) == c for m, c in nxt.items()):
                return
            keep = {m: c for m, c in cur.items() if m not in nxt}
            cfg = self.planner.node_config(s, new, rates=rates, keep=keep)
            if await self._configure(s, cfg):
                started[s.name] = {**nxt, **keep}

        await asyncio.gather(*(grow(s) for s in live))
        for name, copies in started.items():
            self.copies[name] = copies
            b.nodes[name].serving = set(copies)
        b.routes_changed()
        # 2. Switch, 3. stop: a node gives up a model once another node serves it.
        async def shrink(s: NodeSpec) -> None:
            node = b.nodes[s.name]
            nxt = new.copies.get(s.name, {})
            drop = [m for m in self.copies.get(s.name, {}) if m not in nxt
                    and any(m in o.serving for o in b.nodes.values()
                            if o is not node and not o.dead)]
            if not drop:
                return
            node.serving -= set(drop)  # the switch: no new request goes there
            loop = asyncio.get_running_loop()
            end = loop.time() + self.cfg.ingress.drain_timeout_s
            while loop.time() < end and any(node.in_flight.get(m, 0) for m in drop):
                await asyncio.sleep(0.02)
            keep = {m: c for m, c in self.copies[s.name].items() if m not in drop}
            cfg = self.planner.node_config(s, _only(new, s.name, keep), rates=rates)
            if await self._configure(s, cfg):
                self.copies[s.name] = keep
            else:
                node.serving |= set(drop)  # could not restart without them: keep serving

        await asyncio.gather(*(shrink(s) for s in live))
        self.placement = new
        if rates is not None:
            self.rates = dict(rates)
        self.trigger.planned(self.clock(), dict(self.rates))
        self._event("placed", copies={n: dict(c) for n, c in self.copies.items() if c})

    async def _configure(self, s: NodeSpec, cfg: Any) -> bool:
        node = self.backend.nodes[s.name]
        models = [m.name for m in cfg.models] if cfg is not None else []
        profs = self.planner.node_profiles(s.kind, models) if models else None
        t0 = self.clock()
        try:
            await asyncio.wait_for(
                node.client.configure(cfg.model_dump(mode="json") if cfg is not None else None,
                                      profs), self.cfg.ingress.start_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the node keeps its old set
            self._event("configure_failed", node=s.name, models=models,
                        error=f"{type(e).__name__}: {e}"[:300])
            return False
        if models:  # what a model placed again waits for (the 503s' Retry-After)
            self.backend.start_s = self.clock() - t0
        self._event("configured", node=s.name, models=models)
        return True

    def view(self) -> dict[str, Any]:
        """`GET /v1/cluster`: the placement, the nodes, the rates, the recent events."""
        p = self.placement
        return {
            "placement": None if p is None else {
                "method": p.method, "predicted_weighted_goodput_rps": p.value,
                "copies": p.copies, "served_rps": p.served},
            "serving": {n: dict(c) for n, c in self.copies.items()},
            "planned_rates_rps": self.rates,
            "measured_rates_rps": {m: round(r, 3) for m, r in self.measured.items()},
            "replacements": self.replacements,
            "nodes": self.backend.node_view(),
            "events": list(self.events)[-30:],
        }


def _only(p: Placement, node: str, copies: dict[str, int]) -> Placement:
    """`p` with `node` holding `copies` (for that node's final config)."""
    from dataclasses import replace

    return replace(p, copies={**p.copies, node: dict(copies)})
