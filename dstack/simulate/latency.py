"""Batch latency for any batch size and slice, from a profile (the simulator's model).

A profile measures latency at a few batch sizes x slice percentages. The simulator needs
L(b, p) for every batch b a policy may launch and the slice p its worker runs in:

- **Percent.** As `Profile.latency_ms` (and the optimizer): a slice between measured
  percentages runs at the speed of the largest measured percentage it contains (rounded
  *down*, conservative). A slice below the smallest measured one, p < p_min, is taken to be
  work-conserving: L(b, p) = L(b, p_min) * p_min / p.
- **Batch.** At that percentage, linear interpolation between the two profiled batch sizes
  around b; above the largest profiled batch, linear extrapolation from the last two (never
  below the largest one's latency); below the smallest profiled batch, the smallest one's
  latency (conservative). A profile with a single batch size b0 gives L(b) = L(b0) * b / b0
  above b0 and L(b0) below.

Latencies are the profile's p50. Pure functions over `Profile`; nothing here runs anything.
"""

from __future__ import annotations

from dstack.common.types import Profile


def latency_ms(profile: Profile, batch: int, percent: float) -> float:
    """L(batch, percent) in ms under the rules of the module docstring
    (`Profile.interpolated_ms`, which the planner reads too)."""
    return profile.interpolated_ms(batch, percent)


def latency_table_s(profile: Profile, percent: float, max_batch: int) -> list[float]:
    """[L(b, percent) in seconds for b = 0..max_batch] (index 0 repeats b = 1), so the
    event loop looks a batch up in O(1)."""
    row = [latency_ms(profile, b, percent) / 1000 for b in range(1, max_batch + 1)]
    return [row[0], *row]
