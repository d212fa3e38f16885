"""Turn a published latency-vs-slice table into profiles (`knee-profiler import-table`).

Input format (as `../shared/data/gpu_latency_vs_mps_percentage.json`):
`{"description": str, "unit": "ms", "percentages": [...], "batch_sizes": [...],
"latency_ms": {model: {batch: [latency per percentage]}}}`. Tables give one statistic
(a median): p95 is set equal to p50 and the profile says so in `measured`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from dstack.common.types import Cell, DeviceInfo, Profile
from knee_profiler.knee import DEFAULT_EPSILON, knee_max_curvature, knees

REFERENCE_DEVICE = DeviceInfo("reference", "V100 (presumed, ~80 SMs)", 80, "SMs")


class TableError(ValueError):
    """The table is not in the expected format; the message says where."""


def profiles_from_table(
    table: dict[str, Any],
    *,
    source: str = "table",
    device: DeviceInfo = REFERENCE_DEVICE,
    epsilon: float = DEFAULT_EPSILON,
    sha256: str = "",
) -> list[Profile]:
    """One Profile per model of the table, mechanism "table", knees computed."""
    try:
        pcts = [float(p) for p in table["percentages"]]
        batches = [int(b) for b in table["batch_sizes"]]
        lat = table["latency_ms"]
        unit = table.get("unit", "ms")
    except (KeyError, TypeError, ValueError) as e:
        raise TableError(f"{source}: needs percentages, batch_sizes, latency_ms ({e})") from e
    if unit != "ms":
        raise TableError(f"{source}: latencies in {unit!r}, expected 'ms'")
    if not isinstance(lat, dict) or not lat:
        raise TableError(f"{source}: latency_ms must map model -> batch -> list")
    desc = str(table.get("description", "")).strip()
    out: list[Profile] = []
    for model in sorted(lat):
        rows = lat[model]
        cells: list[Cell] = []
        curves: dict[int, dict[float, float]] = {}
        for b in batches:
            row = rows.get(str(b)) if isinstance(rows, dict) else None
            if not isinstance(row, list) or len(row) != len(pcts):
                raise TableError(
                    f"{source}: {model} batch {b}: expected {len(pcts)} latencies, got {row!r}"
                )
            curves[b] = {}
            for p, v in zip(pcts, row, strict=True):
                ms = float(v)
                if not ms > 0:
                    raise TableError(f"{source}: {model} batch {b} at {p:g}%: latency {v}")
                cells.append(Cell(b, p, ms, ms, requested_percent=p, units=None))
                curves[b][p] = ms
        out.append(
            Profile(
                model=model,
                device=device,
                mechanism="table",
                batch_sizes=tuple(batches),
                percentages=tuple(pcts),
                cells=tuple(cells),
                epsilon=epsilon,
                knee=knees(curves, epsilon),
                memory_mb={},
                measured={
                    "tool": "knee-profiler import-table",
                    "source": source,
                    "source_sha256": sha256,
                    "statistic": "median only; p95 set equal to p50 (the table has no tail)",
                    "memory": "not in the table",
                    "complete": True,
                    "knee_max_curvature": {
                        str(b): knee_max_curvature(c) for b, c in curves.items()
                    },
                },
                provenance=(desc + " " if desc else "")
                + f"[imported by knee-profiler import-table from {source}]",
            )
        )
    return out


def import_table(
    path: str | Path, out_dir: str | Path, *, epsilon: float = DEFAULT_EPSILON,
    source_name: str | None = None,
) -> list[Path]:
    """Read the table at `path`, write `out_dir/<model>.json` for each model; the paths."""
    path = Path(path)
    raw = path.read_bytes()
    try:
        table = json.loads(raw)
    except json.JSONDecodeError as e:
        raise TableError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(table, dict):
        raise TableError(f"{path}: expected a JSON object")
    profs = profiles_from_table(
        table, source=source_name or path.name, epsilon=epsilon,
        sha256=hashlib.sha256(raw).hexdigest(),
    )
    written = []
    for p in profs:
        dest = Path(out_dir) / f"{p.model}.json"
        p.save(dest)
        written.append(dest)
    return written
