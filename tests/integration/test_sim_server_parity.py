"""The simulator and the server make the same decisions on the same arrival trace.

One seeded Poisson trace is fed (a) to the simulator's event loop
(`dstack.simulate.engine.run`) and (b) to the asyncio `Runtime`, on an event loop whose
clock is virtual, with fake workers that take exactly the simulator's latency L(n) for
every batch. Every decision of the dispatch core in each (launches: when, which model,
which requests; refusals: when, which request, which rule) is logged; the logs must be
the same. The slices do not oversubscribe the device (the simulator would share it by
processor sharing, the fake workers do not).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import selectors
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

from dstack.common.config import DeployConfig, parse_config
from dstack.common.errors import DStackError
from dstack.common.slices import CpuSlices, SliceSpec
from dstack.common.types import Cell, DeviceInfo, ModelSpec, Profile
from dstack.policies.planning import served_profiles, setup_policy
from dstack.policies.replicas import public_name
from dstack.runtime.dispatch import DispatchCore, Refusal, Step, Ticket
from dstack.runtime.messages import BatchDone, Ready
from dstack.runtime.serving import Runtime
from dstack.runtime.shm import NUMPY_DTYPE
from dstack.runtime.specs import served_spec
from dstack.simulate.engine import SimModel, run
from dstack.simulate.latency import latency_table_s
from dstack.simulate.workload import generate

MODELS = ("tiny_a", "tiny_b")
DURATION_S = 2.0
RATE_RPS = 120.0  # per model: over what one core serves within the SLO, so queues refuse
BACKEND = CpuSlices(cores=(0, 1))

# ------------------------------------------------------------------ virtual time


class _JumpingSelector(selectors.DefaultSelector):
    """A real selector (the self-pipe still wakes the loop for `to_thread`) that never
    sleeps on a timer: with nothing ready it moves the loop's clock to the next timer."""

    #: Loop iterations at one instant before the loop is taken to spin (a driver that
    #: re-steps at the same time forever would hang the test instead of failing it).
    STALL_AFTER = 100_000

    def __init__(self, loop: VirtualTimeLoop) -> None:
        super().__init__()
        self._loop = loop
        self._same_instant = 0

    def select(self, timeout: float | None = None) -> list:  # type: ignore[override]
        ready = super().select(None if timeout is None else 0)
        if not ready and timeout is not None and timeout > 0:
            # asyncio computed timeout = next_timer.when - now; jump to that `when`
            # exactly (now + timeout may be an ulp off it).
            sched = self._loop._scheduled  # type: ignore[attr-defined]
            target = sched[0].when() if sched else self._loop.now + timeout
            self._loop.now = max(self._loop.now, target)
            self._same_instant = 0
        else:
            self._same_instant += 1
            if self._same_instant > self.STALL_AFTER:
                raise RuntimeError(f"virtual time is stuck at {self._loop.now!r} s")
        return ready


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on a virtual clock from 0: `sleep`, `call_later` and `timeout` take
    no real time, and everything due at one instant runs at exactly that instant."""

    def __init__(self) -> None:
        self.now = 0.0
        super().__init__(_JumpingSelector(self))

    def time(self) -> float:
        return self.now


# ------------------------------------------------------------------ fake workers


class _FakeArena:
    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec

    def inputs(self, n: int) -> dict[str, np.ndarray]:
        return {t.name: np.empty((n, *t.shape[1:]), NUMPY_DTYPE[t.datatype])
                for t in self.spec.inputs}

    def outputs(self, n: int) -> dict[str, np.ndarray]:
        return {t.name: np.zeros((n, *t.shape[1:]), NUMPY_DTYPE[t.datatype])
                for t in self.spec.outputs}


class FakeWorker:
    """Runs a batch of n in exactly `table[n]` seconds of loop time, as the simulator's
    worker does; its compute time is end - start, as the simulator measures it."""

    def __init__(self, spec: ModelSpec, table: list[float], pid: int) -> None:
        self.arena = _FakeArena(spec)
        self.table = table
        self.pid = pid
        self._ids = itertools.count()

    def submit(self, n: int) -> asyncio.Future[BatchDone]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[BatchDone] = loop.create_future()
        start = loop.time()
        end = start + self.table[n]
        loop.call_at(end, fut.set_result, BatchDone(next(self._ids), n, start, end - start))
        return fut


class FakeSupervisor:
    """The `WorkerPool` of the runtime: one always-ready fake worker per model."""

    def __init__(self, cfg: DeployConfig, specs: Mapping[str, ModelSpec],
                 profiles: Mapping[str, Profile]) -> None:
        self.cfg, self.specs, self.profiles = cfg, specs, profiles
        self.workers: dict[str, FakeWorker] = {}
        self.slices: dict[str, SliceSpec] = {}

    async def start_all(self, slices: Mapping[str, SliceSpec], *,
                        passive: frozenset[str] = frozenset()) -> dict[str, Ready]:
        out = {}
        cfgs = {m.name: m for m in self.cfg.models}
        for i, name in enumerate(slices):  # a model's replicas too
            m = cfgs[public_name(name)]
            table = latency_table_s(self.profiles[m.name], slices[name].percent,
                                    m.max_batch_size)
            self.workers[name] = FakeWorker(self.specs[m.name], table, 1000 + i)
            self.slices[name] = slices[name]
            out[name] = Ready(1000 + i, table[1] * 1000, table[-1] * 1000, m.max_batch_size)
        return out

    def blocked(self) -> frozenset[str]:
        return frozenset()

    def worker(self, model: str) -> FakeWorker:
        return self.workers[model]

    def is_ready(self, model: str) -> bool:
        return model in self.workers

    def accepting(self, model: str) -> bool:
        return model in self.workers

    def current_slice(self, model: str) -> SliceSpec | None:
        return self.slices.get(model)

    async def stop_all(self) -> None:
        return None

    async def start_shadows(self, slices: Mapping[str, SliceSpec], *,
                            passive: frozenset[str] = frozenset()) -> dict[str, FakeWorker]:
        raise AssertionError("adapt is off: no re-plan")

    async def switch(self, shadows: object, running: object) -> None:
        raise AssertionError("adapt is off: no re-plan")


# ------------------------------------------------------------------ set-up


def write_profiles(directory: Path) -> None:
    """Hand-made 2-core CPU profiles: L(b) = (8 + 3b) ms on both cores, 1.7x on one;
    the second model a little slower."""
    for k, name in enumerate(MODELS):
        cells = []
        for b in (1, 2, 4, 8):
            for pct, slow in ((50.0, 1.7), (100.0, 1.0)):
                ms = (8.0 + 3.0 * b) * slow * (1 + 0.25 * k)
                cells.append(Cell(b, pct, ms, ms * 1.1, pct, 1 if pct == 50 else 2))
        Profile(name, DeviceInfo("cpu", "test-cpu", 2, "cores"), "cpu-affinity",
                (1, 2, 4, 8), (50.0, 100.0), tuple(cells),
                knee={1: 50.0, 2: 50.0, 4: 50.0, 8: 100.0},
                provenance="hand-made for tests").save(directory / f"{name}.json")


def make_config(policy: str, profiles: Path) -> DeployConfig:
    return parse_config({
        "policy": policy,
        "profiles": str(profiles),
        "cores": [0, 1],
        "adapt": {"enabled": False},
        "models": [{"name": n, "zoo_name": "tiny_cnn", "slo_ms": 80, "max_batch_size": 8,
                    "max_queue_delay_ms": 5, "max_queue": 6, "rate_rps": RATE_RPS}
                   for n in MODELS],
    })


#: ("launch", t, model, n, arrival of each request) or ("refuse", t, model, rule, arrival)
Entry = tuple[object, ...]


def record_decisions(monkeypatch: pytest.MonkeyPatch, log: list[Entry]) -> None:
    """Log every decision of every `DispatchCore`: refusals at admission and at each
    step, and launches."""
    admit, step = DispatchCore.admit, DispatchCore.step

    def refused(core: DispatchCore, now: float, r: Refusal) -> None:
        log.append(("refuse", now, core.names[r.ticket.model], r.reason.value,
                    r.ticket.arrival))

    def rec_admit(self: DispatchCore, model: str, n: int, now: float,
                  payload: object = None, since_s: float = 0.0) -> Ticket | Refusal:
        got = admit(self, model, n, now, payload, since_s)
        if isinstance(got, Refusal):
            refused(self, now, got)
        return got

    def rec_step(self: DispatchCore, now: float, **kw: object) -> Step:
        s = step(self, now, **kw)
        assert not s.failures, s.failures[0].message
        for r in s.refusals:
            refused(self, now, r)
        for b in s.launches:
            log.append(("launch", now, b.model, b.n, tuple(t.arrival for t in b.tickets)))
        return s

    monkeypatch.setattr(DispatchCore, "admit", rec_admit)
    monkeypatch.setattr(DispatchCore, "step", rec_step)


def simulate(cfg: DeployConfig, times: list[float], idx: list[int]) -> None:
    profiles = served_profiles(cfg)
    setup = setup_policy(cfg, BACKEND, origin=0.0, profiles=profiles)
    slices = setup.policy.slices()
    models = [SimModel(m.name, m.slo_ms / 1000, m.max_batch_size, m.max_queue,
                       slices[m.name].percent,
                       latency_table_s(setup.profiles[m.name], slices[m.name].percent,
                                       m.max_batch_size))
              for m in setup.run_cfg.models]
    # no processor sharing to model (a guest worker runs only while its lane is idle)
    assert sum(m.percent for m in models if m.name not in setup.guests) <= 100.0
    run(setup.policy, models, times, idx, DURATION_S, estimates=setup.estimates,
        served=[m.name for m in cfg.models], groups=setup.groups())


def serve(cfg: DeployConfig, times: list[float], idx: list[int]) -> list[object]:
    """The runtime on a virtual-time loop with fake workers; each request is sent at
    its arrival time. Returns every request's outcome."""

    async def main() -> list[object]:
        loop = asyncio.get_running_loop()
        specs = {m.name: served_spec(m) for m in cfg.models}
        rt = Runtime(cfg, slices=BACKEND, clock=loop.time,
                     supervisor=FakeSupervisor(cfg, specs, served_profiles(cfg)))
        await rt.start()
        assert loop.time() == 0.0  # start took no virtual time: the cycle starts at 0
        x = np.zeros((1, 3, 32, 32), np.float32)
        tasks: list[asyncio.Task[object]] = []
        for t, j in zip(times, idx, strict=True):
            loop.call_at(t, lambda m=MODELS[j]: tasks.append(
                asyncio.ensure_future(rt.infer(m, {"input": x}))))
        try:
            await asyncio.sleep(DURATION_S)  # every request has been sent by then
            return await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await rt.stop()

    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


