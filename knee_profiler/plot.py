"""Knee plots (`knee-profiler plot`): one row per profile, two panels per row.

Left: p50 latency vs slice % per batch size, the knee marked. Right: throughput (items/s)
vs batch size at each batch's knee. matplotlib is imported here only, with the Agg backend,
so the rest of the profiler runs where it is absent.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from dstack.common.types import Profile
from knee_profiler.report import curves, knee_of


def plot_profiles(
    profiles: Sequence[Profile], out: str | Path, epsilon: float | None = None
) -> Path:
    """Write a PNG of the profiles to `out`; returns its path. Raises ValueError if a
    profile has no complete percentage to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not profiles:
        raise ValueError("no profiles to plot")
    fig, axes = plt.subplots(
        len(profiles), 2, figsize=(12, 4.2 * len(profiles)), squeeze=False
    )
    for row, p in zip(axes, profiles, strict=True):
        if not p.percentages:
            raise ValueError(f"{p.model}: no complete percentage to plot")
        eps = p.epsilon if epsilon is None else epsilon
        lat_ax, tput_ax = row
        knee_b, knee_t = [], []
        for b, c in curves(p).items():
            xs = sorted(c)
            (line,) = lat_ax.plot(xs, [c[x] for x in xs], marker="o", ms=3, label=f"batch {b}")
            k = knee_of(p, b, eps)
            if k is None:
                continue
            lat_ax.plot([k], [c[k]], marker="*", ms=14, color=line.get_color(),
                        markeredgecolor="black", zorder=5)
            knee_b.append(b)
            knee_t.append(b / c[k] * 1000.0)
        lat_ax.set_xlabel(f"slice % ({p.mechanism})")
        lat_ax.set_ylabel("p50 latency (ms)")
        lat_ax.set_yscale("log")
        lat_ax.set_title(f"{p.model} on {p.device.name}: knee (*) at eps={eps:g}")
        lat_ax.grid(True, alpha=0.3)
        lat_ax.legend(fontsize=8)
        tput_ax.plot(knee_b, knee_t, marker="o")
        for b, t in zip(knee_b, knee_t, strict=True):
            tput_ax.annotate(f"{knee_of(p, b, eps):g}%", (b, t), textcoords="offset points",
                             xytext=(4, 4), fontsize=8)
        tput_ax.set_xscale("log", base=2)
        tput_ax.set_xlabel("batch size")
        tput_ax.set_ylabel("throughput at the knee (items/s)")
        tput_ax.set_title(f"{p.model}: throughput vs batch at the knee (labels: knee %)")
        tput_ax.grid(True, alpha=0.3)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
