"""The in-process ceiling: a model called directly, on the cores and threads a server's
worker gets, which no server can beat; and the single-model figure against it
(`ceiling_ratio`)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import numpy as np

from bench.servers import ROOT

_CEILING_CHILD = r"""
from dstack.common.heap import keep_heap
keep_heap()  # allocate as the server's workers do
import json, os, sys, time, torch, models
cores = json.loads(sys.argv[2])
os.sched_setaffinity(0, set(cores)); torch.set_num_threads(len(cores))
m = models.load_model(sys.argv[1]); spec = models.spec(sys.argv[1])
shape = spec.inputs[0].shape[1:]
print("ready", flush=True)
with torch.inference_mode():
    for line in sys.stdin:
        b, seconds, warmup = int(line.split()[0]), float(line.split()[1]), float(line.split()[2])
        x = torch.rand(b, *shape)
        t0 = time.perf_counter()
        m(x)
        while time.perf_counter() - t0 < warmup: m(x)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            m(x); n += b
        print(n / (time.perf_counter() - t0), flush=True)
"""


class InProcess:
    """The model called directly in one child process, pinned to `cores` with as many
    torch threads as the server's worker gets: `items_s(b, seconds)` measures items/s at
    batch b on demand, so the ceiling can be taken right beside each server window."""

    def __init__(self, model: str, cores: list[int]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CEILING_CHILD, model, json.dumps(cores)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            self.close()
            raise RuntimeError(f"in-process child for {model} failed to start")

    def items_s(self, batch: int, seconds: float, warmup_s: float = 0.25) -> float:
        """Items/s at `batch` over `seconds`, after at least one batch and `warmup_s` of
        batches not counted (the same warm-up the server's windows get)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{batch} {seconds} {warmup_s}\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def __enter__(self) -> InProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def ceiling_ratio(goodput: list[float], ceiling: list[float], batch: list[int], *,
                  resamples: int = 2000, seed: int = 0) -> dict[str, Any]:
    """The single-model figure from alternating windows: round i measured the server's
    goodput `goodput[i]` and, beside it, the in-process items/s `ceiling[i]` at batch
    `batch[i]`. The ceiling is the best batch size's mean; the ratio is the mean goodput
    over it. `ci95` is a bootstrap over the rounds (the best batch re-chosen in each
    resample). Taking the best of several noisy means reads the ceiling a little high when
    batch sizes are alike: the error is against the server, never for it."""
    g, c, b = np.asarray(goodput, float), np.asarray(ceiling, float), np.asarray(batch)
    if not (len(g) == len(c) == len(b)) or not len(g):
        raise ValueError("goodput, ceiling and batch need one entry per round")
    sizes = sorted(set(b.tolist()))

    def best(idx: np.ndarray) -> tuple[int, float]:
        means = {s: c[idx][b[idx] == s].mean() for s in sizes if (b[idx] == s).any()}
        top = max(means, key=means.__getitem__)
        return top, float(means[top])

    all_rounds = np.arange(len(g))
    top, ceil = best(all_rounds)
    rng = np.random.default_rng(seed)
    ratios = []
    for _ in range(resamples):
        idx = rng.integers(0, len(g), len(g))
        ratios.append(g[idx].mean() / best(idx)[1])
    return {"per_batch": {int(s): float(c[b == s].mean()) for s in sizes},
            "best_batch": int(top), "ceiling_items_s": ceil,
            "ratio_to_ceiling": float(g.mean() / ceil),
            "ci95": [float(q) for q in np.percentile(ratios, [2.5, 97.5])]}


def contenders(ceil: dict[str, Any]) -> list[int]:
    """The batch sizes worth measuring beside the server: within 20% of the best in the
    opening bursts (a window's noise here is ~8%; b1 of resnet18 is ~25% behind)."""
    per_b = ceil["per_batch"]
    return [b for b, v in per_b.items() if v >= 0.8 * ceil["items_s"]]


def figure(s: dict[str, Any]) -> str:
    """One line for a `ceiling_ratio` result: the ratio, its interval, the ceiling."""
    lo, hi = s["ci95"]
    per_b = ", ".join(f"b{b} {v:.1f}" for b, v in s["per_batch"].items())
    return (f"{100 * s['ratio_to_ceiling']:5.1f}% of the ceiling beside it (95% CI "
            f"{100 * lo:.1f}-{100 * hi:.1f}%; in process: {per_b} items/s)")
