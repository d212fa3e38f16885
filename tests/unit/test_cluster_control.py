"""The cluster's controller and routing on fake nodes (no Ray, no workers): moves under
load lose no request, a dead node's models are re-placed on the survivor, a node that hangs
costs a request its call timeout at most, a failed call is retried once elsewhere, and the
ingress sums the nodes' counters. The same code runs on Ray in
tests/integration/test_cluster_ray.py."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dstack.cluster.config import parse_cluster
from dstack.cluster.control import ClusterController
from dstack.cluster.node import NodeReply, NodeServer, NodeSnapshot
from dstack.cluster.routing import NO_NODE, NodeTimeout
from dstack.common.backend import ModelStats
from dstack.common.config import DeployConfig
from dstack.common.errors import Unavailable

ROOT = Path(__file__).resolve().parents[2]


class FakeRuntime:
    """A runtime whose `infer` takes `delay_s` and echoes its input."""

    def __init__(self, cfg: DeployConfig, start_s: float = 0.05, delay_s: float = 0.005
                 ) -> None:
        self.cfg = cfg
        self.specs = {m.name: m for m in cfg.models}
        self.start_s, self.delay_s = start_s, delay_s
        self.ready = False
        self.stopped = False
        self.served = dict.fromkeys(self.specs, 0)
        self.pending = dict.fromkeys(self.specs, 0)

    async def start(self) -> None:
        await asyncio.sleep(self.start_s)
        self.ready = True

    async def stop(self) -> None:
        self.stopped = True
        self.ready = False

    def is_ready(self) -> bool:
        return self.ready

    async def infer(self, model: str, inputs: dict[str, np.ndarray],
                    since_received_s: float = 0.0) -> dict[str, np.ndarray]:
        assert not self.stopped, "a request reached a stopped runtime"
        self.pending[model] += 1
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.pending[model] -= 1
        self.served[model] += 1
        return {"output": next(iter(inputs.values()))}

    def stats(self, model: str) -> ModelStats:
        n = self.served[model]
        return ModelStats(model, n, 0, n, n, 0, 0, 0, n, self.pending[model])

    def refusals(self, model: str) -> dict[str, int]:
        return {}

    def current_batch_cap(self, model: str) -> int:
        return 1

    def current_slice(self, model: str) -> Any:
        return None


class FakeNode:
    """A `NodeServer` called in-process; `kill()` makes every call fail, `hang()` never
    answer (as a node whose actor died or whose machine stalled)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.server = NodeServer(name, drain_timeout_s=5, runtime_factory=FakeRuntime)
        self.dead = self.hung = False
        self.configured: list[list[str]] = []

        # The snapshot names the node's Ray node as `ping` does: this fake's "ray-NAME".
        # NodeServer's own asks Ray, which, not connected here, started a local Ray
        # instance in the test process (~10 s, and it ran on for the rest of the session).
        async def ray_node_id() -> str:
            return f"ray-{name}"

        self.server.ping = ray_node_id  # type: ignore[method-assign]

    async def _check(self) -> None:
        if self.hung:
            await asyncio.sleep(3600)
        if self.dead:
            raise RuntimeError(f"the actor of node {self.name} died")

    async def infer(self, model: str, inputs: dict[str, np.ndarray]) -> NodeReply:
        await self._check()
        return await self.server.infer(model, inputs)

    async def configure(self, cfg_json: dict[str, Any] | None,
                        profiles_json: dict[str, Any] | None) -> bool:
        await self._check()
        self.configured.append(sorted(m["name"] for m in (cfg_json or {}).get("models", [])))
        return await self.server.configure(cfg_json, profiles_json)

    async def snapshot(self) -> NodeSnapshot:
        await self._check()
        return await self.server.snapshot()

    async def ping(self) -> str:
        await self._check()
        return f"ray-{self.name}"

    async def stop(self) -> None:
        await self.server.stop()


class FakeDeployer:
    def __init__(self) -> None:
        self.nodes: dict[str, FakeNode] = {}
        self.removed: list[str] = []
        self.gone_ids: set[str] = set()

    async def start(self, node: str, kind: str) -> FakeNode:
        self.nodes[node] = FakeNode(node)
        return self.nodes[node]

    async def remove(self, node: str) -> None:
        self.removed.append(node)

    async def gone(self, ray_node_id: str) -> bool:
        return ray_node_id in self.gone_ids


