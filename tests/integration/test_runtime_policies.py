"""The runtime with real worker processes on CPU, for each of the four policies."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

import models
from dstack.common.config import parse_config
from dstack.common.errors import BackendError, DeadlineRefused
from dstack.common.types import Cell, DeviceInfo, Plan, Profile, Schedule
from dstack.policies.latency import LinearLatency
from dstack.runtime.serving import Runtime
from optimizer.packing import validate_schedule
from server.app import create_app

MODELS = ("tiny_a", "tiny_b")


def write_cpu_profiles(directory: Path, ms_per_item: float = 4.0) -> None:
    """Hand-made CPU profiles of tiny_cnn: slow enough that slots are tens of ms long."""
    for name in MODELS:
        cells = []
        for b in (1, 2, 4, 8):
            for pct, slow in ((50.0, 1.6), (100.0, 1.0)):
                ms = (10.0 + ms_per_item * b) * slow
                cells.append(Cell(b, pct, ms, ms * 1.1, pct, 1 if pct == 50 else 2))
        Profile(
            name,
            DeviceInfo("cpu", "test-cpu", 2, "cores"),
            "cpu-affinity",
            (1, 2, 4, 8),
            (50.0, 100.0),
            tuple(cells),
            knee={1: 50.0, 2: 50.0, 4: 50.0, 8: 100.0},
            provenance="hand-made for tests",
        ).save(directory / f"{name}.json")


def config(policy: str, profiles: Path, **over: object) -> dict:
    return {
        "policy": policy,
        "profiles": str(profiles),
        "profile_margin": None,  # hand-made profiles, planned with as they are
        "cores": [0, 1] if len(os.sched_getaffinity(0)) >= 2 else None,
        "adapt": {"enabled": False},
        "models": [
            {
                "name": n,
                "zoo_name": "tiny_cnn",
                "slo_ms": 1500,
                "max_batch_size": 8,
                "max_queue_delay_ms": 5,
                "rate_rps": 20,
                **over,
            }
            for n in MODELS
        ],
    }


def reference(x: np.ndarray) -> np.ndarray:
    torch.manual_seed(0)
    m = models.load_model("tiny_cnn")
    with torch.inference_mode():
        return m(torch.from_numpy(x)).numpy()


async def _serve(rt: Runtime, n_requests: int) -> list[dict[str, np.ndarray] | BaseException]:
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((1 + i % 2, 3, 32, 32), dtype=np.float32) for i in range(n_requests)]

    async def one(i: int) -> dict[str, np.ndarray]:
        await asyncio.sleep(0.04 * i)  # ~18 items/s per model: under the planned 24
        return await rt.infer(MODELS[i % 2], {"input": xs[i]})

    return await asyncio.gather(*(one(i) for i in range(n_requests)), return_exceptions=True)


@pytest.mark.parametrize("policy", ["shared", "temporal", "spatial", "dstack", "dstack-strict"])
def test_every_request_answered_under_each_policy(policy: str, tmp_path: Path) -> None:
    write_cpu_profiles(tmp_path)
    strict = policy == "dstack-strict"
    policy = policy.removesuffix("-strict")
    cfg = parse_config({**config(policy, tmp_path), "reuse_idle": not strict})

    async def main() -> None:
        rt = Runtime(cfg)
        await rt.start()
        try:
            assert rt.is_ready()
            results = await _serve(rt, 48)
            errors = [r for r in results if isinstance(r, BaseException)]
            assert not errors, _debug(errors, rt)
            for r in results:
                assert isinstance(r, dict) and r["output"].shape[1] == 10
            total = sum(rt.stats(m).inference_count for m in MODELS)
            assert total == sum(1 + i % 2 for i in range(48))
            if policy == "dstack":
                _check_batches_in_slots(rt, strict)
                await _check_plan_views(rt)
        finally:
            await rt.stop()

    asyncio.run(main())


def _debug(errors: list[BaseException], rt: Runtime) -> str:
    lines = [repr(e) for e in errors[:3]] + [repr(b) for b in list(rt.batch_log)[:40]]
    Path("/tmp/runtime_debug.txt").write_text("\n".join(lines))
    return "\n".join(lines[:10])


async def _check_plan_views(rt: Runtime) -> None:
    """/v1/plan and /v1/schedule return what the runtime follows, and it validates."""
    app = create_app(rt, max_body_bytes=1 << 20)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        plan = Plan.from_dict((await client.get("/v1/plan")).json())
        sched = Schedule.from_dict((await client.get("/v1/schedule")).json())
    assert {m.model for m in plan.models} == set(MODELS)
    assert sched == rt.schedule()
    assert validate_schedule(sched, MODELS) == []


def _check_batches_in_slots(rt: Runtime, strict: bool) -> None:
    """The lane plan's schedule validates, no batch is a reuse batch (lanes are
    work-conserving on their own slices), and each worker runs on its lane's cores."""
    sched = rt.schedule()
    assert sched is not None
    assert validate_schedule(sched, MODELS) == []
    assert rt.batch_log and not any(b.reuse for b in rt.batch_log)
    for m in MODELS:
        slot = next(s for s in sched.slots if s.model == m)
        pid = rt.supervisor.worker(m).pid  # type: ignore[union-attr]
        assert os.sched_getaffinity(pid) == set(slot.units)


