"""Prometheus `/metrics`, named after Triton's so that existing dashboards read them.

Values the backend already counts (`InferenceBackend.stats`) are read at scrape time by
a custom collector, never counted twice. Only what the backend cannot know is counted
here: failures by reason, which the HTTP layer sees (a 400 never reaches the backend); the
stats route reads its failure count from the same counter (`FailureCounts.total`).

Each app owns its own `CollectorRegistry`, so tests can build several apps.

Triton's counters carry no `_total` suffix (`nv_inference_request_success`, not
`nv_inference_request_success_total`); prometheus-client adds one to counter families,
so the exposition is written here for those names (`render`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from dstack.common.backend import InferenceBackend
from dstack.common.errors import DStackError
from dstack.common.pauses import LATE_BOUNDS_S, Lateness

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FAILURE_REASONS = ("rejected", "slo_refused", "backend", "unavailable")

#: Where a refusal was decided (`dstack_refusal_seconds`'s `stage`): from the request's
#: header, its body left unread; once some or all of its body had been read; or once it
#: had waited in its model's queue (refused `expired` at launch).
REFUSAL_STAGES = ("header", "body", "queue")


def histogram_counts(text: str, name: str, **labels: str) -> Lateness:
    """The histogram `name` (on LATE_BOUNDS_S) of a /metrics exposition `text` as counts,
    its series whose labels include `labels` summed (for the benchmarks and tests)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = Lateness()
    below: dict[tuple[tuple[str, str], ...], int] = {}  # each series' last cumulative count
    for fam in text_string_to_metric_families(text):
        if fam.name != name:
            continue
        for x in fam.samples:  # each series' buckets come in order
            series = {k: v for k, v in x.labels.items() if k != "le"}
            if not labels.items() <= series.items():
                continue
            if x.name.endswith("_bucket"):
                key = tuple(sorted(series.items()))
                le = float(x.labels["le"])
                i = LATE_BOUNDS_S.index(le) if le in LATE_BOUNDS_S else len(LATE_BOUNDS_S)
                out.counts[i] += int(x.value) - below.get(key, 0)
                below[key] = int(x.value)
            elif x.name.endswith("_sum"):
                out.sum_s += x.value
    return out


