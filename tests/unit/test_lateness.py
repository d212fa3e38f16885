"""`dstack.common.pauses.Lateness`: a periodic timer's lateness counted tick by tick, as the
server's /metrics (`dstack_event_loop_late_seconds`) reports it."""

from __future__ import annotations

from dstack.common.pauses import LATE_BOUNDS_S, Lateness


def _late(*seconds: float) -> Lateness:
    out = Lateness()
    for s in seconds:
        out.add(s)
    return out


def test_ticks_are_counted_under_the_first_bound_they_do_not_pass() -> None:
    late = _late(0.0, 0.001, 0.0011, 0.006, 0.03, 2.0)
    assert late.counts[0] == 2  # on time, and exactly 1 ms (a Prometheus `le` bucket)
    assert late.counts[LATE_BOUNDS_S.index(0.002)] == 1
    assert late.counts[-1] == 1  # over the last bound
    assert late.count == 6
    assert (late.over(0.005), late.over(0.01), late.over(0.02)) == (3, 2, 2)
    assert abs(late.sum_s - 2.0381) < 1e-9


def test_a_window_is_the_counts_after_less_the_counts_before() -> None:
    before = _late(0.0, 0.012)
    after = _late(0.0, 0.012)
    after.merge(_late(0.0, 0.0, 0.04))
    window = after.since(before)
    assert window.count == 3
    assert window.over(0.02) == 1
    assert window.summary() == "late > 5 / 10 / 20 ms: 1 / 1 / 1 of 3 ticks, worst <= 50 ms"
    assert _late().summary() == "no ticks"
    assert _late(5.0).summary().endswith("worst > 1000 ms")


def test_a_quantile_is_bounded_by_the_bucket_it_falls_in() -> None:
    hundred = _late(*([0.0005] * 97 + [0.003, 0.03, 0.3]))
    assert hundred.quantile_s(0.5) == 0.001
    assert hundred.quantile_s(0.98) == 0.005  # the 98th of 100: 3 ms, under 5 ms
    assert hundred.quantile_s(0.99) == 0.05
    assert hundred.quantile_s(1.0) == 1.0
    assert _late(5.0).quantile_s(0.5) == float("inf")
    assert _late().quantile_s(0.99) == 0.0
