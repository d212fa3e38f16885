"""`profiles: auto` for real on CPU: `dstack profile --config` measures tiny_cnn in real
child processes into an empty cache, and a `dstack` runtime started on an empty cache
measures its model first, then serves with that profile (one core each: one slice, one
measuring process, so each takes seconds). No latency is asserted."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dstack.common.config import load_config
from dstack.common.types import load_profile
from dstack.policies import auto_profiles as ap
from dstack.runtime.serving import Runtime

REPO = Path(__file__).resolve().parents[2]
CORE = min(os.sched_getaffinity(0))


def write_config(tmp_path: Path) -> Path:
    path = tmp_path / "deploy.yaml"
    path.write_text(f"policy: dstack\ncores: [{CORE}]\nadapt: {{enabled: false}}\nmodels:\n"
                    "  - {name: tiny_cnn, slo_ms: 2000, max_batch_size: 2}\n")
    return path


def test_dstack_profile_measures_a_config_into_the_cache(tmp_path: Path) -> None:
    path = write_config(tmp_path)
    env = {**os.environ, ap.CACHE_ENV: str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "dstack.cli", "profile", "--config", str(path)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    directory = tmp_path / "cache" / f"cpu-{ap.slug(ap.cpu_name())}-1core"
    assert f"profiles of this machine ({directory.name}) in {directory}" in done.stdout
    assert "profiling tiny_cnn on" in done.stderr and "slice 1/1 (1 of 1 cores)" in done.stderr
    prof = load_profile(directory / "tiny_cnn.json")
    assert prof.batch_sizes == (1, 2) and prof.percentages == (100.0,)
    assert prof.device.name == ap.cpu_name() and prof.measured["repeats"] == ap.AUTO_REPEATS
    row = next(ln for ln in done.stdout.splitlines() if ln.startswith("tiny_cnn"))
    assert [float(x) > 0 for x in row.split()[1:]] == [True, True]


def test_a_dstack_runtime_measures_a_missing_profile_before_it_serves(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(ap.CACHE_ENV, str(tmp_path / "cache"))
    caplog.set_level(logging.INFO, logger="dstack.profiles")
    cfg = load_config(write_config(tmp_path))
    assert cfg.profiles == "auto"

    async def main() -> None:
        rt = Runtime(cfg)
        await rt.start()
        try:
            assert rt.is_ready()
            out = await rt.infer("tiny_cnn", {"input": np.zeros((1, 3, 32, 32), np.float32)})
            assert out["output"].shape == (1, 10)
            assert rt.setup is not None
            assert rt.setup.profiles["tiny_cnn"].device.name == ap.cpu_name()
        finally:
            await rt.stop()

    asyncio.run(main())
    assert (ap.cache_dir(cfg) / "tiny_cnn.json").exists()
    said = [r.getMessage() for r in caplog.records if r.name == "dstack.profiles"]
    assert said[0].startswith(f"profiling tiny_cnn on {ap.cache_dir(cfg).name}: slice 1/1")