def config(**ingress: Any):  # type: ignore[no-untyped-def]
    node = {"device": "cpu", "profiles": str(ROOT / "profiles" / "cpu"), "memory_mb": 2048}
    return parse_cluster({
        "policy": "dstack", "adapt": {"enabled": False},
        "ingress": {"health_interval_s": 0.05, "ping_timeout_s": 0.2, "dead_after": 2,
                    **ingress},
        "nodes": [{**node, "name": "a", "cores": [0], "resident": ["tiny_a", "mob"]},
                  {**node, "name": "b", "cores": [1], "resident": ["tiny_b"]}],
        "models": [
            {"name": "tiny_a", "zoo_name": "tiny_cnn", "slo_ms": 500, "rate_rps": 20,
             "max_batch_size": 4, "max_replicas": 1},
            {"name": "tiny_b", "zoo_name": "tiny_cnn", "slo_ms": 500, "rate_rps": 20,
             "max_batch_size": 4, "max_replicas": 1},
            {"name": "mob", "zoo_name": "mobilenet_v3_small", "slo_ms": 200, "rate_rps": 5,
             "max_batch_size": 4, "max_replicas": 1},
        ],
    })


X = {"input": np.zeros((1, 3, 32, 32), np.float32)}


async def started(**ingress: Any) -> tuple[ClusterController, FakeDeployer]:
    dep = FakeDeployer()
    ctl = ClusterController(config(**ingress), dep)
    await ctl.start()
    return ctl, dep


def serving(ctl: ClusterController) -> dict[str, list[str]]:
    return {n.name: sorted(n.serving) for n in ctl.backend.nodes.values()}


def test_placement_on_start_follows_residency() -> None:
    async def main() -> None:
        ctl, dep = await started()
        assert serving(ctl) == {"a": ["mob", "tiny_a"], "b": ["tiny_b"]}
        assert ctl.backend.is_ready()
        # each node got its profiles read as one core, and its own cores
        cfg = dep.nodes["a"].server.runtime.cfg  # type: ignore[union-attr]
        assert cfg.cores == (0,)
        assert cfg.profiles is not None and (cfg.profiles / "tiny_cnn.json").exists()
        await ctl.stop()

    asyncio.run(main())


def test_a_move_under_load_loses_no_request() -> None:
    async def main() -> None:
        ctl, dep = await started()
        b = ctl.backend
        stop = asyncio.Event()
        answered: dict[str, int] = {}
        errors: list[str] = []

        async def client(model: str) -> None:
            while not stop.is_set():
                try:
                    await b.infer(model, X)
                    answered[model] = answered.get(model, 0) + 1
                except Exception as e:  # noqa: BLE001 - every failure is the test's failure
                    errors.append(f"{model}: {e}")
                await asyncio.sleep(0.001)

        clients = [asyncio.create_task(client(m)) for m in ("tiny_a", "tiny_b", "mob")
                   for _ in range(3)]
        await asyncio.sleep(0.1)
        old_a = dep.nodes["a"].server.runtime
        # mobilenet's rate goes up 30x: it needs node a to itself, so tiny_a moves to b.
        p = await ctl.feed_rates({"mob": 150})
        await asyncio.sleep(0.1)
        stop.set()
        await asyncio.gather(*clients)
        assert p.copies == {"a": {"mob": 1}, "b": {"tiny_a": 1, "tiny_b": 1}}
        assert serving(ctl) == {"a": ["mob"], "b": ["tiny_a", "tiny_b"]}
        assert errors == []
        assert all(answered.get(m, 0) > 10 for m in ("tiny_a", "tiny_b", "mob"))
        # started on b (with both) before a gave it up; a's old runtime was drained, stopped
        assert dep.nodes["b"].configured == [["tiny_b"], ["tiny_a", "tiny_b"]]
        assert dep.nodes["a"].configured == [["mob", "tiny_a"], ["mob"]]
        kinds = [e["event"] for e in ctl.events]
        assert kinds.index("configured") < kinds.index("placed")
        for _ in range(100):
            if old_a.stopped:  # type: ignore[union-attr]
                break
            await asyncio.sleep(0.02)
        assert old_a.stopped  # type: ignore[union-attr]
        # the counters survive the switch: the node's and the ingress's sums agree
        await b.refresh()
        for m in ("tiny_a", "tiny_b", "mob"):
            assert b.stats(m).request_success == answered[m]
        a_snap = b.nodes["a"].snapshot
        assert a_snap is not None and a_snap.per_model["tiny_a"].stats.request_success > 0
        await ctl.stop()

    asyncio.run(main())


