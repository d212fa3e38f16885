"""One cluster node: the body of its Ray Serve deployment, a dstack `Runtime` for the models
placed there. Plain Python (no Ray import at module level, no HTTP): `dstack.cluster.serving`
wraps it in a deployment, and tests drive it in-process.

A node changes its models the way GSLICE changes a slice, with a shadow: `configure`
starts a new runtime for the new set (its own plan and workers) while the old one keeps
serving, switches to it once every worker is ready, and stops the old one after its
requests are answered (or `drain_timeout_s`). A model the node no longer holds is
answered `MISSING` (the ingress then asks another node), never an error to the client.
Counters survive the switch: a retired runtime's counts are kept and added in.

Messages to the ingress are typed (`NodeReply`, `NodeSnapshot`), never tuples.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from dstack.common.backend import ModelStats
from dstack.common.config import DeployConfig
from dstack.common.errors import DStackError

log = logging.getLogger("dstack.cluster.node")


class ReplyKind(StrEnum):
    OK = "ok"
    ERROR = "error"  # a DStackError raised by the node's runtime: an answer, passed on
    MISSING = "missing"  # the node does not hold the model (any more): ask another node


@dataclass(frozen=True, slots=True)
class NodeReply:
    kind: ReplyKind
    outputs: dict[str, np.ndarray] | None = None
    error_class: str = ""  # a class of dstack.common.errors
    message: str = ""


@dataclass(frozen=True, slots=True)
class ModelSnapshot:
    """One model's counters on one node since the node started (every runtime it ran)."""

    stats: ModelStats
    refused_by_rule: dict[str, int] = field(default_factory=dict)
    batch_cap: int = 0
    slice_percent: float | None = None


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    node: str
    ready: bool
    models: tuple[str, ...]  # served by the current runtime
    draining: tuple[str, ...]  # still answered by a runtime being retired
    per_model: dict[str, ModelSnapshot]
    ray_node_id: str = ""
    pid: int = 0
    runtimes_started: int = 0


class RuntimeLike(Protocol):
    """What a node uses of `dstack.runtime.serving.Runtime` (a fake plugs in here)."""

    specs: dict[str, Any]

    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    def is_ready(self) -> bool: ...
    async def infer(self, model: str, inputs: dict[str, np.ndarray]
                    ) -> dict[str, np.ndarray]: ...
    def stats(self, model: str) -> ModelStats: ...
    def refusals(self, model: str) -> dict[str, int]: ...
    def current_batch_cap(self, model: str) -> int: ...
    def current_slice(self, model: str) -> Any: ...


def _real_runtime(cfg: DeployConfig) -> RuntimeLike:
    from dstack.runtime.serving import Runtime

    return Runtime(cfg)


def _add_stats(a: ModelStats | None, b: ModelStats) -> ModelStats:
    if a is None:
        return b
    return ModelStats(a.model, *(getattr(a, f.name) + getattr(b, f.name)
                                 for f in fields(ModelStats) if f.name != "model"))


