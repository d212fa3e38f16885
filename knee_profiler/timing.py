"""Timing one batch size inside a slice (runs in the measuring child).

CUDA, method "graph" (the default for CUDA sweeps): the forward is captured once per batch
size into a CUDA graph and each replay is timed with a pair of events; replays are queued
back to back and synchronised once, so the GPU never waits on Python. This is what the
kernels cost: eager PyTorch at batch 1-8 spends longer launching kernels from the CPU than
running them, and that launch time does not shrink with the slice, which flattened curves
and put knees in the wrong place. When capture fails the batch falls back to "eager"
(events around each forward, synchronised), and the method used is reported per cell.
CPU is timed with a monotonic clock.
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
    method: str = "eager"  # "graph" | "eager" | "eager (graph capture failed: ...)"


TIMING_METHODS = ("graph", "eager")


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


def make_input(shape: Sequence[int], batch: int, device: str, seed: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Random normal input of the model's shape with the batch dimension filled in."""
    g = torch.Generator().manual_seed(seed + batch)
    dims = [batch] + [int(d) for d in shape[1:]]
    return torch.randn(dims, generator=g).to(device=device, dtype=dtype)


def _summary(samples: list[float], mem_mb: float, method: str) -> Timing:
    return Timing(
        p50_ms=percentile(samples, 50),
        p95_ms=percentile(samples, 95),
        mean_ms=sum(samples) / len(samples),
        memory_mb=mem_mb,
        samples=len(samples),
        method=method,
    )


def time_graph(
    model: nn.Module, x: torch.Tensor, warmup: int, repeats: int,
    min_time_s: float = 0.0, max_repeats: int | None = None,
) -> list[float]:
    """Capture `model(x)` in a CUDA graph and time its replays (ms each). At least
    `repeats` replays, more (up to `max_repeats`) until they span `min_time_s`."""
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture stream (cuDNN, allocator)
            for _ in range(max(2, warmup)):
                model(x)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model(x)
        torch.cuda.synchronize()
        for _ in range(max(1, warmup)):
            graph.replay()
        t0 = torch.cuda.Event(enable_timing=True)
        t1 = torch.cuda.Event(enable_timing=True)
        t0.record()
        graph.replay()
        t1.record()
        t1.synchronize()
        once_ms = max(1e-3, float(t0.elapsed_time(t1)))
        n = repeats
        if min_time_s > 0:
            n = max(repeats, math.ceil(min_time_s * 1000 / once_ms))
        if max_repeats is not None:
            n = max(repeats, min(n, max_repeats))
        events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        events[0].record()
        for i in range(n):
            graph.replay()
            events[i + 1].record()
        events[-1].synchronize()
        samples = [float(events[i].elapsed_time(events[i + 1])) for i in range(n)]
    del graph
    return samples


def time_batch(
    model: nn.Module, shape: Sequence[int], batch: int, device: str,
    warmup: int, repeats: int, seed: int = 0, *, method: str = "eager",
    dtype: torch.dtype = torch.float32, min_time_s: float = 0.0,
    max_repeats: int | None = None,
) -> Timing:
    """Warm up, then time forwards of one input made once for this batch size.

    `method` "graph" (CUDA only) times CUDA-graph replays and falls back to eager when the
    forward cannot be captured; `min_time_s`/`max_repeats` let it take more than `repeats`
    samples where a forward is short (graph only)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    if method not in TIMING_METHODS:
        raise ValueError(f"timing method must be one of {TIMING_METHODS}, got {method!r}")
    cuda = device.startswith("cuda")
    if cuda and method == "graph":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        x = make_input(shape, batch, device, seed, dtype)
        try:
            samples = time_graph(model, x, warmup, repeats, min_time_s, max_repeats)
        except Exception as e:  # capture refused (host sync, dynamic shapes...): eager
            torch.cuda.synchronize()
            first = (str(e).splitlines() or [""])[0][:120]
            t = time_batch(model, shape, batch, device, warmup, repeats, seed, dtype=dtype)
            return Timing(t.p50_ms, t.p95_ms, t.mean_ms, t.memory_mb, t.samples,
                          f"eager (graph capture failed: {type(e).__name__}: {first})")
        mem_mb = torch.cuda.max_memory_allocated() / 2**20
        del x
        return _summary(samples, mem_mb, "graph")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_kb = 0
    else:
        _reset_rss_peak()
        base_kb = _proc_status_kb("VmRSS") or 0
    x = make_input(shape, batch, device, seed, dtype)
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
    return _summary(samples, mem_mb, "eager")