def test_outputs_match_the_model_run_directly(tmp_path: Path) -> None:
    cfg = parse_config({"models": [{"name": "tiny_cnn", "slo_ms": 2000, "max_batch_size": 8}]})
    x = np.random.default_rng(1).standard_normal((3, 3, 32, 32), dtype=np.float32)

    async def main() -> np.ndarray:
        rt = Runtime(cfg)
        await rt.start()
        try:
            return (await rt.infer("tiny_cnn", {"input": x}))["output"]
        finally:
            await rt.stop()

    # the worker builds tiny_cnn with the same default init only if seeded the same way;
    # so compare through a weights file instead
    weights = tmp_path / "w.pt"
    torch.manual_seed(0)
    torch.save(models.load_model("tiny_cnn").state_dict(), weights)
    cfg = parse_config(
        {
            "models": [
                {"name": "tiny_cnn", "slo_ms": 2000, "max_batch_size": 8, "weights": str(weights)}
            ]
        }
    )
    out = asyncio.run(main())
    np.testing.assert_allclose(out, reference(x), atol=1e-4)


def test_a_request_that_cannot_meet_its_deadline_is_refused_not_served_late() -> None:
    cfg = parse_config(
        {
            "models": [
                {"name": "resnet18", "slo_ms": 30, "max_batch_size": 4, "max_queue_delay_ms": 1}
            ]
        }
    )
    x = np.zeros((4, 3, 224, 224), np.float32)

    async def main() -> None:
        rt = Runtime(cfg)
        await rt.start()
        try:
            results = await asyncio.gather(
                *(rt.infer("resnet18", {"input": x}) for _ in range(6)), return_exceptions=True
            )
            refused = [r for r in results if isinstance(r, DeadlineRefused)]
            assert refused, "resnet18 x4 on CPU cannot run in 30 ms, yet nothing was refused"
            assert "SLO" in refused[0].message
            assert rt.stats("resnet18").refused == len(refused)
        finally:
            await rt.stop()

    asyncio.run(main())


def test_a_dead_worker_fails_its_requests_at_once_and_is_restarted(tmp_path: Path) -> None:
    cfg = parse_config(
        {
            "models": [
                {"name": "a", "zoo_name": "tiny_cnn", "slo_ms": 20000, "max_batch_size": 8},
                {"name": "b", "zoo_name": "tiny_cnn", "slo_ms": 20000, "max_batch_size": 8},
            ]
        }
    )
    x = np.zeros((1, 3, 32, 32), np.float32)

    async def main() -> None:
        rt = Runtime(cfg)
        await rt.start()
        try:
            pid = rt.supervisor.worker("a").pid  # type: ignore[union-attr]
            os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(BackendError, match="died"):
                await rt.infer("a", {"input": x})
            assert time.monotonic() - t0 < 5  # failed at once, not after a time-out
            # the other model is untouched
            assert (await rt.infer("b", {"input": x}))["output"].shape == (1, 10)
            for _ in range(600):  # restarted (spawn + torch import takes a few seconds)
                if rt.is_model_ready("a"):
                    break
                await asyncio.sleep(0.1)
            assert rt.supervisor.worker("a").pid != pid  # type: ignore[union-attr]
            assert (await rt.infer("a", {"input": x}))["output"].shape == (1, 10)
        finally:
            await rt.stop()

    asyncio.run(main())


