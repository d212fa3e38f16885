"""The dashboard's ring buffer and latency histogram, on a hand-driven clock."""

from __future__ import annotations

from dstack.common.backend import ModelStats
from server.history import History, LatencyHistogram, quantile


class CountingBackend:
    """Just the counters `History` reads, set by hand."""

    def __init__(self) -> None:
        self.success = self.slo_met = self.items = self.batches = self.failed = 0
        self.pending = 0
        self.rules = {"queue_full": 0, "expired": 0}

    def model_names(self) -> list[str]:
        return ["m"]

    def stats(self, model: str) -> ModelStats:
        return ModelStats(model, self.success, self.failed + sum(self.rules.values()),
                          self.items, self.batches, 0, 0, sum(self.rules.values()),
                          self.slo_met, self.pending)

    def refusals(self, model: str) -> dict[str, int]:
        return dict(self.rules)

    def current_batch_cap(self, model: str) -> int:
        return 4


def test_quantile_interpolates_inside_the_bucket_like_prometheus() -> None:
    bounds = (0.1, 0.2, 0.4)
    assert quantile(0.99, bounds, (0, 0, 0, 0)) is None
    # 100 answers: 50 under 0.1 s, 50 in (0.2, 0.4]: the 99th is 98% into the last finite one
    assert quantile(0.99, bounds, (50, 0, 50, 0)) == 0.2 + 0.2 * 49 / 50
    assert quantile(0.5, bounds, (50, 0, 50, 0)) == 0.1
    assert quantile(0.99, bounds, (1, 0, 0, 99)) == 0.4  # in +Inf: the last finite bound


def test_histogram_buckets_by_upper_bound() -> None:
    h = LatencyHistogram((0.1, 0.2))
    for s in (0.05, 0.1, 0.15, 5.0):
        h.observe("m", s)
    assert h.counts("m") == (2, 1, 1)
    assert h.counts("other") == (0, 0, 0)
    assert abs(h.sum_s("m") - 5.3) < 1e-9


def test_series_are_rates_between_samples() -> None:
    b = CountingBackend()
    lat = LatencyHistogram()
    hist = History(b, lat, interval_s=1.0, window_s=60.0, p99_window_s=2.0)
    hist.sample(0.0)
    b.success, b.slo_met, b.items, b.batches, b.pending = 10, 8, 24, 6, 3
    b.rules["expired"] = 2
    for _ in range(10):
        lat.observe("m", 0.012)
    hist.sample(2.0)  # a 2 s interval: rates are per second
    b.rules["queue_full"] = 1
    hist.sample(3.0)  # nothing answered: attainment and batch are undefined, not 0
    m = hist.series()["models"][0]
    assert hist.series()["t"] == [-1.0, 0.0]
    assert m["goodput_rps"] == [4.0, 0.0]
    assert m["answered_rps"] == [5.0, 0.0]
    assert m["attainment"] == [0.6667, 0.0]  # 8 within SLO of 12 finished (2 refused)
    assert m["batch"] == [4.0, None]
    assert m["batch_cap"] == [4, 4]
    assert m["queue"] == [3, 3]
    assert m["refused_rps"] == {"expired": [1.0, 0.0], "queue_full": [0.0, 1.0]}
    # p99 over the last 2 samples: all ten answers in the (10, 15] ms bucket
    assert m["p99_ms"][0] is not None and 10 < m["p99_ms"][0] <= 15
    assert m["p99_ms"][1] == m["p99_ms"][0]
    assert m["totals"]["success"] == 10 and m["totals"]["refused"] == {"queue_full": 1,
                                                                       "expired": 2}


def test_ring_buffer_is_bounded() -> None:
    b = CountingBackend()
    hist = History(b, LatencyHistogram(), interval_s=1.0, window_s=5.0)
    for i in range(1000):
        b.success = b.slo_met = i
        hist.sample(float(i))
    assert len(hist.samples) == 6
    s = hist.series()
    assert len(s["t"]) == 5 and len(s["models"][0]["goodput_rps"]) == 5
    assert s["t"][0] == -4.0
    assert s["models"][0]["totals"]["success"] == 999


def test_a_model_that_comes_later_has_gaps_before() -> None:
    b = CountingBackend()
    hist = History(b, LatencyHistogram(), interval_s=1.0, window_s=10.0)
    names = ["m"]
    b.model_names = lambda: names  # type: ignore[method-assign]
    hist.sample(0.0)
    names.append("n")
    hist.sample(1.0)
    hist.sample(2.0)
    n = hist.series()["models"][1]
    assert n["name"] == "n" and n["goodput_rps"] == [None, 0.0]
