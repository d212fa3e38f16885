"""Timing one batch size inside a slice (runs in the measuring child).

CUDA is timed with events around each forward and synchronised; CPU with a monotonic clock.
Peak memory per batch: CUDA `max_memory_allocated` (weights + inputs + activations); CPU the
growth of resident memory while the batch runs (inputs + activations, weights excluded),
read from /proc/self/status after resetting the high-water mark.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


def percentile(samples: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default rule), q in [0, 100]."""
    if not samples:
        raise ValueError("no samples")
    xs = sorted(samples)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class Timing:
    p50_ms: float
    p95_ms: float
    mean_ms: float
    memory_mb: float
    samples: int


def _proc_status_kb(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_rss_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux: write 5 to clear_refs). False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def make_input(shape: Sequence[int], batch: int, device: str, seed: int) -> torch.Tensor:
    """Random normal input of the model's shape with the batch dimension filled in."""
    g = torch.Generator().manual_seed(seed + batch)
    dims = [batch] + [int(d) for d in shape[1:]]
    return torch.randn(dims, generator=g).to(device)


def time_batch(
    model: nn.Module, shape: Sequence[int], batch: int, device: str,
    warmup: int, repeats: int, seed: int = 0,
) -> Timing:
    """Warm up, then time `repeats` forwards of one input made once for this batch size."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_kb = 0
    else:
        _reset_rss_peak()
        base_kb = _proc_status_kb("VmRSS") or 0
    x = make_input(shape, batch, device, seed)
    samples: list[float] = []
    with torch.inference_mode():
        for _ in range(warmup):
            model(x)
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for _ in range(repeats):
                start.record()
                model(x)
                end.record()
                end.synchronize()
                samples.append(float(start.elapsed_time(end)))
        else:
            for _ in range(repeats):
                t0 = time.perf_counter_ns()
                model(x)
                samples.append((time.perf_counter_ns() - t0) / 1e6)
    if cuda:
        mem_mb = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak_kb = _proc_status_kb("VmHWM") or base_kb
        mem_mb = max(0, peak_kb - base_kb) / 1024
    del x
    return Timing(
        p50_ms=percentile(samples, 50),
        p95_ms=percentile(samples, 95),
        mean_ms=sum(samples) / len(samples),
        memory_mb=mem_mb,
        samples=len(samples),
    )
