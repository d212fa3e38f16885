"""The limit of request bodies read at once (`dstack.runtime.reading.ReadLimit`): it stays
at its ceiling while bodies come in their usual time, falls to its floor while they come
slower than that, and climbs back when they are quick again; one slow body moves it a
little only; bodies slower for good (a slower client network) become the usual time."""

from __future__ import annotations

from dstack.runtime.reading import FLOOR, ReadLimit


def fed(lim: ReadLimit, *runs: tuple[float, int], model: str = "m") -> int:
    """`lim`'s limit after each (seconds, count) run of bodies of `model`."""
    for seconds, n in runs:
        for _ in range(n):
            lim.observe(model, seconds)
    return lim.limit


def test_slow_bodies_bring_the_limit_down_and_quick_ones_back_up() -> None:
    lim = ReadLimit(64)
    assert fed(lim, (0.001, 500)) == 64
    assert fed(lim, (0.01, 60)) == FLOOR  # ten times slower: reading too much at once
    assert FLOOR < fed(lim, (0.001, 40)) < 64
    assert fed(lim, (0.001, 5000)) == 64


def test_one_slow_body_moves_the_limit_by_a_tenth() -> None:
    assert fed(ReadLimit(40), (0.002, 100), (0.5, 1)) == 36


def test_each_model_has_its_own_usual_time() -> None:
    """Big bodies of one model take longer than small ones of another without being slow."""
    lim = ReadLimit(16)
    for _ in range(200):
        fed(lim, (0.0005, 1), model="small")
        fed(lim, (0.02, 1), model="big")
    assert lim.limit == 16


def test_bodies_slower_for_good_become_the_usual_time() -> None:
    assert fed(ReadLimit(32), (0.001, 100), (0.01, 3000)) == 32


def test_each_reader_reads_its_share() -> None:
    lim = ReadLimit(8, readers=4)
    assert lim.limit == 32
    assert fed(lim, (0.001, 100), (0.05, 100)) == FLOOR * 4
    assert ReadLimit(1).limit == 1  # a ceiling under the floor is the floor


def test_a_model_is_held_to_the_limit_while_its_slo_is_short_or_its_requests_are_refused() -> None:
    lim = ReadLimit(8)
    assert not lim.holds("m", 1.0, 0.002)  # a 1 s SLO, slow bodies of 2 ms: 500 times
    assert lim.holds("m", 0.05, 0.002)  # 50 ms: 25 times
    for _ in range(6):
        lim.decided("m", True)
    assert lim.holds("m", 1.0, 0.002)
    assert not lim.holds("other", 1.0, 0.002)
    for _ in range(10):
        lim.decided("m", False)
    assert not lim.holds("m", 1.0, 0.002)
