"""A real `dstack serve` process on 127.0.0.1, polled on its readiness endpoint and stopped
by its PID."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    url: str  # host:port, as tritonclient wants it
    proc: subprocess.Popen[bytes]
    log: Path
    config: Path

    def get(self, path: str) -> int:
        try:
            with urllib.request.urlopen(f"http://{self.url}{path}", timeout=2) as r:
                return int(r.status)
        except urllib.error.HTTPError as e:
            return int(e.code)
        except OSError:
            return 0


def start_server(cfg: dict, tmp_path: Path, timeout_s: float = 180) -> Server:
    cfg_path = tmp_path / "deploy.yaml"
    port = free_port()
    cfg = {**cfg, "server": {**cfg.get("server", {}), "host": "127.0.0.1", "port": port}}
    cfg_path.write_text(yaml.safe_dump(cfg))
    log = tmp_path / "server.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dstack.cli", "serve", "--config", str(cfg_path)],
        cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT,
        start_new_session=True,  # its workers share its process group: stopped together
    )
    srv = Server(f"127.0.0.1:{port}", proc, log, cfg_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        if srv.get("/v2/health/ready") == 200:
            return srv
        time.sleep(0.2)
    stop_server(srv)
    raise RuntimeError(f"server not ready in {timeout_s} s:\n{log.read_text()}")


def stop_server(srv: Server) -> None:
    if srv.proc.poll() is None:
        srv.proc.send_signal(signal.SIGINT)
        try:
            srv.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(srv.proc.pid, signal.SIGKILL)
            srv.proc.wait(10)


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """Start servers for a test module; every one is stopped when the module is done."""
    started: list[Server] = []

    def _start(cfg: dict) -> Server:
        srv = start_server(cfg, tmp_path_factory.mktemp("server"))
        started.append(srv)
        return srv

    yield _start
    for srv in started:
        stop_server(srv)