def test_a_dead_node_is_replaced_and_nothing_hangs() -> None:
    async def main() -> None:
        ctl, dep = await started(call_timeout_slo_factor=1.0, call_timeout_grace_ms=100)
        b = ctl.backend
        run = asyncio.create_task(ctl.run())
        dep.nodes["a"].hung = True  # its machine stalls: calls and pings never answer
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(NodeTimeout) as e:
            await b.infer("tiny_a", X)
        took = asyncio.get_running_loop().time() - t0
        assert "tried a (timeout)" in e.value.message and e.value.status_code == 504
        assert 0.5 <= took < 1.0  # the SLO (500 ms) + grace, not forever
        dep.nodes["a"].hung, dep.nodes["a"].dead = False, True  # now its actor is gone
        for _ in range(200):
            if serving(ctl)["b"] == ["mob", "tiny_a", "tiny_b"]:
                break
            await asyncio.sleep(0.02)
        assert serving(ctl) == {"a": [], "b": ["mob", "tiny_a", "tiny_b"]}
        assert b.nodes["a"].dead and dep.removed == ["a"]
        assert ctl.placement is not None and "a" not in ctl.placement.copies
        for m in ("tiny_a", "mob", "tiny_b"):
            assert (await b.infer(m, X))["output"].shape == (1, 3, 32, 32)
        events = [e["event"] for e in ctl.events]
        assert "node_dead" in events
        run.cancel()
        await ctl.stop()

    asyncio.run(main())


def test_while_no_node_serves_a_model_it_is_refused_with_retry_after_and_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        ctl, dep = await started()
        b = ctl.backend
        assert b.start_s is not None and b.start_s > 0  # the nodes' starts were timed
        b.start_s = 4.2  # as if a start took that long
        dep.nodes["a"].dead = True
        gone = asyncio.create_task(ctl.node_died("a", "its Ray node is gone"))
        await asyncio.sleep(0.01)  # a is out of the routing; b is starting mob and tiny_a
        assert b.holders("mob") == [] and not gone.done()
        refusals = []
        for _ in range(5):
            with pytest.raises(Unavailable) as e:
                b.check_admission("mob")  # before its body is read
            refusals.append(e.value)
        with pytest.raises(Unavailable) as e:
            await b.infer("mob", X)  # one that got past the check a moment before
        refusals.append(e.value)
        for err in refusals:
            assert err.status_code == 503 and err.rule == NO_NODE and err.refusal
            assert "no node serves it now (its node a went down: its Ray node is gone)" in (
                err.message)
            assert 4.0 < err.retry_after_s <= 4.2  # the last start's time, less the time since
            assert err.logged  # not once per request
        b.check_admission("tiny_b")  # b still serves it
        with caplog.at_level(logging.INFO, logger="dstack.cluster"):
            await gone
        assert (await b.infer("mob", X))["output"].shape == (1, 3, 32, 32)
        b.check_admission("mob")
        ended = [r.getMessage() for r in caplog.records if "served again" in r.getMessage()]
        assert len(ended) == 2, ended  # one line for each model, with what it cost
        mob = next(m for m in ended if m.startswith("model mob:"))
        assert "by b" in mob and "meanwhile 6 requests were refused (503 no_node)" in mob
        await b.refresh()
        assert b.stats("mob").request_failure == 6  # as the HTTP layer counts them
        assert b.stats("mob").request_success == 1
        await ctl.stop()

    asyncio.run(main())


def test_a_failed_call_is_retried_once_on_another_copy() -> None:
    async def main() -> None:
        ctl, dep = await started(replace_dead=False, dead_after=100)
        b = ctl.backend
        # two copies of tiny_a: on both nodes (as a placement with replicas would have it)
        for n in ("a", "b"):
            cfg = ctl.planner.node_config(ctl.specs[n], ctl.placement,  # type: ignore[arg-type]
                                          keep={"tiny_a": 1})
            await dep.nodes[n].configure(cfg.model_dump(mode="json"), None)  # type: ignore[union-attr]
            b.nodes[n].serving.add("tiny_a")
        dep.nodes["a"].dead = True
        b.nodes["b"].in_flight["tiny_a"] = 5  # a looks less loaded: tried first
        out = await b.infer("tiny_a", X)
        assert out["output"].shape == (1, 3, 32, 32)
        assert b.nodes["b"].answered.get("tiny_a") == 1
        assert "died" in b.nodes["a"].last_error
        # a model only on the dead node: 503 at once, naming it
        with pytest.raises(Unavailable) as e:
            await b.infer("mob", X)
        assert e.value.status_code == 503 and "tried a (failed: RuntimeError)" in e.value.message
        await ctl.stop()

    asyncio.run(main())


def test_a_node_outside_ray_names_no_ray_node_and_starts_no_ray() -> None:
    """A node run outside Ray (in a test, or a node process of its own) answers its health
    ping with '' and does not start a local Ray to ask (it did: ~10 s, and a Ray with its
    dashboard left running). In a fresh interpreter, as no other test's Ray may be up."""
    import subprocess
    import sys

    pytest.importorskip("ray")
    code = ("import asyncio, ray; from dstack.cluster.node import NodeServer; "
            "print(repr(asyncio.run(NodeServer('solo').ping())), ray.is_initialized())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.split() == ["''", "False"], out
