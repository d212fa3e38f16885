"""Text views of a profile (`knee-profiler show`): pure functions returning strings."""

from __future__ import annotations

from dstack.common.types import Profile
from knee_profiler.knee import knee, knee_max_curvature


def curves(p: Profile, stat: str = "p50") -> dict[int, dict[float, float]]:
    """{batch: {percent: latency ms}} over the profile's grid."""
    return {
        b: {pc: p.latency_ms(b, pc, stat=stat) for pc in sorted(p.percentages)}
        for b in p.batch_sizes
    }


def knee_of(p: Profile, batch: int, epsilon: float | None = None) -> float | None:
    """The stored knee for `batch` (recomputed when epsilon differs); None if no grid."""
    c = curves(p).get(batch)
    if not c:
        return None
    if epsilon is None or epsilon == p.epsilon:
        stored = p.knee.get(batch)
        if stored is not None:
            return stored
        epsilon = p.epsilon
    return knee(c, epsilon)


def format_table(p: Profile, epsilon: float | None = None) -> str:
    """Header, then one row per batch: p50 ms per %, the knee, max-curvature knee, and
    the throughput (items/s) at the knee."""
    eps = p.epsilon if epsilon is None else epsilon
    pcts = sorted(p.percentages)
    lines = [
        f"{p.model} on {p.device.name} [{p.device.kind}, {p.device.units} "
        f"{p.device.unit_kind}, {p.mechanism}]  p50 latency ms; knee at eps={eps:g}",
    ]
    if p.provenance:
        lines.append(f"  source: {p.provenance}")
    if not p.measured.get("complete", True):
        lines.append("  (incomplete sweep: showing the complete part)")
    if not pcts:
        lines.append("  no complete percentage yet")
        return "\n".join(lines)
    head = f"{'batch':>6} " + " ".join(f"{pc:>8g}%" for pc in pcts)
    head += f" {'knee%':>7} {'curv%':>7} {'items/s@knee':>13} {'mem MB':>8}"
    lines.append(head)
    for b in p.batch_sizes:
        c = {pc: p.latency_ms(b, pc) for pc in pcts}
        k = knee_of(p, b, eps)
        kc = knee_max_curvature(c)
        tput = b / c[k] * 1000.0 if k is not None else float("nan")
        mem = p.memory_mb.get(b)
        row = f"{b:>6} " + " ".join(f"{c[pc]:>9.3f}" for pc in pcts)
        row += f" {k:>7g} {'-' if kc is None else f'{kc:g}':>7} {tput:>13.1f}"
        row += f" {'-' if mem is None else f'{mem:.1f}':>8}"
        lines.append(row)
    rp = p.measured.get("percent_map")
    if rp and any(float(k) != v for k, v in rp.items()):
        shown = ", ".join(f"{k}%->{v:g}%" for k, v in rp.items() if float(k) != v)
        lines.append(f"  rounded up: {shown}")
    return "\n".join(lines)