def test_a_replan_under_load_switches_workers_without_failing_a_request(tmp_path: Path) -> None:
    """Model a is planned for 5 rps and then gets ~110: the rate tracker notices, the plan
    is re-solved and handed over (shadow workers where a slice changes); no request fails
    and those sent after the switch are answered."""
    write_cpu_profiles(tmp_path, ms_per_item=10.0)
    cfg = config("dstack", tmp_path, slo_ms=3000, max_queue_delay_ms=5)
    cfg["models"][0]["rate_rps"] = 5
    cfg["models"][1]["rate_rps"] = 5
    # the switch's mechanics, not its timing: taken as soon as it predicts more
    cfg["adapt"] = {"enabled": True, "sample_s": 0.25, "ewma_alpha": 0.6, "drift": 0.5,
                    "hold_s": 0.5, "weigh_switch": False}
    cfg = parse_config(cfg)
    x = np.zeros((1, 3, 32, 32), np.float32)

    async def main() -> None:
        rt = Runtime(cfg)
        placed: list[tuple[int, ...]] = []  # where `dstack serve` keeps its own process
        rt.on_plan = placed.append
        await rt.start()
        try:
            assert placed == [rt.quiet_cores()]
            slice_before = rt.current_slice("tiny_a")
            batch_before = rt.plan().for_model("tiny_a").batch  # type: ignore[union-attr]
            tasks = []
            t_end = time.monotonic() + 120  # a bound: it ends once re-planned and switched
            while time.monotonic() < t_end and (rt.replans == 0 or len(tasks) < 600):
                tasks.append(asyncio.create_task(rt.infer("tiny_a", {"input": x})))
                if len(tasks) % 20 == 0:
                    tasks.append(asyncio.create_task(rt.infer("tiny_b", {"input": x})))
                await asyncio.sleep(1 / 110)
            results = await asyncio.gather(*tasks, return_exceptions=True)
            # Admission may refuse what it predicts late (a busy or slow machine makes the
            # batches slow); nothing may fail, and requests are answered after the switch.
            failed = [r for r in results
                      if isinstance(r, BaseException) and not isinstance(r, DeadlineRefused)]
            assert rt.replans >= 1, "the rate rose 20x and nothing was re-planned"
            assert not failed, failed[:3]
            assert any(isinstance(r, dict) for r in results[-100:])
            # At 5 rps each the plan gives each model a core of its own (spatial's lanes);
            # at ~110 rps tiny_a needs more: the re-plan changes its slice or its batch, the
            # worker runs the new plan's slice, and the switch failed nothing (above).
            after = rt.plan().for_model("tiny_a")  # type: ignore[union-attr]
            now_slice = rt.current_slice("tiny_a")
            assert now_slice != slice_before or after.batch > batch_before
            assert now_slice is not None and now_slice.percent == after.percent
            # and the server's process is told where the new plan's workers leave it room
            assert len(placed) >= 1 + rt.replans and placed[-1] == rt.quiet_cores()
        finally:
            await rt.stop()

    asyncio.run(main())