def _same(a: Entry, b: Entry) -> bool:
    if a[0] != b[0] or a[2:4] != b[2:4] or not math.isclose(a[1], b[1], abs_tol=1e-9,
                                                            rel_tol=0.0):
        return False
    xs = a[4] if a[0] == "launch" else (a[4],)
    ys = b[4] if b[0] == "launch" else (b[4],)
    return len(xs) == len(ys) and all(abs(u - v) <= 1e-9 for u, v in zip(xs, ys, strict=True))


@pytest.mark.parametrize("policy", ["spatial", "dstack"])
def test_simulator_and_server_decide_alike(policy: str, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    write_profiles(tmp_path)
    cfg = make_config(policy, tmp_path)
    arrivals = generate("poisson", dict.fromkeys(MODELS, RATE_RPS), DURATION_S, seed=7)
    assert arrivals.names == MODELS
    times, idx = arrivals.times.tolist(), arrivals.models.tolist()
    sim_log: list[Entry] = []
    srv_log: list[Entry] = []

    record_decisions(monkeypatch, sim_log)
    simulate(cfg, times, idx)
    monkeypatch.undo()
    record_decisions(monkeypatch, srv_log)
    outcomes = serve(cfg, times, idx)

    # The trace exercises the rules: batches of several, and refusals.
    launches = [e for e in sim_log if e[0] == "launch"]
    refusals = [e for e in sim_log if e[0] == "refuse"]
    assert max(e[3] for e in launches) > 1
    assert {e[3] for e in refusals} == {"queue_full", "work_ahead", "expired"}
    # The server answered every request: served by a launch, or refused naming a rule.
    assert len(outcomes) == len(times)
    n_refused = sum(isinstance(o, DStackError) and o.status_code == 429 for o in outcomes)
    assert n_refused == sum(e[0] == "refuse" for e in srv_log)
    assert not [o for o in outcomes
                if isinstance(o, BaseException) and not isinstance(o, DStackError)]

    for k, (a, b) in enumerate(zip(sim_log, srv_log, strict=False)):
        assert _same(a, b), (f"decision {k} differs:\n  simulator {a}\n  server    {b}\n"
                             f"before it: {sim_log[max(0, k - 3):k]}")
    assert len(sim_log) == len(srv_log)
