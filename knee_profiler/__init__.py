"""knee_profiler: latency over batch size x slice %, each model's knee, profile files.

Runs on a bare machine with torch, numpy and tqdm (matplotlib only for `plot`): it imports
nothing of the server, the optimizer or the runtime, only `dstack.common.types` and `models`.
Entry point: `knee-profiler` / `python -m knee_profiler.cli`. The library pieces:
`knee.knee` / `knee.knee_max_curvature` (pure), `sweep.sweep` (measure),
`table.import_table`, `report.format_table`, `plot.plot_profiles`.
"""

from __future__ import annotations

from knee_profiler.knee import DEFAULT_EPSILON, knee, knee_max_curvature, knees

__all__ = ["DEFAULT_EPSILON", "knee", "knee_max_curvature", "knees"]
