"""`--plot`: a timeline of the batches each policy ran (time across, slice % up, stacked
per model) over the first moments of the run, and the latency CDF of every policy."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dstack.simulate.engine import RunResult


def plot(results: dict[str, RunResult], slo_ms: dict[str, float], path: str | Path,
         window_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({s.model for r in results.values() for s in r.timeline}
                   | set(slo_ms))
    colors = {m: plt.cm.tab10(i % 10) for i, m in enumerate(names)}
    n = len(results)
    fig, axes = plt.subplots(n + 1, 1, figsize=(11, 2.2 * n + 3.5), squeeze=False)
    for ax, (pol, r) in zip(axes[:, 0], results.items(), strict=False):
        # Each model gets a lane; a batch is drawn as a bar as tall as its slice share.
        lanes = {m: i for i, m in enumerate(names)}
        for s in r.timeline:
            if s.start_s >= window_s:
                continue
            h = min(s.percent, 100.0) / 100 * 0.9
            ax.broken_barh([(s.start_s * 1000, (s.end_s - s.start_s) * 1000)],
                           (lanes[s.model], h), facecolors=colors[s.model],
                           edgecolors="black" if s.reuse else "none", linewidth=0.5)
        ax.set_yticks([lanes[m] + 0.45 for m in names], names)
        ax.set_xlim(0, window_s * 1000)
        ax.set_title(f"{pol}: batches over the first {window_s * 1000:g} ms "
                     "(bar height = slice %, outlined = reuse)", fontsize=9)
    axes[-2, 0].set_xlabel("time (ms)")
    ax = axes[-1, 0]
    for pol, r in results.items():
        if not len(r.latencies_s):
            continue
        lat = np.sort(np.frombuffer(r.latencies_s, dtype=np.float64)) * 1000
        ax.plot(lat, np.arange(1, lat.size + 1) / lat.size, label=pol)
    for m, slo in slo_ms.items():
        ax.axvline(slo, color=colors[m], linestyle=":", linewidth=1, label=f"SLO {m}")
    ax.set_xlabel("latency of answered requests (ms)")
    ax.set_ylabel("CDF")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
