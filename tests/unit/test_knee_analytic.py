"""The analytic knee estimate on a synthetic kernel table whose answer is worked out by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from knee_profiler.analytic import (
    SCHEMA,
    Kernel,
    SmLimits,
    blocks_per_sm,
    default_sms_for_percent,
    estimate,
    kernels_from_chrome_trace,
    load_table,
    predict_ms,
    sms_needed,
)
from knee_profiler.cli import main

# A 10-SM device, 2048 threads, 64K registers, 100 KB shared memory per SM.
LIM = SmLimits(sms=10, max_threads=2048, regs=65536, smem_bytes=100_000, max_blocks=32)
# Wide: 40 blocks of 1024 threads -> 2 per SM (threads) -> can use all 10 SMs.
WIDE = Kernel("wide", (40, 1, 1), (1024, 1, 1), 16, 0, 1.0)
# Narrow: 4 blocks -> 4 SMs at most; fast on any slice of >= 4 SMs.
NARROW = Kernel("narrow", (2, 2, 1), (128, 1, 1), 32, 0, 1.0)
# Shared-memory bound: 48 KB per block (+1 KB reserved) -> 2 per SM; 12 blocks -> 6 SMs.
SMEM = Kernel("smem", (12, 1, 1), (64, 1, 1), 32, 48_000, 0.5)


def test_resident_blocks_follow_the_tightest_limit() -> None:
    assert blocks_per_sm(WIDE, LIM) == 2  # 2048 / 1024 threads
    assert blocks_per_sm(NARROW, LIM) == 16  # 2048 / 128 threads (regs allow 16 too)
    assert blocks_per_sm(SMEM, LIM) == 2  # 100000 // 49000
    heavy = Kernel("regs", (1, 1, 1), (256, 1, 1), 255, 0, 1.0)
    assert blocks_per_sm(heavy, LIM) == 1  # 255 regs -> 8192 per warp x 8 warps = 64K
    assert [sms_needed(k, LIM) for k in (WIDE, NARROW, SMEM)] == [10, 1, 6]


def test_latency_scales_by_waves_and_the_knee_is_where_it_stops() -> None:
    kernels = [WIDE, NARROW, SMEM]
    # 100%: every kernel at its measured duration: 1 + 1 + 0.5, plus the gap.
    assert predict_ms(kernels, LIM, 10, gap_ms=0.25) == pytest.approx(2.75)
    # 5 SMs: wide 1 x 10/5, narrow 1 (needs 1), smem 0.5 x 6/5 = 0.6 -> 3.6
    assert predict_ms(kernels, LIM, 5) == pytest.approx(3.6)
    # percent p -> p/10 SMs (given map): 90% -> 9 SMs: 10/9 + 1 + 0.5 = 2.611 <= 1.1 x 2.5
    sms_for = {float(p): p // 10 for p in range(10, 101, 10)}
    est = estimate(kernels, LIM, [float(p) for p in range(10, 101, 10)], 1,
                   epsilon=0.10, sms_for=sms_for)
    assert est.curve[100.0] == pytest.approx(2.5)
    assert est.curve[80.0] == pytest.approx(10 / 8 + 1 + 0.5)  # 2.75 = exactly 1.1 x 2.5
    assert est.knee == 80.0
    assert estimate(kernels, LIM, [50.0, 100.0], 1, epsilon=0.5, sms_for=sms_for).knee == 50.0


def test_default_percent_to_sm_map_rounds_down_to_whole_tpcs() -> None:
    assert default_sms_for_percent(10, 132) == 12
    assert default_sms_for_percent(50, 132) == 66
    assert default_sms_for_percent(100, 132) == 132
    assert default_sms_for_percent(1, 132) == 2


def _table(tmp_path: Path) -> Path:
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "wide", "ts": 1, "dur": 1000.0,
         "args": {"grid": [40, 1, 1], "block": [1024, 1, 1], "registers per thread": 16,
                  "shared memory": 0}},
        {"ph": "X", "cat": "gpu_memset", "name": "memset", "ts": 2, "dur": 5.0, "args": {}},
        {"ph": "X", "cat": "kernel", "name": "narrow", "ts": 3, "dur": 1000.0,
         "args": {"grid": [2, 2, 1], "block": [128, 1, 1], "registers per thread": 32,
                  "shared memory": 0}},
    ]}
    rows = kernels_from_chrome_trace(trace)
    assert [r[0] for r in rows] == ["wide", "narrow"]
    d = {"schema": SCHEMA, "model": "m",
         "device": {"name": "Fake GPU", "sms": 10, "max_threads": 2048, "regs": 65536,
                    "smem_bytes": 100000, "max_blocks": 32, "warp_size": 32},
         "batches": {"1": {"graph_ms": 2.5, "kernels": rows}}}
    (tmp_path / "m.json").write_text(json.dumps(d))
    return tmp_path


def test_table_file_round_trip_and_gap_term(tmp_path: Path) -> None:
    t = load_table(_table(tmp_path) / "m.json")
    assert t.limits.sms == 10 and [k.name for k in t.batches[1]] == ["wide", "narrow"]
    assert t.gap_ms(1) == pytest.approx(0.5)  # graph 2.5 ms - kernels 2.0 ms


def test_cli_prints_the_predicted_knee(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    d = _table(tmp_path)
    # 10 SMs, default map (even SMs): 50% -> 4 SMs: wide 10/4=2.5 + 1 + 0.5 gap = 4.0;
    # 100% = 2.5; 90% -> 8 SMs: 1.25 + 1.5 = 2.75 <= 2.75 -> knee 90 at eps 0.1.
    assert main(["analytic", "m", "--traces", str(d), "--percentages", "50,90,100"]) == 0
    out = capsys.readouterr().out
    row = [ln for ln in out.splitlines() if ln.split()[:1] == ["1"]][0].split()
    assert row[2] == "2.500" and row[4] == "90"
