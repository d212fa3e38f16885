"""Locust needs only the host: against a real server process it finds the models, their
inputs and SLOs (the config endpoint) itself, headless and in the web UI; a port nothing
listens on is one error line and a non-zero exit. Also `tritonclient` reading the config
of the real runtime."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import tritonclient.http as triton

from tests.e2e.conftest import ROOT, free_port
from tests.e2e.server_process import ServerProcess as Server

LOCUST = str(Path(sys.executable).with_name("locust"))


def server_config(tmp_path: Path) -> dict:
    """This module's server (tests/e2e/conftest.py `module_server`)."""
    # Generous SLOs: this checks that requests are sent and answered, not speed.
    return {
        "policy": "shared",
        "models": [
            {"name": "tiny_cnn", "slo_ms": 5000, "max_batch_size": 4},
            {"name": "tiny", "zoo_name": "tiny_cnn", "slo_ms": 3000, "max_batch_size": 2,
             "max_queue_delay_ms": 4, "priority": "high"},
        ],
    }


@pytest.fixture(scope="module")
def server(module_server: Server) -> Server:
    return module_server


def locust(
    host: str, tmp_path: Path, *extra: str, run_time: str = "3s"
) -> tuple[subprocess.CompletedProcess, Path]:
    outcomes = tmp_path / "outcomes.json"
    run = subprocess.run(
        [LOCUST, "-f", "loadtests/locustfile.py", "--headless", "-u", "4", "-r", "4",
         "-t", run_time, "--host", host, "--only-summary", "--outcomes-json", str(outcomes),
         *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    return run, outcomes


def test_locust_with_only_the_host_sends_requests_that_are_answered(
    server: Server, tmp_path: Path
) -> None:
    run, outcomes = locust(f"http://{server.url}", tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    result = json.loads(outcomes.read_text())
    assert result["slo_ms"] == {"tiny_cnn": 5000, "tiny": 3000}  # from the server
    for model in ("tiny_cnn", "tiny"):
        counts = result["outcomes"][model]
        assert counts["ok"] > 0 and counts["error"] == 0, (model, counts)


def test_slo_ms_overrides_the_server(server: Server, tmp_path: Path) -> None:
    run, outcomes = locust(f"http://{server.url}", tmp_path, "--slo-ms", "tiny=4000", run_time="1s")
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(outcomes.read_text())["slo_ms"] == {"tiny_cnn": 5000, "tiny": 4000}


def test_locust_against_a_closed_port_exits_with_one_error_line(tmp_path: Path) -> None:
    host = f"http://127.0.0.1:{free_port()}"  # bound and released: nothing listens there
    run, outcomes = locust(host, tmp_path)
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and f"cannot reach the server at {host}" in errors[0], run.stderr
    assert "Traceback" not in run.stderr
    assert not outcomes.exists()  # quit before the run


def test_tritonclient_reads_the_runtimes_config(server: Server) -> None:
    client = triton.InferenceServerClient(server.url)
    try:
        cfg = client.get_model_config("tiny")
    finally:
        client.close()
    assert cfg["name"] == "tiny" and cfg["max_batch_size"] == 2
    assert cfg["input"] == [{"name": "input", "data_type": "TYPE_FP32", "dims": [3, 32, 32]}]
    assert cfg["dynamic_batching"]["max_queue_delay_microseconds"] == 4000
    assert cfg["instance_group"][0]["kind"] == "KIND_CPU"
    params = {k: v["string_value"] for k, v in cfg["parameters"].items()}
    # `shared` has no plan: the batch it aims for (the cap) and the whole device.
    assert params == {"slo_ms": "3000", "priority": "high", "rate_rps": "0",
                      "max_queue": "1024", "policy": "shared", "planned_batch_size": "2",
                      "slice_percent": "100"}


def test_web_ui_discovers_the_host_entered_with_the_run(server: Server) -> None:
    port = free_port()
    ui = subprocess.Popen(
        [LOCUST, "-f", "loadtests/locustfile.py", "--web-host", "127.0.0.1", "--web-port",
         str(port)],  # no --host: it comes with the run, as typed into the web UI
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"

    def run(host: str, rows: set[str]) -> dict:
        """Start a run on `host` and wait until it stopped with these rows of stats."""
        form = {"user_count": "2", "spawn_rate": "2", "run_time": "2s", "host": host}
        urllib.request.urlopen(f"{base}/swarm", urllib.parse.urlencode(form).encode(), 5)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            time.sleep(0.5)
            with urllib.request.urlopen(f"{base}/stats/requests", timeout=5) as r:
                stats = json.loads(r.read())
            if stats["state"] == "stopped" and rows <= {s["name"] for s in stats["stats"]}:
                return stats
        raise AssertionError(f"no stopped run with rows {rows}: {stats}")

    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(base, timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline and ui.poll() is None, "no web UI"
                time.sleep(0.2)
        good = run(f"http://{server.url}", {"tiny_cnn", "tiny"})
        answered = {s["name"]: s["num_requests"] - s["num_failures"] for s in good["stats"]}
        assert answered["tiny_cnn"] > 0 and answered["tiny"] > 0, good["stats"]
        closed = f"http://127.0.0.1:{free_port()}"
        bad = run(closed, {closed})
        assert [e["method"] for e in bad["errors"]] == ["DISCOVER"], bad["errors"]
        assert "cannot reach the server" in bad["errors"][0]["error"]
    finally:
        ui.terminate()
        ui.wait(10)
