"""A real `dstack serve` for a benchmark: a subprocess on a free 127.0.0.1 port, polled until
ready, stopped by its PID on every path (SIGINT, then kill); its configs, its statistics,
and what its processes use (/proc)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
DSTACK = Path(sys.executable).with_name("dstack")
#: How to start the CLI: the installed script, else this interpreter on the source tree
#: (a checkout run with PYTHONPATH set, as on a lent GPU machine with nothing installed).
DSTACK_CMD = [str(DSTACK)] if DSTACK.exists() else [sys.executable, "-m", "dstack.cli"]


@dataclass
class Server:
    host: str  # http://127.0.0.1:PORT
    pid: int
    log: Path
    worker_pids: dict[str, int] = field(default_factory=dict)

    @property
    def port(self) -> int:
        return int(self.host.rsplit(":", 1)[1])

    def worker_pid(self, model: str) -> int:
        """The PID of `model`'s worker now: the last "worker M ready ... (pid P" in the log."""
        found = re.findall(rf"worker {re.escape(model)} ready.*?\(pid (\d+)", self.log.read_text())
        if not found:
            raise RuntimeError(f"no 'worker {model} ready (pid ...)' line in {self.log}")
        return int(found[-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serving(config: Path, log: Path, ready_timeout_s: float = 180, *,
            command: tuple[str, ...] = ("serve",), grace_s: float = 20) -> Iterator[Server]:
    """A `dstack serve` (or `command`, e.g. `("cluster", "serve")`) subprocess on
    127.0.0.1, ready; stopped by PID on every path (SIGINT, killed after `grace_s`)."""
    port = free_port()
    host = f"http://127.0.0.1:{port}"
    with log.open("w") as lf:
        proc = subprocess.Popen(
            [*DSTACK_CMD, *command, "--config", str(config), "--host", "127.0.0.1",
             "--port", str(port)], stdout=lf, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        wait_ready(proc, [host + "/v2/health/ready"], log, ready_timeout_s, " ".join(command))
        srv = Server(host, proc.pid, log)
        for m, pid in re.findall(r"worker (\S+) ready (?:in \S+ s )?\(pid (\d+)", log.read_text()):
            srv.worker_pids[m] = int(pid)
        yield srv
    finally:
        interrupt(proc, grace_s)


def wait_ready(proc: subprocess.Popen[Any], urls: list[str], log: Path, timeout_s: float,
               what: str = "server") -> None:
    """Poll each of `urls` in turn until it answers; raise with the log's tail if the
    process exits first or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    while pending:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready in {timeout_s:g} s; see {log}")
        try:
            urllib.request.urlopen(pending[0], timeout=2).close()
            pending.pop(0)
        except OSError:
            time.sleep(0.3)


def interrupt(proc: subprocess.Popen[Any], grace_s: float) -> None:
    """Ctrl-C for a server we started (it stops its own children), killed by PID if it
    has not exited after `grace_s`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def model_ready(host: str, model: str) -> bool:
    try:
        with urllib.request.urlopen(f"{host}/v2/models/{model}/ready", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def model_stats(host: str, model: str) -> dict[str, int]:
    """The server's counters for `model` (Triton's statistics extension)."""
    s = get_json(f"{host}/v2/models/{model}/stats")["model_stats"][0]
    return {"inference_count": s["inference_count"], "execution_count": s["execution_count"],
            "compute_ns": s["inference_stats"]["compute_infer"]["ns"]}


def models_of(config: Path) -> list[dict[str, Any]]:
    """The `models` entries of a config file, as written (name, slo_ms, rate_rps, ...)."""
    return yaml.safe_load(config.read_text())["models"]


def rates_slos(config: Path) -> tuple[dict[str, float], dict[str, float]]:
    """Each model's `rate_rps` and `slo_ms` in a config file."""
    models = models_of(config)
    return ({m["name"]: float(m["rate_rps"]) for m in models},
            {m["name"]: float(m["slo_ms"]) for m in models})


def write_config(src: Path, path: Path, **top: Any) -> Path:
    """`src` with top-level keys replaced by `top` (None: left as written), its profiles
    made absolute, written to `path`."""
    cfg = yaml.safe_load(src.read_text())
    if cfg.get("profiles") not in (None, "auto"):
        cfg["profiles"] = str((src.parent / cfg["profiles"]).resolve())
    cfg.update({k: v for k, v in top.items() if v is not None})
    path.write_text(yaml.safe_dump(cfg))
    return path


# ------------------------------------------------------------------ processes (/proc)


def front_ends(pid: int) -> list[int]:
    """PIDs of the front-end processes of the server `pid` (`server.frontends` > 1)."""
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(k) for k in kids if b"server.frontends" in Path(f"/proc/{k}/cmdline").read_bytes()]


def rss_mb(pid: int, key: str = "VmRSS:") -> float:
    """RSS or, with key="VmHWM:", peak RSS of a process in MB; NaN if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return float("nan")


def peak_rss_mb(srv: Server) -> dict[str, float]:
    """Peak RSS (MB) of the server and each worker since they started, read once while
    they still run (sampling it on a thread cost ~0.2 ms of CPU per request)."""
    return {"server": rss_mb(srv.pid, "VmHWM:"),
            **{f"worker {m}": rss_mb(pid, "VmHWM:") for m, pid in srv.worker_pids.items()}}


def cpu_user_sys_s(pid: int) -> tuple[float, float]:
    """CPU seconds a process has used in user space and in the kernel; NaNs if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name
        tick = os.sysconf("SC_CLK_TCK")
        return int(fields[11]) / tick, int(fields[12]) / tick
    except (OSError, IndexError, ValueError):
        return float("nan"), float("nan")


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used; NaN if it is gone."""
    return sum(cpu_user_sys_s(pid))


def open_sockets(pid: int) -> int:
    """Open sockets of a process (-1 if it cannot be read)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return -1
    n = 0
    for fd in fds:
        try:
            n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:
            pass  # closed while listed
    return n
