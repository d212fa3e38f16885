"""Where the server's own process goes beside its workers (`quiet_cores`)."""

from __future__ import annotations

from dstack.common.slices import SliceSpec, quiet_cores

HOST = (0, 1, 2, 3)


def test_the_server_takes_the_cores_no_worker_uses() -> None:
    slices = {"mobilenet": SliceSpec(25.0, (0,)), "resnet": SliceSpec(50.0, (1, 2))}
    assert quiet_cores(slices, {"mobilenet": 0.06, "resnet": 0.25}, HOST) == (3,)


def test_with_every_core_taken_it_shares_those_of_the_longest_slo() -> None:
    # the 60 ms model's batch would run late for every ms the server takes; the 250 ms
    # model's would not
    slices = {"mobilenet": SliceSpec(50.0, (0, 1)), "resnet": SliceSpec(50.0, (2, 3))}
    assert quiet_cores(slices, {"mobilenet": 0.06, "resnet": 0.25}, HOST) == (2, 3)
    # a core two slices share counts with the tighter of the two
    slices = {"mobilenet": SliceSpec(50.0, (0, 1)), "resnet": SliceSpec(75.0, (1, 2, 3)),
              "vit": SliceSpec(25.0, (3,))}
    slos = {"mobilenet": 0.06, "resnet": 0.25, "vit": 0.1}
    assert quiet_cores(slices, slos, HOST) == (2,)


def test_slices_of_equal_slos_or_of_no_cores_leave_it_everywhere() -> None:
    halves = {"a": SliceSpec(50.0, (0, 1)), "b": SliceSpec(50.0, (2, 3))}
    assert quiet_cores(halves, {"a": 0.1, "b": 0.1}, HOST) == HOST
    gpu = {"a": SliceSpec(40.0), "b": SliceSpec(60.0)}  # MPS percentages: no cores
    assert quiet_cores(gpu, {"a": 0.06, "b": 0.25}, HOST) == HOST