class NodeServer:
    """One node (module docstring). Every method runs on the actor's event loop."""

    def __init__(self, node: str, *, drain_timeout_s: float = 30.0,
                 runtime_factory: Callable[[DeployConfig], RuntimeLike] = _real_runtime
                 ) -> None:
        self.node = node
        self.drain_timeout_s = drain_timeout_s
        self._factory = runtime_factory
        self.runtime: RuntimeLike | None = None
        self._draining: list[RuntimeLike] = []
        self._retired: dict[str, ModelStats] = {}
        self._retired_rules: dict[str, dict[str, int]] = {}
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._dir = Path(tempfile.mkdtemp(prefix=f"dstack-node-{node}-"))
        self._started = 0

    # -- changes ------------------------------------------------------------------------

    async def configure(self, cfg_json: dict[str, Any] | None,
                        profiles_json: dict[str, dict[str, Any]] | None = None) -> bool:
        """Serve the deployment `cfg_json` (None: no model) from now on, through a shadow
        runtime (module docstring). `profiles_json`: the profiles its planner reads, by
        model, written here so that a node on another machine needs no files. True once
        the new runtime is ready; raises (the old one still serving) if it cannot start."""
        async with self._lock:
            new: RuntimeLike | None = None
            if cfg_json is not None:
                cfg = DeployConfig.model_validate(cfg_json)
                if profiles_json:
                    pdir = self._dir / f"profiles-{self._started}"
                    pdir.mkdir()
                    import json

                    for name, prof in profiles_json.items():
                        (pdir / f"{name}.json").write_text(json.dumps(prof))
                    cfg = cfg.model_copy(update={"profiles": pdir})
                new = self._factory(cfg)
                try:
                    await new.start()
                except BaseException:
                    with contextlib.suppress(Exception):
                        await new.stop()
                    raise
                self._started += 1
            old, self.runtime = self.runtime, new
            if old is not None:
                self._draining.append(old)
                task = asyncio.ensure_future(self._retire(old))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            log.info("node %s now serves %s", self.node,
                     ", ".join(new.specs) if new is not None else "nothing")
            return new is None or new.is_ready()

    async def _retire(self, rt: RuntimeLike) -> None:
        """Stop `rt` once nothing is pending on it (or after the drain timeout); keep its
        counts."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self.drain_timeout_s
        while loop.time() < end and any(rt.stats(m).pending for m in rt.specs):
            await asyncio.sleep(0.02)
        with contextlib.suppress(Exception):
            await rt.stop()
        for m in rt.specs:
            self._retired[m] = _add_stats(self._retired.get(m), rt.stats(m))
            rules = self._retired_rules.setdefault(m, {})
            for rule, n in rt.refusals(m).items():
                rules[rule] = rules.get(rule, 0) + n
        self._draining.remove(rt)

    # -- requests -----------------------------------------------------------------------

    def _runtime_for(self, model: str) -> RuntimeLike | None:
        if self.runtime is not None and model in self.runtime.specs:
            return self.runtime
        return next((rt for rt in reversed(self._draining) if model in rt.specs), None)

    async def infer(self, model: str, inputs: dict[str, np.ndarray]) -> NodeReply:
        rt = self._runtime_for(model)
        if rt is None:
            return NodeReply(ReplyKind.MISSING, message=f"node {self.node} does not hold "
                             f"model {model}")
        try:
            out = await rt.infer(model, inputs)
        except DStackError as e:
            return NodeReply(ReplyKind.ERROR, None, type(e).__name__, str(e))
        return NodeReply(ReplyKind.OK, out)

    # -- state --------------------------------------------------------------------------

    def ready(self) -> bool:
        return self.runtime is None or self.runtime.is_ready()

    async def ping(self) -> str:
        """The Ray node this node runs on ('' outside Ray): the health check's call."""
        try:
            import ray

            if not ray.is_initialized():  # asking the context would start a local Ray
                return ""
            return str(ray.get_runtime_context().get_node_id())
        except Exception:
            return ""

    async def snapshot(self) -> NodeSnapshot:
        per: dict[str, ModelSnapshot] = {}
        live = [rt for rt in (*self._draining, self.runtime) if rt is not None]
        names = set(self._retired) | {m for rt in live for m in rt.specs}
        for m in sorted(names):
            total = self._retired.get(m)
            rules = dict(self._retired_rules.get(m, {}))
            for rt in live:
                if m in rt.specs:
                    total = _add_stats(total, rt.stats(m))
                    for rule, n in rt.refusals(m).items():
                        rules[rule] = rules.get(rule, 0) + n
            assert total is not None
            cap, pct = 0, None
            if self.runtime is not None and m in self.runtime.specs:
                cap = self.runtime.current_batch_cap(m)
                sl = self.runtime.current_slice(m)
                pct = sl.percent if sl is not None else None
            per[m] = ModelSnapshot(total, rules, cap, pct)
        return NodeSnapshot(
            self.node, self.ready(),
            tuple(self.runtime.specs) if self.runtime is not None else (),
            tuple(m for rt in self._draining for m in rt.specs), per,
            await self.ping(), os.getpid(), self._started)

    async def stop(self) -> None:
        """Stop every runtime (the deployment is going away)."""
        async with self._lock:
            for t in list(self._tasks):
                t.cancel()
            for rt in [*self._draining, *([self.runtime] if self.runtime else [])]:
                with contextlib.suppress(Exception):
                    await rt.stop()
            self._draining.clear()
            self.runtime = None
