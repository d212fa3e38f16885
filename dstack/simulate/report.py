"""Numbers per policy from a run, and the report table."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dstack.simulate.engine import RunResult


@dataclass(frozen=True, slots=True)
class PolicyReport:
    """One policy's outcome. Latency percentiles are over requests answered (refused ones
    excluded); goodput counts requests answered within their SLO, per second of the run."""

    policy: str
    arrived: int
    goodput_rps: float
    slo_attainment_pct: float  # within SLO / arrived
    p50_ms: float
    p99_ms: float
    refused: int
    late: int  # answered, but after the deadline
    utilisation_pct: float  # time-averaged min(sum of running slices, 100%)
    ideal_rps: float
    per_model_goodput_rps: dict[str, float]
    decisions: int
    error: str = ""  # the policy could not be set up (e.g. no feasible plan)

    @property
    def ratio(self) -> float:
        return self.goodput_rps / self.ideal_rps if self.ideal_rps > 0 else 0.0


def summarise(policy: str, r: RunResult, ideal_rps: float) -> PolicyReport:
    arrived = sum(c.arrived for c in r.counts.values())
    within = sum(c.within_slo for c in r.counts.values())
    served = sum(c.served for c in r.counts.values())
    refused = sum(c.refused_total for c in r.counts.values())
    lat = np.frombuffer(r.latencies_s, dtype=np.float64) if len(r.latencies_s) else None
    p50 = float(np.percentile(lat, 50)) * 1000 if lat is not None else float("nan")
    p99 = float(np.percentile(lat, 99)) * 1000 if lat is not None else float("nan")
    return PolicyReport(
        policy=policy,
        arrived=arrived,
        goodput_rps=within / r.duration_s,
        slo_attainment_pct=100.0 * within / arrived if arrived else 100.0,
        p50_ms=p50,
        p99_ms=p99,
        refused=refused,
        late=served - within,
        utilisation_pct=100.0 * r.busy_integral / r.duration_s,
        ideal_rps=ideal_rps,
        per_model_goodput_rps={m: c.within_slo / r.duration_s for m, c in r.counts.items()},
        decisions=r.decisions,
    )


def failed(policy: str, reason: str, ideal_rps: float) -> PolicyReport:
    nan = float("nan")
    return PolicyReport(policy, 0, 0.0, 0.0, nan, nan, 0, 0, 0.0, ideal_rps, {}, 0, reason)


def format_table(reports: list[PolicyReport]) -> str:
    """A Markdown table, one row per policy (a policy that failed to start says why)."""
    head = ("| policy | goodput rps | SLO attainment | p50 ms | p99 ms | refused | late "
            "| utilisation | ideal rps | ratio |")
    rule = "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    rows = [head, rule]
    for r in reports:
        if r.error:
            rows.append(f"| {r.policy} | — | — | — | — | — | — | — | {r.ideal_rps:.1f} | — |")
            continue
        rows.append(
            f"| {r.policy} | {r.goodput_rps:.1f} | {r.slo_attainment_pct:.1f}% | {r.p50_ms:.1f} "
            f"| {r.p99_ms:.1f} | {r.refused} | {r.late} | {r.utilisation_pct:.1f}% "
            f"| {r.ideal_rps:.1f} | {r.ratio:.3f} |"
        )
    notes = [f"\n{r.policy}: could not run: {r.error}" for r in reports if r.error]
    return "\n".join(rows) + "".join(notes)


def format_per_model(reports: list[PolicyReport]) -> str:
    """Goodput per model (rps within SLO), one row per policy."""
    ok = [r for r in reports if not r.error]
    if not ok:
        return ""
    models = list(ok[0].per_model_goodput_rps)
    rows = ["| policy | " + " | ".join(models) + " |",
            "|---|" + "---:|" * len(models)]
    for r in ok:
        rows.append(f"| {r.policy} | "
                    + " | ".join(f"{r.per_model_goodput_rps[m]:.1f}" for m in models) + " |")
    return "\n".join(rows)
