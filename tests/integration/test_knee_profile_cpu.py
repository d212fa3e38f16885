"""The real thing on CPU: `python -m knee_profiler.cli profile` (not installed, only
PYTHONPATH) measures tiny_cnn in real child processes pinned to real core sets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dstack.common.types import load_profile
from knee_profiler.sweep import expressible_percentages

REPO = Path(__file__).resolve().parents[2]


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "knee_profiler.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_profile_tiny_cnn_on_cpu(tmp_path: Path) -> None:
    pcts = expressible_percentages("cpu")  # 50, 100 on two cores
    ncores = len(os.sched_getaffinity(0))
    args = [
        "profile",
        "tiny_cnn",
        "--device",
        "cpu",
        "--batch-sizes",
        "1,4",
        "--percentages",
        ",".join(f"{p:g}" for p in pcts),
        "--repeats",
        "5",
        "--warmup",
        "1",
        "--out",
        "out",
        "--no-progress",
    ]
    r = cli(*args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"measured {2 * len(pcts)} cells in {len(pcts)} processes" in r.stdout

    path = tmp_path / "out" / "tiny_cnn.json"
    p = load_profile(path)
    assert p.model == "tiny_cnn" and p.mechanism == "cpu-affinity"
    assert p.device.kind == "cpu" and p.device.units == ncores
    assert p.batch_sizes == (1, 4) and list(p.percentages) == pcts
    for b in (1, 4):
        for pc in pcts:
            c = p.cell(b, pc)
            assert 0 < c.p50_ms <= c.p95_ms
            assert c.units == round(pc / 100 * ncores)
        assert p.knee[b] in pcts
        assert b in p.memory_mb
    # each slice really ran on its own core set with as many threads
    for pc in pcts:
        seen = p.measured["slices"][f"{pc:g}"]
        k = round(pc / 100 * ncores)
        assert len(seen["cores"]) == k and seen["threads"] == k
    # the loader round trip is lossless
    assert load_profile(path) == p
    assert json.loads(path.read_text())["schema"] == "dstack.profile/1"

    # a second run without --force measures nothing and leaves the numbers alone
    before = path.read_text()
    r2 = cli(*args, cwd=tmp_path)
    assert r2.returncode == 0, r2.stderr
    assert "measured 0 cells in 0 processes, kept" in r2.stdout
    assert load_profile(path).cells == p.cells
    assert json.loads(before)["cells"] == json.loads(path.read_text())["cells"]

    shown = cli("show", str(path), cwd=tmp_path)
    assert shown.returncode == 0 and "tiny_cnn" in shown.stdout and "knee%" in shown.stdout
