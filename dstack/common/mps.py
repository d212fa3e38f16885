"""Talking to the CUDA MPS control daemon through `nvidia-cuda-mps-control`.

Standard library only (imports no torch: the parent must not create a CUDA context). Every
function takes the environment to use, so that a private daemon (own pipe and log
directories) and the system's default one are handled alike. Used by the runtime's MPS slice
backend (`dstack.common.slices.MpsSlices`), its workers (`verify_client`) and the knee profiler.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

CONTROL = "nvidia-cuda-mps-control"


class MpsError(RuntimeError):
    """MPS was asked for and is not there, or the daemon misbehaved."""


def control(command: str, env: Mapping[str, str], timeout_s: float = 15.0) -> str:
    """Send one command to the control daemon; its reply. Raises MpsError when no daemon
    answers (the client exits non-zero) or the tool is missing."""
    exe = shutil.which(CONTROL, path=env.get("PATH", os.defpath))
    if exe is None:
        raise MpsError(f"{CONTROL} not found on PATH: is the NVIDIA driver's MPS installed?")
    try:
        r = subprocess.run(
            [exe],
            input=command + "\n",
            capture_output=True,
            text=True,
            env=dict(env),
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired as e:
        raise MpsError(f"{CONTROL}: no answer to {command!r} within {timeout_s:g} s") from e
    if r.returncode != 0:
        out = (r.stdout + r.stderr).strip()
        raise MpsError(f"no MPS control daemon answers ({CONTROL} exit {r.returncode}: {out})")
    return r.stdout


def server_list(env: Mapping[str, str]) -> list[int]:
    """PIDs of the MPS servers the daemon runs (one per user with live clients)."""
    return [int(t) for t in control("get_server_list", env).split() if t.isdigit()]


def client_list(env: Mapping[str, str], server_pid: int) -> list[int]:
    """PIDs of the clients of one MPS server."""
    return [int(t) for t in control(f"get_client_list {server_pid}", env).split() if t.isdigit()]


def daemon_answers(env: Mapping[str, str]) -> bool:
    try:
        control("get_server_list", env)
    except MpsError:
        return False
    return True


@dataclass
class PrivateDaemon:
    """A control daemon we started, with private pipe and log directories. `env` is what
    clients (our measuring children) need to reach it."""

    pipe_dir: str
    log_dir: str
    env: dict[str, str] = field(default_factory=dict)

    def stop(self) -> None:
        """Ask it to quit (idempotent); removes nothing the user owns."""
        try:
            control("quit", self.env, timeout_s=30)
        except MpsError:
            pass
        for d in (self.pipe_dir, self.log_dir):
            shutil.rmtree(d, ignore_errors=True)


def start_private_daemon(base_env: Mapping[str, str], wait_s: float = 15.0) -> PrivateDaemon:
    """`nvidia-cuda-mps-control -d` with temporary pipe/log directories; returns once it
    answers. Raises MpsError if it does not."""
    exe = shutil.which(CONTROL, path=base_env.get("PATH", os.defpath))
    if exe is None:
        raise MpsError(f"{CONTROL} not found on PATH: cannot start an MPS daemon")
    pipe_dir = tempfile.mkdtemp(prefix="dstack-mps-pipe-")
    log_dir = tempfile.mkdtemp(prefix="dstack-mps-log-")
    env = {**base_env, "CUDA_MPS_PIPE_DIRECTORY": pipe_dir, "CUDA_MPS_LOG_DIRECTORY": log_dir}
    daemon = PrivateDaemon(pipe_dir, log_dir, env)
    r = subprocess.run([exe, "-d"], env=env, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        daemon.stop()
        raise MpsError(f"{CONTROL} -d failed (exit {r.returncode}): {(r.stdout + r.stderr)}")
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if daemon_answers(env):
            return daemon
        time.sleep(0.2)
    log = _tail(os.path.join(log_dir, "control.log"))
    daemon.stop()
    raise MpsError(f"started {CONTROL} -d but it does not answer; control.log: {log}")


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path) as f:
            return f.read()[-n:]
    except OSError:
        return "(none)"


PIPE_VARS = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")


def client_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables a client process needs to reach the daemon that `env` reaches."""
    return {k: env[k] for k in PIPE_VARS if k in env}


def verify_client(env: Mapping[str, str], pid: int | None = None) -> list[int]:
    """Check that `pid` (default: this process), which must already have created its CUDA
    context, is a client of one of the daemon's MPS servers; returns the server PIDs.

    A process whose context was made while no daemon answered on its pipe directory runs
    as a plain CUDA process: its thread percentage is silently not enforced. Raises
    MpsError naming the pipe directory and the clients seen."""
    me = os.getpid() if pid is None else pid
    pipe = env.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps (default)")
    servers = server_list(env)
    if not servers:
        raise MpsError(f"the MPS daemon on {pipe} runs no server although pid {me} made a "
                       "CUDA context: that context is not under MPS")
    clients = {c for s in servers for c in client_list(env, s)}
    if me not in clients:
        raise MpsError(
            f"pid {me} is not among the clients {sorted(clients)} of the MPS servers "
            f"{servers} on {pipe}: it runs outside MPS, so its slice would not be enforced"
        )
    return servers
