"""A short `make loadtest` against a real server process serving tiny_cnn: the summary
has every served model, its counts add up, and they match the server's own counters."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DSTACK = Path(sys.executable).with_name("dstack")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    cfg = tmp_path / "deploy.yaml"
    # A generous SLO: this checks the accounting, not the speed of a shared machine.
    cfg.write_text(
        "policy: shared\nmodels:\n"
        "  - {name: tiny_cnn, slo_ms: 5000, max_batch_size: 4}\n"
        "  - {name: tiny, zoo_name: tiny_cnn, slo_ms: 5000, max_batch_size: 2}\n"
    )
    log = (tmp_path / "server.log").open("w+")
    proc = subprocess.Popen(
        [str(DSTACK), "serve", "--config", str(cfg), "--port", "0"],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    try:
        host = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if host is None:
                m = re.search(r"serving (http://127\.0\.0\.1:\d+)", Path(log.name).read_text())
                host = m.group(1) if m else None
            if host is not None:
                try:
                    with urllib.request.urlopen(host + "/v2/health/ready", timeout=2):
                        break
                except OSError:
                    pass
            time.sleep(0.2)
        else:
            pytest.fail(f"server did not get ready:\n{Path(log.name).read_text()[-3000:]}")
        assert host is not None
        yield host, cfg
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


def test_make_loadtest_summary_counts_match_the_server(
    server: tuple[str, Path], tmp_path: Path
) -> None:
    host, cfg = server
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
            f"CONFIG={cfg}",
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
