"""The limit of request bodies read at once (`dstack.runtime.reading.ReadLimit`): it stays
at its ceiling while bodies come in their usual time, falls to its floor while they come
slower than that, and climbs back when they are quick again; one slow body moves it a
little only; bodies slower for good (a slower client network) become the usual time."""

from __future__ import annotations

from dstack.runtime.reading import FLOOR, ReadLimit


def test_slow_bodies_bring_the_limit_down_and_quick_ones_back_up() -> None:
    lim = ReadLimit(64)
    for _ in range(500):
        lim.observe("m", 0.001)
    assert lim.limit == 64
    for _ in range(60):  # ten times slower: the reader is reading too much at once
        lim.observe("m", 0.01)
    assert lim.limit == FLOOR
    for _ in range(40):
        lim.observe("m", 0.001)
    assert FLOOR < lim.limit < 64
    for _ in range(5000):
        lim.observe("m", 0.001)
    assert lim.limit == 64


def test_one_slow_body_moves_the_limit_by_a_tenth() -> None:
    lim = ReadLimit(40)
    for _ in range(100):
        lim.observe("m", 0.002)
    lim.observe("m", 0.5)
    assert lim.limit == 36


def test_each_model_has_its_own_usual_time() -> None:
    """Big bodies of one model take longer than small ones of another without being slow."""
    lim = ReadLimit(16)
    for _ in range(200):
        lim.observe("small", 0.0005)
        lim.observe("big", 0.02)
    assert lim.limit == 16


def test_bodies_slower_for_good_become_the_usual_time() -> None:
    lim = ReadLimit(32)
    for _ in range(100):
        lim.observe("m", 0.001)
    for _ in range(3000):
        lim.observe("m", 0.01)
    assert lim.limit == 32


def test_each_reader_reads_its_share() -> None:
    lim = ReadLimit(8, readers=4)
    assert lim.limit == 32
    for _ in range(100):
        lim.observe("m", 0.001)
    for _ in range(100):
        lim.observe("m", 0.05)
    assert lim.limit == FLOOR * 4
    assert ReadLimit(1).limit == 1  # a ceiling under the floor is the floor
