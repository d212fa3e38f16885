"""A `dstack serve` process on 127.0.0.1 port 0 for the reliability tests: its port is read
from its "serving" log line, it is polled on its readiness endpoint, and it is stopped by
its PID (its workers share its process group, killed with it if it does not exit)."""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

from bench.servers import front_ends

ROOT = Path(__file__).resolve().parents[2]
TINY = {"name": "tiny_cnn", "slo_ms": 10000, "max_batch_size": 8, "max_queue_delay_ms": 2}
SERVING = re.compile(r"dstack (?:cluster )?serving https?://127\.0\.0\.1:(\d+)")


@dataclass
class ServerProcess:
    proc: subprocess.Popen[bytes]
    log: Path
    port: int = 0

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def get(self, path: str, headers: dict[str, str] | None = None) -> int:
        req = urllib.request.Request(f"http://{self.url}{path}", headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return int(r.status)
        except urllib.error.HTTPError as e:
            return int(e.code)
        except OSError:
            return 0

    def front_ends(self) -> list[int]:
        """PIDs of the server's front-end processes (`server.frontends` > 1)."""
        return front_ends(self.pid)

    def fds(self) -> int:
        """Open sockets of the server process and its front ends (not of its workers)."""
        return sum(1 for pid in (self.pid, *self.front_ends())
                   for f in Path(f"/proc/{pid}/fd").iterdir()
                   if os.readlink(f).startswith("socket:"))

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 30) -> int:
        """Send `sig`; the exit code (SIGKILL to the whole group after `timeout_s`)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def launch(cfg: dict, tmp_path: Path, env: dict[str, str] | None = None,
           command: tuple[str, ...] = ("serve",)) -> ServerProcess:
    """Start `dstack serve` (or `command`: ("cluster", "serve")) on `cfg` (host and port
    forced to 127.0.0.1:0); do not wait."""
    cfg = {**cfg, "server": {**cfg.get("server", {}), "host": "127.0.0.1", "port": 0}}
    cfg_path = tmp_path / "deploy.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    log = tmp_path / "server.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dstack.cli", *command, "--config", str(cfg_path)],
        cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})}, start_new_session=True)
    return ServerProcess(proc, log)


def wait_ready(srv: ServerProcess, timeout_s: float = 180) -> ServerProcess:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if srv.proc.poll() is not None:
            raise RuntimeError(f"server exited with {srv.proc.returncode}:\n{srv.text()}")
        if not srv.port and (m := SERVING.search(srv.text())):
            srv.port = int(m.group(1))
        if srv.port and srv.get("/v2/health/ready") == 200:
            return srv
        time.sleep(0.1)
    srv.kill()
    raise RuntimeError(f"server not ready in {timeout_s} s:\n{srv.text()}")


def loopback(ip: str) -> bool:
    """Whether a listening address is loopback ('::ffff:127.0.0.1' included)."""
    a = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
        a = a.ipv4_mapped
    return a.is_loopback
