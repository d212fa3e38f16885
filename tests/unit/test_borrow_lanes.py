"""Bursts borrow idle lanes: each model of a `dstack` plan has guest workers on other
lanes' slices, which run its queued work while their lane has nothing of its own."""

from __future__ import annotations

from pathlib import Path

from dstack.common.config import DeployConfig, PolicyName, parse_config
from dstack.common.slices import MpsSlices
from dstack.policies.contract import QueueView
from dstack.policies.lane_policy import LanePlan, LanePolicy
from dstack.policies.planning import served_profiles, setup_policy
from dstack.runtime.dispatch import CoreModel, DispatchCore, Ticket
from dstack.simulate import generate, simulate

ROOT = Path(__file__).resolve().parents[2]
MODELS = [{"name": "resnet50", "slo_ms": 50, "max_batch_size": 16, "rate_rps": 150},
          {"name": "alexnet", "slo_ms": 20, "max_batch_size": 16, "rate_rps": 300}]


def cfg(borrow: int = 2) -> DeployConfig:
    return parse_config({"device": "cuda", "policy": "dstack", "borrow_lanes": borrow,
                         "profiles": str(ROOT / "profiles" / "reference-v100"),
                         "models": MODELS})


def setup_for(c: DeployConfig):  # noqa: ANN201
    return setup_policy(c, MpsSlices(80), origin=0.0,
                        profiles=served_profiles(c, check_device=False))


def test_each_model_gets_a_guest_worker_on_the_other_lane() -> None:
    s = setup_for(cfg())
    assert isinstance(s.plan, LanePlan) and len(s.plan.lanes) == 2
    assert s.guests == {"resnet50#g1": "resnet50", "alexnet#g1": "alexnet"}
    assert {m.name for m in s.run_cfg.models} == {"resnet50", "alexnet", *s.guests}
    slices = s.policy.slices()
    for g, h in s.guests.items():  # on the lane that is not its host's: it waits for that
        other = next(lane for lane in s.plan.lanes if h not in lane.models)  # lane's work
        assert {m for m, _ in s.policy.lane_mates(g)} == set(other.models)
        assert slices[g].percent == other.percent
        assert s.estimates[g] is not None
    assert s.groups() == {"resnet50": ("resnet50", "resnet50#g1"),
                          "alexnet": ("alexnet", "alexnet#g1")}
    off = setup_for(cfg(borrow=0))
    assert off.guests == {} and off.groups() == {}


def _view(name: str, items: int, running: bool, deadline: float = 1.0) -> QueueView:
    return QueueView(name, items, 0.0 if items else None, deadline if items else None,
                     running, items)


def test_an_idle_lane_runs_the_backlog_of_a_busy_model_and_never_its_own_turn() -> None:
    s = setup_for(cfg())
    pol = s.policy
    assert isinstance(pol, LanePolicy)
    quiet = {n: _view(n, 0, False) for n in ("resnet50", "alexnet", *s.guests)}
    # alexnet's own worker is busy with a backlog; resnet50's lane is idle: it borrows
    burst = {**quiet, "alexnet": _view("alexnet", 40, True)}
    got = pol.decide(0.0, burst).launches
    assert [(x.model, x.on) for x in got] == [("alexnet", "alexnet#g1")]
    assert 0 < got[0].max_items <= pol.batch_cap("alexnet#g1")
    # the lane's own model has work: it goes, no guest
    own = {**burst, "resnet50": _view("resnet50", 3, False)}
    assert [(x.model, x.on) for x in pol.decide(0.0, own).launches] == [("resnet50", None)]
    # a model whose own worker is idle and takes its whole queue borrows nothing
    small = {**quiet, "alexnet": _view("alexnet", 2, False)}
    assert [(x.model, x.on) for x in pol.decide(0.0, small).launches] == [("alexnet", None)]
    # while a guest batch runs, its lane's own model waits for it (lane mates)
    busy = {**quiet, "alexnet#g1": _view("alexnet#g1", 0, True),
            "resnet50": _view("resnet50", 3, False)}
    assert pol.decide(0.0, busy).launches == ()


def test_the_core_runs_a_guest_batch_from_its_hosts_queue_and_counts_it_for_the_host(
        ) -> None:
    s = setup_for(cfg())
    core = DispatchCore([CoreModel(m.name, m.slo_ms / 1000, m.max_batch_size, m.max_queue)
                         for m in s.run_cfg.models], s.policy, s.estimates, now=0.0,
                        groups=s.groups())
    for _ in range(40):
        assert isinstance(core.admit("alexnet", 1, 0.0), Ticket)
    assert core.queue_items("alexnet#g1") == 0  # a guest never gets a queue of its own
    # its own worker takes a batch; the idle lane's guest takes from what is left
    own, guest = core.step(0.0).launches
    assert (own.model, guest.model) == ("alexnet", "alexnet#g1")
    n = own.n + guest.n
    assert own.n == s.policy.batch_cap("alexnet") and 0 < guest.n
    assert core.queue_items("alexnet") == 40 - n
    assert core.step(0.0001).launches == ()  # both busy
    core.complete(own, 0.002, 0.003)
    core.complete(guest, 0.002, 0.003)
    c = core.counters("alexnet")
    assert c.served == n and c.batches == 2 and c.arrived == 40


def test_a_burst_on_one_model_is_served_by_the_idle_lane() -> None:
    burst = "burst:x6@2s+4s:alexnet"  # alexnet at 6x for 4 s; resnet50's lane mostly idle
    got = {}
    for borrow in (0, 2):
        c = cfg(borrow)
        arr = generate(burst, {m["name"]: m["rate_rps"] for m in MODELS}, 8.0, 1)
        sim = simulate(c, served_profiles(c, check_device=False), arr, [PolicyName.DSTACK], 8.0)
        r = sim.reports[0]
        assert r.goodput_rps <= sim.ideal_rps * (1 + 1e-9)
        got[borrow] = (r.goodput_rps, r.refused)
    assert got[2][0] > got[0][0]
    assert got[2][1] * 2 < got[0][1]  # refusals at least halved
