"""Which CPU workers wait for work asleep (OMP_WAIT_POLICY=PASSIVE)."""

from __future__ import annotations

from dstack.common.config import PolicyName
from dstack.common.slices import CpuSlices, SliceSpec
from dstack.policies.contract import ModelParams
from dstack.policies.registry import make_policy
from dstack.runtime.supervisor import passive_models


def test_workers_sharing_cores_with_a_concurrent_model_wait_asleep() -> None:
    both = SliceSpec(100.0, (0, 1))
    assert passive_models({"a": both, "b": both}, concurrent=True) == {"a", "b"}
    # one batch at a time (temporal): nobody computes beside them, spinning is cheaper
    assert passive_models({"a": both, "b": both}, concurrent=False) == frozenset()
    # disjoint cores (spatial, dstack lanes): nothing to give way to
    assert passive_models({"a": SliceSpec(50.0, (0,)), "b": SliceSpec(50.0, (1,))},
                          concurrent=True) == frozenset()
    # more models than cores: the ones that wrap around share
    three = {"a": SliceSpec(50.0, (0,)), "b": SliceSpec(50.0, (1,)), "c": SliceSpec(50.0, (0,))}
    assert passive_models(three, concurrent=True) == {"a", "c"}


def test_each_policy_says_whether_its_models_run_at_the_same_time() -> None:
    params = {m: ModelParams(m, 4, 0.0, 0.1) for m in ("a", "b")}
    backend = CpuSlices((0, 1))
    assert make_policy(PolicyName.SHARED, params, backend).concurrent
    assert make_policy(PolicyName.SPATIAL, params, backend).concurrent
    assert not make_policy(PolicyName.TEMPORAL, params, backend).concurrent


def test_guest_workers_make_nobody_wait_asleep_and_warm_up_after_their_lane() -> None:
    from dstack.runtime.supervisor import _waves

    lanes = {"a": SliceSpec(50.0, (0,)), "b": SliceSpec(50.0, (1,)),
             "a#g1": SliceSpec(50.0, (1,)), "b#g1": SliceSpec(50.0, (0,))}
    guests = {"a#g1": "a", "b#g1": "b"}
    # a guest runs only while its lane is idle: no worker computes beside another
    assert passive_models(lanes, concurrent=True, guests=guests) == frozenset()
    assert passive_models(lanes, concurrent=True) == set(lanes)  # counted as concurrent
    # warm-ups on the same cores would time each other: the guests start in a second wave
    names = list(lanes)
    assert [[names[i] for i in w] for w in _waves(names, lanes)] == [["a", "b"],
                                                                     ["a#g1", "b#g1"]]
    gpu = {n: SliceSpec(50.0, ()) for n in lanes}  # no cores named: all at once
    assert _waves(names, gpu) == [[0, 1, 2, 3]]
