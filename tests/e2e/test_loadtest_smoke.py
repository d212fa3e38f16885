"""A short `make loadtest` against a real server process serving tiny_cnn (models and SLOs
from the server): the summary has every served model, its counts add up, and they match
the server's own counters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.server_process import ServerProcess

ROOT = Path(__file__).resolve().parents[2]


def server_config(tmp_path: Path) -> dict:
    """This module's server (tests/e2e/conftest.py `module_server`)."""
    # A generous SLO: this checks the accounting, not the speed of a shared machine.
    return {
        "policy": "shared",
        "models": [
            {"name": "tiny_cnn", "slo_ms": 5000, "max_batch_size": 4},
            {"name": "tiny", "zoo_name": "tiny_cnn", "slo_ms": 5000, "max_batch_size": 2},
        ],
    }


@pytest.fixture
def server(module_server: ServerProcess) -> str:
    return f"http://{module_server.url}"


def test_make_loadtest_summary_counts_match_the_server(server: str, tmp_path: Path) -> None:
    host = server
    out = tmp_path / "loadtest"
    env = {**os.environ, "MAKEFLAGS": ""}
    run = subprocess.run(
        [
            "make",
            "-s",
            "-o",
            f"{Path(sys.executable).parents[1]}/.installed-stamp",
            "loadtest",
            f"HOST={host}",
            "DURATION=3s",
            "USERS=2",
            "RATE=10",
            f"LOADTEST_OUT={out}",
            f"VENV={Path(sys.executable).parents[1]}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    models = summary["models"]
    assert set(models) == {"tiny_cnn", "tiny"}
    for name, r in models.items():
        assert r["requests"] > 0, name
        assert r["counts_add_up"], r
        assert r["ok"] + r["slo_miss"] + r["refused"] + r["error"] == r["requests"]
        assert r["slo_ms"] == 5000
        assert r["server"]["requests_match"], (name, r)
        assert r["server"]["answered_match"], (name, r)
        assert r["server"]["success"] + r["server"]["failure"] == r["requests"]
    assert (out / "report.html").exists() and (out / "locust_stats.csv").exists()