def alive(pid: int) -> bool:
    """A process, not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone, or reaped while being read
        return False


def test_a_replan_is_solved_in_a_process_of_its_own_that_is_replaced_if_it_dies(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The solve's Python must not take turns at the GIL with the event loop: it runs in a
    child process started with the server. Killed, it is replaced, and that re-plan is
    solved and handed over all the same; the server's stop ends it."""
    write_cpu_profiles(tmp_path, ms_per_item=10.0)
    cfg = config("dstack", tmp_path, slo_ms=3000)
    cfg["models"][0]["rate_rps"] = 5
    cfg["models"][1]["rate_rps"] = 5
    # Each model on its own lane only: no guest workers on the other's (`borrow_lanes`),
    # half the workers to start, here and at the hand-over; the solver's process is what
    # this test is about.
    cfg["borrow_lanes"] = 0
    # re-planned below, not by the sampler; in a process (`auto` would be a thread on CPU)
    cfg["adapt"] = {"enabled": True, "sample_s": 60, "solve_in": "process",
                    "weigh_switch": False}
    cfg = parse_config(cfg)

    async def main() -> int:
        rt = Runtime(cfg)
        await rt.start()
        try:
            rep = rt.replanner
            assert rep is not None and rep.solver is not None
            pid = rep.solver.pid
            assert pid is not None and pid != os.getpid() and alive(pid)
            assert f"PPid:\t{os.getpid()}\n" in Path(f"/proc/{pid}/status").read_text()
            os.kill(pid, signal.SIGKILL)
            while alive(pid):
                await asyncio.sleep(0.01)
            # ~110 rps for tiny_a against the 5 planned: a new plan, taken and handed over
            assert await rep.replan({"tiny_a": 110.0, "tiny_b": 5.0})
            again = rep.solver.pid
            assert again is not None and again != pid and alive(again)
            return again
        finally:
            await rt.stop()

    with caplog.at_level(logging.WARNING, logger="dstack.runtime.replanner"):
        pid = asyncio.run(main())
    assert not alive(pid), "the server stopped and left its solver process running"
    died = [r.getMessage() for r in caplog.records if "solver process" in r.getMessage()]
    assert len(died) == 1 and "died" in died[0], died


def test_a_server_process_that_cannot_be_moved_keeps_serving(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`dstack serve` moves its process to each plan's `quiet_cores`; a move the kernel
    refuses (a core taken offline since start-up) is logged, and serving goes on."""
    write_cpu_profiles(tmp_path)
    cfg = parse_config(config("spatial", tmp_path))
    x = np.zeros((1, 3, 32, 32), np.float32)

    def refuse(cores: tuple[int, ...]) -> None:
        raise OSError(22, "Invalid argument")

    async def main() -> None:
        rt = Runtime(cfg)
        rt.on_plan = refuse
        await rt.start()
        try:
            assert (await rt.infer("tiny_a", {"input": x}))["output"].shape == (1, 10)
        finally:
            await rt.stop()

    asyncio.run(main())
    assert "could not move the server's process" in caplog.text


def test_a_too_slow_latency_estimate_cannot_lock_a_model_out() -> None:
    """An estimate that says every request is hopeless (a warm-up on a busy machine, say)
    refuses at first, but an idle model lets a probe through and the estimate corrects."""
    cfg = parse_config({"models": [{"name": "tiny_cnn", "slo_ms": 200, "max_batch_size": 8,
                                    "max_queue_delay_ms": 1}]})
    x = np.zeros((1, 3, 32, 32), np.float32)

    async def main() -> None:
        rt = Runtime(cfg)
        await rt.start()
        try:
            rt.core.set_estimate("tiny_cnn", LinearLatency(0.5, 0.0, observations=10))  # 500 ms
            with pytest.raises(DeadlineRefused, match="about 500.0 ms per batch"):
                await rt.infer("tiny_cnn", {"input": x})
            await asyncio.sleep(1.1)  # idle for longer than max(1 s, SLO): probe
            assert (await rt.infer("tiny_cnn", {"input": x}))["output"].shape == (1, 10)
            assert rt.core.estimates["tiny_cnn"].estimate_s(1) < 0.2
            for _ in range(3):
                await rt.infer("tiny_cnn", {"input": x})
        finally:
            await rt.stop()

    asyncio.run(main())