class FailureCounts:
    """Failed infer requests per (model, reason), counted by the HTTP layer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}

    def add(self, model: str, reason: str) -> None:
        if reason not in FAILURE_REASONS:
            reason = "backend"  # an unexpected error is ours: "we are broken"
        with self._lock:
            key = (model, reason)
            self._counts[key] = self._counts.get(key, 0) + 1

    def get(self, model: str, reason: str) -> int:
        with self._lock:
            return self._counts.get((model, reason), 0)

    def total(self, model: str) -> int:
        """Every failure of `model`, whatever the reason (its stats' failure count)."""
        with self._lock:
            return sum(k for (m, _), k in self._counts.items() if m == model)


def _counter(name: str, doc: str) -> Metric:
    # A bare Metric, so that samples keep Triton's unsuffixed name (see module docstring).
    return Metric(name, doc, "counter")


class BackendCollector(Collector):
    """Reads the backend's counters and gauges at scrape time."""

    def __init__(self, backend: InferenceBackend, failures: FailureCounts, version: str) -> None:
        self.backend = backend
        self.failures = failures
        self.version = version

    def collect(self) -> Iterator[Metric]:
        b = self.backend
        v = self.version
        success = _counter(
            "nv_inference_request_success", "Number of successful inference requests"
        )
        failure = _counter(
            "nv_inference_request_failure", "Number of failed inference requests, by reason"
        )
        count = _counter(
            "nv_inference_count", "Number of inferences performed (items, not requests)"
        )
        execs = _counter("nv_inference_exec_count", "Number of model executions (batches)")
        queue = _counter(
            "nv_inference_queue_duration_us", "Cumulative time requests spent queued (us)"
        )
        compute = _counter(
            "nv_inference_compute_infer_duration_us", "Cumulative time batches ran (us)"
        )
        slo_met = _counter(
            "dstack_request_slo_met", "Successful requests answered within their SLO (server clock)"
        )
        refused = _counter(
            "dstack_request_refused", "Requests refused by the runtime (queue full or deadline)"
        )
        by_rule = _counter(
            "dstack_request_refused_by_rule",
            "Requests refused, by the rule that refused them (queue_full, unplanned, "
            "work_ahead, expired)",
        )
        pending = GaugeMetricFamily(
            "nv_inference_pending_request_count",
            "Requests queued or running now",
            labels=["model", "version"],
        )
        attain = GaugeMetricFamily(
            "dstack_slo_attainment",
            "SLO met / successful requests since start (NaN before any)",
            labels=["model"],
        )
        slice_pct = GaugeMetricFamily(
            "dstack_slice_percent",
            "Share of the device the model's worker may use (CPU: "
            "cores as a percentage of the served cores)",
            labels=["model"],
        )
        batch = GaugeMetricFamily(
            "dstack_batch_size", "Batch size the policy aims for now", labels=["model"]
        )
        restarts = _counter(
            "dstack_model_restart_count",
            "Restarts of the model's worker after it died (replicas summed)",
        )
        restart_us = GaugeMetricFamily(
            "dstack_model_restart_duration_us",
            "How long the last restart of the model's worker took, death to ready (us)",
            labels=["model", "version"],
        )
        restarting = GaugeMetricFamily(
            "dstack_model_restarting",
            "1 while the model's worker is restarting, else 0",
            labels=["model", "version"],
        )
        terms = GaugeMetricFamily(
            "dstack_admission_seconds",
            "What admission counts for a request besides its batches' compute and the work "
            "ahead (term: body, its arrival; loop, the event loop's turns; overhead, a "
            "batch's hand-over to its worker and back; delivery, the answer's way out)",
            labels=["model", "term"],
        )
        margin = GaugeMetricFamily(
            "dstack_admission_margin",
            "The factor admission scales a finish behind queued work by (kept so that few "
            "requests admitted that way miss their SLO)",
            labels=["model"],
        )
        terms_of = getattr(b, "admission_terms", None)
        cap_of = getattr(b, "current_batch_cap", None)
        rules_of = getattr(b, "refusals", None)
        slice_of = getattr(b, "current_slice", None)
        restarts_of = getattr(b, "restarts", None)
        for model in b.model_names():
            s = b.stats(model)
            mv: dict[str, str] = {"model": model, "version": v}
            success.add_sample("nv_inference_request_success", mv, s.request_success)
            for reason in FAILURE_REASONS:
                failure.add_sample(
                    "nv_inference_request_failure",
                    {**mv, "reason": reason},
                    self.failures.get(model, reason),
                )
            count.add_sample("nv_inference_count", mv, s.inference_count)
            execs.add_sample("nv_inference_exec_count", mv, s.execution_count)
            queue.add_sample("nv_inference_queue_duration_us", mv, s.queue_ns / 1000)
            compute.add_sample("nv_inference_compute_infer_duration_us", mv, s.compute_ns / 1000)
            slo_met.add_sample("dstack_request_slo_met", mv, s.slo_met)
            refused.add_sample("dstack_request_refused", mv, s.refused)
            if rules_of is not None:
                for rule, k in rules_of(model).items():
                    by_rule.add_sample("dstack_request_refused_by_rule", {**mv, "rule": rule}, k)
            pending.add_metric([model, v], s.pending)
            attain.add_metric(
                [model], s.slo_met / s.request_success if s.request_success else math.nan
            )
            if slice_of is not None:
                sl = slice_of(model)
                if sl is not None:
                    slice_pct.add_metric([model], sl.percent)
            if cap_of is not None:
                batch.add_metric([model], cap_of(model))
            if terms_of is not None:
                for term, value in terms_of(model).items():
                    if term == "margin":
                        margin.add_metric([model], value)
                    else:
                        terms.add_metric([model, term], value)
            if restarts_of is not None:
                r = restarts_of(model)
                restarts.add_sample("dstack_model_restart_count", mv, r.count)
                restarting.add_metric([model, v], 0 if r.died_at is None else 1)
                if r.last_s is not None:
                    restart_us.add_metric([model, v], r.last_s * 1e6)
        yield from (
            success,
            failure,
            count,
            execs,
            queue,
            compute,
            slo_met,
            refused,
            by_rule,
            pending,
            attain,
            slice_pct,
            batch,
            terms,
            margin,
            restarts,
            restart_us,
            restarting,
        )
        lag = getattr(b, "loop_lag_s", None)
        if lag is not None:
            yield GaugeMetricFamily(
                "dstack_event_loop_lag_seconds",
                "How late the server's event loop runs what is due (a running mean); the "
                "checks before admission count a few times this as time the request waits",
                value=lag)
        reads = getattr(b, "read_limit", None)
        if reads is not None:
            yield GaugeMetricFamily(
                "dstack_body_reads_limit",
                "Request bodies read at once, at most, now (server.max_body_reads; fewer "
                "while bodies take longer than usual to come); a request over it is "
                "refused at its header", value=reads.limit)
        late: Lateness | None = getattr(b, "loop_late", None)
        if late is not None:
            yield lateness_histogram(
                "dstack_event_loop_late_seconds",
                "How late each tick of the server's 10 ms loop timer fired: a tick more than "
                "a few ms late is the loop held up, and every request it had then with it",
                late)


def lateness_histogram(name: str, documentation: str, late: Lateness) -> HistogramMetricFamily:
    """`late`'s counts as a Prometheus histogram on LATE_BOUNDS_S."""
    cumulative, buckets = 0, []
    for bound, n in zip((*LATE_BOUNDS_S, math.inf), late.counts, strict=True):
        cumulative += n
        buckets.append((floatToGoString(bound), cumulative))
    return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=late.sum_s)


