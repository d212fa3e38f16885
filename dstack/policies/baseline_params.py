"""What the baselines take from a profile: spatial's knee and temporal's batch size.

Shared by `planning` (which sets the baselines up) and `lane_planning` (whose search always
scores the exact spatial and temporal assignments), so neither imports the other.
"""

from __future__ import annotations

from dstack.common.types import Profile


def knee_percent(profile: Profile, max_batch: int) -> float:
    """The knee at the largest profiled batch not above `max_batch` (100% if unknown)."""
    batches = [b for b in profile.batch_sizes if b <= max_batch] or [min(profile.batch_sizes)]
    return profile.knee.get(max(batches), 100.0)


def temporal_batch(profile: Profile, slo_ms: float, n_models: int, cap: int) -> int:
    """Best batch under the SLO on the whole device when models take turns: a request may
    wait for one batch of every model (its own included) and then run, so a batch may take
    at most SLO / (n_models + 1)."""
    budget = slo_ms / (n_models + 1)
    full = max(profile.percentages)
    fits = [b for b in profile.batch_sizes if b <= cap and profile.latency_ms(b, full) <= budget]
    return max(fits) if fits else 1
