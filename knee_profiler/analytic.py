"""The analytic knee estimate (D-STACK's idea): predict latency vs slice % from the kernels'
launch configurations, without sweeping.

A trace of one forward at 100% (torch.profiler / Kineto) gives, per kernel, its grid, block,
registers per thread, shared memory and duration. `capture` (CUDA only) reduces it to a
*kernel table* (`traces/<model>.json`), which is all the estimate needs, so the estimate is
reproducible on a CPU. The model, per kernel k with duration d_k at 100%:

    blocks_k     = prod(grid)
    per_sm_k     = resident blocks per SM: min over the thread, register, shared-memory and
                   block-count limits of one SM (the usual occupancy calculation)
    needed_k     = min(SMs_total, ceil(blocks_k / per_sm_k))   SMs it can keep busy
    t_k(S)       = d_k * max(1, needed_k / S)                  on a slice of S SMs (waves)
    L(S)         = sum_k t_k(S) + gap                          gap: fixed, from the graph
                                                               replay time at 100% minus
                                                               the kernels' sum (>= 0)

and the knee is the smallest % whose L is within (1 + eps) of L at 100% (`knee.knee`).
What it ignores: memory-bandwidth limits (a memory-bound kernel slows less than its SM
share), L2 effects, and the MPS driver's own rounding (pass the measured %->SM map).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from knee_profiler.knee import DEFAULT_EPSILON, knee

SCHEMA = "dstack.kernel-table/1"


class KernelTableError(ValueError):
    """A kernel table file is missing, malformed or lacks the batch asked for."""


@dataclass(frozen=True, slots=True)
class SmLimits:
    """Per-SM limits of the device the table was traced on."""

    sms: int
    max_threads: int = 2048
    regs: int = 65536
    smem_bytes: int = 233472  # 228 KiB on H100
    max_blocks: int = 32
    warp_size: int = 32
    reg_alloc_unit: int = 256  # registers are allocated per warp in units of this
    smem_reserved_per_block: int = 1024  # the driver reserves this much per block (sm_80+)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SmLimits:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: int(v) for k, v in d.items() if k in known})


@dataclass(frozen=True, slots=True)
class Kernel:
    name: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    regs: int  # registers per thread
    smem: int  # shared memory per block, bytes (static + dynamic)
    dur_ms: float  # duration at 100%

    @property
    def blocks(self) -> int:
        return math.prod(self.grid)

    @property
    def threads(self) -> int:
        return math.prod(self.block)


def blocks_per_sm(k: Kernel, lim: SmLimits) -> int:
    """Blocks of `k` that fit on one SM at once (at least 1)."""
    warps = max(1, math.ceil(k.threads / lim.warp_size))
    by_threads = lim.max_threads // (warps * lim.warp_size)
    by_regs = lim.max_blocks
    if k.regs > 0:
        per_warp = math.ceil(k.regs * lim.warp_size / lim.reg_alloc_unit) * lim.reg_alloc_unit
        by_regs = lim.regs // (per_warp * warps)
    by_smem = lim.max_blocks
    if k.smem > 0:
        by_smem = lim.smem_bytes // (k.smem + lim.smem_reserved_per_block)
    return max(1, min(lim.max_blocks, by_threads, by_regs, by_smem))


def sms_needed(k: Kernel, lim: SmLimits) -> int:
    """SMs the kernel can keep busy: its blocks over what one SM holds, capped at the device."""
    return max(1, min(lim.sms, math.ceil(k.blocks / blocks_per_sm(k, lim))))


def default_sms_for_percent(percent: float, total: int) -> int:
    """MPS hands out whole TPCs (2 SMs each on Hopper/Ampere): p% of the SMs, rounded down
    to an even count, at least 2 (an H100's 132 SMs: 10% -> 12, 100% -> 132). Pass the map
    measured by a sweep (`units_from_profile`) where there is one."""
    if percent >= 100:
        return total
    return max(2, min(total, 2 * math.floor(percent / 100 * total / 2)))


def predict_ms(kernels: Sequence[Kernel], lim: SmLimits, sms: int, gap_ms: float = 0.0) -> float:
    """Predicted latency on a slice of `sms` SMs."""
    if sms < 1:
        raise ValueError(f"a slice needs at least one SM, got {sms}")
    total = 0.0
    for k in kernels:
        total += k.dur_ms * max(1.0, sms_needed(k, lim) / sms)
    return total + gap_ms


@dataclass(frozen=True, slots=True)
class Estimate:
    batch: int
    curve: dict[float, float]  # percent -> predicted ms
    knee: float
    sms: dict[float, int]  # percent -> SMs used for it
    kernels: int
    gap_ms: float


def estimate(
    kernels: Sequence[Kernel], lim: SmLimits, percentages: Sequence[float], batch: int,
    *, gap_ms: float = 0.0, epsilon: float = DEFAULT_EPSILON,
    sms_for: Mapping[float, int] | None = None,
) -> Estimate:
    """Predicted curve and knee of one batch size. `sms_for` maps % to SMs (measured);
    percentages missing from it use `default_sms_for_percent`."""
    pcts = sorted({float(p) for p in percentages} | {100.0})
    sms = {p: int((sms_for or {}).get(p) or default_sms_for_percent(p, lim.sms)) for p in pcts}
    curve = {p: predict_ms(kernels, lim, sms[p], gap_ms) for p in pcts}
    wanted = {float(p) for p in percentages}
    shown = {p: v for p, v in curve.items() if p in wanted or p == 100.0}
    return Estimate(batch, shown, knee(shown, epsilon), sms, len(kernels), gap_ms)


# --------------------------------------------------------------------------- table files


@dataclass(frozen=True, slots=True)
class KernelTable:
    """One model's traced kernels per batch size, and the device they ran on."""

    model: str
    device_name: str
    limits: SmLimits
    batches: dict[int, list[Kernel]]
    graph_ms: dict[int, float]  # graph-replay latency at 100% (for the gap term)
    meta: dict[str, Any]

    def gap_ms(self, batch: int) -> float:
        g = self.graph_ms.get(batch)
        if g is None:
            return 0.0
        return max(0.0, g - sum(k.dur_ms for k in self.batches[batch]))


def load_table(path: Path) -> KernelTable:
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise KernelTableError(f"{path}: cannot read kernel table: {e}") from e
    if d.get("schema") != SCHEMA:
        raise KernelTableError(f"{path}: schema {d.get('schema')!r}, expected {SCHEMA!r}")
    batches: dict[int, list[Kernel]] = {}
    graph_ms: dict[int, float] = {}
    for b, entry in d["batches"].items():
        batches[int(b)] = [
            Kernel(str(n), tuple(g), tuple(bl), int(r), int(sm), float(us) / 1000.0)  # type: ignore[arg-type]
            for n, g, bl, r, sm, us in entry["kernels"]
        ]
        if entry.get("graph_ms") is not None:
            graph_ms[int(b)] = float(entry["graph_ms"])
    return KernelTable(d["model"], d["device"]["name"], SmLimits.from_json(d["device"]),
                       batches, graph_ms, d.get("meta", {}))


def kernels_from_chrome_trace(trace: Mapping[str, Any]) -> list[list[Any]]:
    """Kineto chrome-trace events -> kernel rows [name, grid, block, regs, smem, dur_us],
    in start order."""
    rows = []
    for ev in sorted(trace.get("traceEvents", []), key=lambda e: e.get("ts", 0)):
        if ev.get("cat") != "kernel" or ev.get("ph") != "X":
            continue
        a = ev.get("args", {})
        grid = [int(x) for x in a.get("grid", [1, 1, 1])]
        block = [int(x) for x in a.get("block", [1, 1, 1])]
        rows.append([
            str(ev.get("name", "?"))[:96], grid, block, int(a.get("registers per thread", 0)),
            int(a.get("shared memory", 0)), round(float(ev.get("dur", 0.0)), 3),
        ])
    return rows


def units_from_profile(profile: Any) -> dict[float, int]:
    """% -> SMs the measuring children saw (a measured profile's cells)."""
    return {float(c.percent): int(c.units) for c in profile.cells if c.units}


# --------------------------------------------------------------------------- capture (CUDA)


def capture(
    models_: Sequence[str], batch_sizes: Sequence[int], out_dir: Path, *,
    dtype: str = "fp32", repeats: int = 20, command: str = "",
) -> list[Path]:
    """Trace one eager forward per (model, batch) at 100% on this process's GPU and write
    `out_dir/<model>.json` kernel tables; also times graph replays for the gap term."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    import models
    from knee_profiler.timing import make_input, percentile, time_graph

    if not torch.cuda.is_available():
        raise KernelTableError("tracing kernels needs CUDA")
    props = torch.cuda.get_device_properties(0)
    dev = {
        "name": props.name,
        "sms": props.multi_processor_count,
        "max_threads": props.max_threads_per_multi_processor,
        "regs": getattr(props, "regs_per_multiprocessor", 65536),
        "smem_bytes": getattr(props, "shared_memory_per_multiprocessor", 233472),
        "warp_size": getattr(props, "warp_size", 32),
        "max_blocks": 32,
    }
    tdtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name in models_:
        torch.manual_seed(0)
        model = models.load_model(name).to(device="cuda", dtype=tdtype)
        shape = models.spec(name).inputs[0].shape
        batches: dict[str, Any] = {}
        for b in batch_sizes:
            x = make_input(shape, b, "cuda", 0, tdtype)
            with torch.no_grad():
                for _ in range(3):
                    model(x)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    model(x)
                    torch.cuda.synchronize()
            with tempfile.NamedTemporaryFile("w+", suffix=".json") as f:
                prof.export_chrome_trace(f.name)
                rows = kernels_from_chrome_trace(json.load(open(f.name)))
            try:
                graph_ms: float | None = percentile(time_graph(model, x, 3, repeats), 50)
            except Exception:  # noqa: BLE001 - no graph: no gap term
                graph_ms = None
            batches[str(b)] = {"graph_ms": graph_ms, "kernels": rows}
            del x
        path = out_dir / f"{name}.json"
        path.write_text(json.dumps({
            "schema": SCHEMA, "model": name, "device": dev,
            "meta": {"dtype": dtype, "torch": torch.__version__, "command": command,
                     "traced": "one eager forward at 100% after 3 warm-ups (torch.profiler, "
                               "CUDA activity); graph_ms: p50 of CUDA-graph replays",
                     "columns": ["name", "grid", "block", "registers_per_thread",
                                 "shared_memory_bytes", "duration_us"]},
            "batches": batches,
        }, separators=(",", ":")) + "\n")
        written.append(path)
        del model
        torch.cuda.empty_cache()
    return written


__all__ = [
    "Estimate",
    "Kernel",
    "KernelTable",
    "KernelTableError",
    "SmLimits",
    "blocks_per_sm",
    "capture",
    "default_sms_for_percent",
    "estimate",
    "kernels_from_chrome_trace",
    "load_table",
    "predict_ms",
    "sms_needed",
    "units_from_profile",
]