class _FrontEnds(Collector):
    """What the front ends (`server.frontends`) report and pass: their loop timers, the
    bodies they passed in shared memory; nothing without front ends."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        late = self.metrics.frontends_late
        if late is None:
            return
        yield lateness_histogram(
            "dstack_frontend_loop_late_seconds",
            "How late each tick of the front-end processes' 10 ms loop timers fired, all "
            "front ends together (server.frontends > 1; reported once a second)", late)
        yield CounterMetricFamily(
            "dstack_frontend_shared_bodies",
            "Infer bodies the front ends passed in shared memory (the others crossed the "
            "link: not binary, or no room)", value=self.metrics.frontends_shared_bodies)
        yield CounterMetricFamily(
            "dstack_frontend_standing_refusals",
            "Infer requests a front end refused at the header within a refusal of the "
            "dispatch process that still stood, without asking it (counted with the other "
            "refusals too)", value=self.metrics.frontends_standing_refusals)
        yield CounterMetricFamily(
            "dstack_frontend_undecided_refusals",
            "Infer requests a front end refused at the header because the dispatch process "
            "had not decided on them within server.decision_timeout_ms (counted with the "
            "other refusals too)", value=self.metrics.frontends_undecided)


_UNSUFFIXED = (
    "nv_inference_request_success",
    "nv_inference_request_failure",
    "nv_inference_count",
    "nv_inference_exec_count",
    "nv_inference_queue_duration_us",
    "nv_inference_compute_infer_duration_us",
    "dstack_request_slo_met",
    "dstack_request_refused",
    "dstack_request_refused_by_rule",
    "dstack_model_restart_count",
)


class Metrics:
    """The per-app registry plus what the HTTP layer feeds: the failure counts and the
    refusals' times (`failed`)."""

    def __init__(self, backend: InferenceBackend, version: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.failures = FailureCounts()
        self.registry.register(BackendCollector(backend, self.failures, version))
        self.refusal_seconds = Histogram(
            "dstack_refusal_seconds",
            "Time from a refused infer request's first byte to its refusal, by where it was "
            "decided: from its header (stage=header: its body never read), once its body "
            "had been read (stage=body), or after it waited queued (stage=queue: expired)",
            ["model", "stage"], buckets=LATE_BOUNDS_S, registry=self.registry)
        self._refusals_timed: dict[tuple[str, str], Any] = {}
        #: With front ends (`server.link`): their loop lateness, added up as they report
        #: it, how many bodies they passed in shared memory, and how many requests they
        #: refused within a standing refusal.
        self.frontends_late: Lateness | None = None
        self.frontends_shared_bodies = 0
        self.frontends_standing_refusals = 0
        self.frontends_undecided = 0
        self.registry.register(_FrontEnds(self))

    def failed(self, model: str, e: DStackError, stage: str,
               received_at: float | None = None) -> None:
        """An infer request for `model` answered with `e`: counted by its reason; a
        refusal (`DStackError.refusal`) also timed from `received_at` (its first byte,
        time.monotonic()), under `stage` (REFUSAL_STAGES)."""
        self.failures.add(model, e.reason)
        if e.refusal and received_at is not None:
            timed = self._refusals_timed.get((model, stage))
            if timed is None:  # one labels() lookup per series, not per refusal
                timed = self._refusals_timed[model, stage] = self.refusal_seconds.labels(
                    model, stage)
            timed.observe(max(0.0, time.monotonic() - received_at))

    def render(self) -> bytes:
        text = generate_latest(self.registry).decode()
        # prometheus-client names a counter family `<name>_total` in HELP/TYPE; Triton's
        # counters (and the samples above) have no suffix, so the header must not either.
        for name in _UNSUFFIXED:
            text = text.replace(f"# HELP {name}_total ", f"# HELP {name} ")
            text = text.replace(f"# TYPE {name}_total ", f"# TYPE {name} ")
        return text.encode()
