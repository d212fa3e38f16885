"""A real `dstack serve` process on 127.0.0.1, polled on its readiness endpoint and stopped
by its PID; a module's own server started together with the next module's (`module_server`)."""

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
from types import ModuleType

import pytest
import yaml

from tests.e2e.server_process import ServerProcess, launch, wait_ready

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


# --------------------------------------------------------------------------- started in pairs
# A server's start is one process after another (the server imports torch, then its worker
# does), so it keeps one core busy for ~8 s; two started together on a 2-core machine are
# ready in about the time of one. A module that declares `server_config(tmp_path) -> dict`
# gets its server from `module_server`, started together with the next such module's in
# the run (both ready before a test runs); that module then finds its own waiting, idle.

_AHEAD: dict[str, ServerProcess] = {}  # module name -> its server, started with another's


def _launch_for(module: ModuleType, factory: pytest.TempPathFactory) -> ServerProcess:
    tmp = factory.mktemp("server")
    return launch(module.server_config(tmp), tmp)


def _stop(srv: ServerProcess) -> None:
    """SIGINT, then SIGKILL to the whole group if it has not exited in 30 s (as
    `stop_server`): gracefully, a kill would leave its workers' shared memory behind."""
    try:
        srv.stop(signal.SIGINT, timeout_s=30)
    except subprocess.TimeoutExpired:
        pass  # killed by `stop`


def _skipped(item: pytest.Item) -> bool:
    return item.get_closest_marker("skip") is not None or any(
        m.args and all(a is True for a in m.args) for m in item.iter_markers("skipif"))


def _next_module(request: pytest.FixtureRequest) -> ModuleType | None:
    """The next module in this run (after `request.module`) whose tests use `module_server`."""
    after = False
    for item in request.session.items:
        module = item.module  # type: ignore[attr-defined]
        if module is request.module:
            after = True
        elif after and "module_server" in item.fixturenames and not _skipped(item):
            return module
    return None


@pytest.fixture(scope="module")
def module_server(request: pytest.FixtureRequest,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The server of this module's `server_config(tmp_path)`, ready; stopped after the
    module. Started together with the next module's unless it was itself started ahead."""
    name = request.module.__name__
    for other in [m for m in _AHEAD if m != name]:  # a module that never ran (skipped)
        _stop(_AHEAD.pop(other))
    srv = _AHEAD.pop(name, None)
    ahead = None
    if srv is None:
        srv = _launch_for(request.module, tmp_path_factory)
        if (nxt := _next_module(request)) is not None:
            ahead = _AHEAD[nxt.__name__] = _launch_for(nxt, tmp_path_factory)
    try:
        wait_ready(srv)
        if ahead is not None:
            try:
                wait_ready(ahead)
            except RuntimeError:  # its own module starts it again, and reports the error
                _AHEAD.pop(next(m for m, s in _AHEAD.items() if s is ahead))
        yield srv
    finally:
        _stop(srv)


def pytest_sessionfinish(session: pytest.Session) -> None:
    while _AHEAD:
        _stop(_AHEAD.popitem()[1])
