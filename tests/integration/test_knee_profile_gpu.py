"""On a real NVIDIA GPU: each slice is a fresh process under a private MPS daemon, and the
child proves it is an MPS client. Skipped without CUDA."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dstack.common.types import load_profile
from knee_profiler.sweep import SweepConfig, sweep


@pytest.mark.gpu
def test_profile_tiny_cnn_under_private_mps(tmp_path: Path) -> None:
    if shutil.which("nvidia-cuda-mps-control") is None:
        pytest.skip("nvidia-cuda-mps-control is not installed")
    cfg = SweepConfig(
        models=("tiny_cnn",),
        device="cuda",
        batch_sizes=(1, 8),
        percentages=(20.0, 100.0),
        out_dir=tmp_path,
        warmup=3,
        repeats=10,
        start_mps=True,
    )
    rep = sweep(cfg, progress=False)
    assert rep.children == 2 and rep.measured_cells == 4 and not rep.failed
    p = load_profile(tmp_path / "tiny_cnn.json")
    assert p.mechanism == "mps" and p.device.kind == "cuda" and p.device.unit_kind == "SMs"
    assert p.percentages == (20.0, 100.0) and p.measured["complete"] is True
    for pc in ("20", "100"):
        info = p.measured["slices"][pc]
        assert info["mps_verified_client"] is True
        assert info["active_thread_percentage"] == pc
    assert all(0 < c.p50_ms <= c.p95_ms for c in p.cells)
    assert p.memory_mb[8] > 0
