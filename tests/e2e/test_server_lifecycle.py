"""Start-up failures and shutdown of a real `dstack serve` process: a start-up error is one
line on stderr and exit code 2, with nothing saying ready; SIGTERM and SIGINT both drain
the requests in flight and exit 0, and an upload still arriving does not hold them up."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.server_process import ROOT, TINY, ServerProcess, launch, wait_ready
from tests.integration.test_runtime_policies import alive, write_cpu_profiles

LONG_S = 60  # grace and body timeout: far longer than the test may wait for an exit
INFER = "/v2/models/tiny_cnn/infer"


def _infer_json() -> bytes:
    return json.dumps({"inputs": [{"name": "input", "shape": [1, 3, 32, 32], "datatype": "FP32",
                                   "data": [0.5] * 3072}]}).encode()


def _post_in_thread(srv: ServerProcess, out: list) -> threading.Thread:
    def run() -> None:
        req = urllib.request.Request(f"http://{srv.url}{INFER}", data=_infer_json(),
                                     method="POST")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                out.append((r.status, json.loads(r.read())))
        except Exception as e:  # noqa: BLE001 - the test reports what happened
            out.append((0, repr(e)))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("frontends", [1, 2], ids=["one-process", "two-front-ends"])
def test_sigterm_and_sigint_drain_and_exit_0(tmp_path: Path, frontends: int) -> None:
    # A batch waits up to 1.5 s for company: a lone request is in flight for that long.
    slow = {**TINY, "max_queue_delay_ms": 1500}
    cfg = {"policy": "shared", "models": [slow], "server": {
        "shutdown_grace_s": LONG_S, "body_timeout_s": LONG_S, "frontends": frontends}}
    servers: dict[signal.Signals, ServerProcess] = {}
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):  # both start at once
            (tmp_path / sig.name).mkdir()
            servers[sig] = launch(cfg, tmp_path / sig.name)
        for srv in servers.values():
            wait_ready(srv)
        # Both servers at once (each its own request, upload and signal): their drains
        # overlap, which a server cannot see.
        fronts, results, threads, uploads = {}, {}, {}, {}
        for sig, srv in servers.items():
            fronts[sig] = srv.front_ends()
            assert len(fronts[sig]) == (frontends if frontends > 1 else 0)
            results[sig] = []
            threads[sig] = _post_in_thread(srv, results[sig])
            uploads[sig] = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
            uploads[sig].sendall(f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: 9000"
                                 "\r\n\r\n{".encode())
        time.sleep(0.5)  # the requests are queued, the uploads stalled
        for sig, srv in servers.items():
            srv.proc.send_signal(sig)
        for sig in servers:
            raw = uploads[sig].recv(4096)
            uploads[sig].close()
            assert raw.startswith(b"HTTP/1.1 503"), raw  # not held until the grace ends
            assert "shutting down" in json.loads(raw.split(b"\r\n\r\n", 1)[1])["error"]
        for sig, srv in servers.items():
            threads[sig].join(30)
            got = results[sig]
            assert got and got[0][0] == 200, (got, srv.text())
            assert len(got[0][1]["outputs"][0]["data"]) == 10
        for sig, srv in servers.items():
            try:  # the signal was sent above: only wait (a second one would force quit)
                code = srv.proc.wait(LONG_S / 2)
            except subprocess.TimeoutExpired:
                srv.kill()
                raise
            assert code == 0, srv.text()
            assert "dstack stopped" in srv.text()
            # the front ends drained and exited with it, and none was restarted meanwhile
            assert not [pid for pid in fronts[sig] if Path(f"/proc/{pid}").exists()]
            assert "starting another" not in srv.text()
    finally:
        for srv in servers.values():
            srv.kill()


def _free_port_in_use() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def _fail_to_start(args: list[str], cfg_text: str, tmp: Path,
                   env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    tmp.mkdir()
    (tmp / "deploy.yaml").write_text(cfg_text)
    return subprocess.Popen(
        [sys.executable, "-m", "dstack.cli", "serve", "--config", str(tmp / "deploy.yaml"),
         *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **(env or {})}, start_new_session=True)


def test_start_up_errors_are_one_line_and_exit_2(tmp_path: Path) -> None:
    busy = _free_port_in_use()
    port = busy.getsockname()[1]
    tiny = "models: [{name: tiny_cnn, slo_ms: 10000}]\n"
    (tmp_path / "token").write_text("t\n")
    cases = {  # name: (extra args, config, env, a word the error line must contain)
        "no profiles dir": ([], "policy: dstack\nprofiles: nowhere\n" + tiny, None,
                            "no such profile directory"),
        "port in use": (["--host", "127.0.0.1", "--port", str(port)], tiny, None,
                        "cannot listen"),
        "token file missing": ([], "server: {auth_token_file: nope.txt}\n" + tiny, None,
                               "auth_token_file"),
        "token twice": ([], f"server: {{auth_token_file: {tmp_path / 'token'}}}\n" + tiny,
                        {"DSTACK_AUTH_TOKEN": "x"}, "DSTACK_AUTH_TOKEN"),
        # on 0.0.0.0 without a token: a warning, then the error (nothing is served)
        "tls cert missing": (["--host", "0.0.0.0"], "server: {port: 0, tls_certfile: c.pem, "
                             "tls_keyfile: k.pem}\n" + tiny, None, "tls"),
        "bad config value": ([], "server: {max_connections: 0}\n" + tiny, None,
                             "max_connections"),
        "unknown model": ([], "server: {port: 0}\nmodels: [{name: no_such_model}]\n", None,
                          "no_such_model"),
        "front-end core missing": ([], "server: {port: 0, cores: [4095]}\n" + tiny, None,
                                   "server.cores"),
        # the worker's traceback was squashed into the line
        "weights not weights": ([], "server: {port: 0}\nmodels: [{name: tiny_cnn, "
                                f"slo_ms: 10000, weights: {tmp_path / 'token'}}}]\n", None,
                                "cannot read weights"),
    }
    procs = {name: _fail_to_start(args, cfg, tmp_path / name.replace(" ", "_"), env)
             for name, (args, cfg, env, _) in cases.items()}
    stderr: dict[str, str] = {}
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=120)
            stderr[name] = err
            errors = [line for line in err.splitlines() if "error" in line.lower()]
            assert proc.returncode == 2, (name, err)
            assert len(errors) == 1 and errors[0].startswith("error: "), (name, err)
            assert cases[name][3].lower() in errors[0].lower(), (name, errors)
            assert "Traceback" not in errors[0], (name, errors)
            assert "Traceback" not in err and "serving" not in out + err, (name, err)
        assert "WARNING" in stderr["tls cert missing"]
        assert "without authentication" in stderr["tls cert missing"]
    finally:
        busy.close()
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_a_server_killed_with_its_whole_process_group_leaves_no_shared_memory(
        tmp_path: Path) -> None:
    """Its workers' arenas are memory files of the server process, named nowhere: a kill
    -9 of the server, its workers and its resource tracker together (as when a Ray node
    is removed) leaves nothing in /dev/shm, where named blocks stayed until a reboot."""
    before = set(os.listdir("/dev/shm"))
    srv = launch({"policy": "shared", "models": [TINY, {**TINY, "name": "tiny_b",
                                                        "zoo_name": "tiny_cnn"}]}, tmp_path)
    try:
        wait_ready(srv)
        req = urllib.request.Request(f"http://{srv.url}{INFER}", data=_infer_json(),
                                     method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200
        arenas = {f.stat().st_ino for f in Path(f"/proc/{srv.pid}/fd").iterdir()
                  if os.readlink(f).startswith("/memfd:dstack-arena")}
        assert len(arenas) == 2  # one per worker, open in the server process
        workers = [int(p) for p in (Path(f"/proc/{srv.pid}/task") / str(srv.pid) /
                                    "children").read_text().split()]
    finally:
        srv.kill()
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{w}").exists() for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(os.listdir("/dev/shm")) - before == set()


def _descendants(pid: int) -> list[int]:
    """Every process under `pid` (children of any of its threads, theirs, ...)."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        for t in Path(f"/proc/{p}/task").iterdir():
            with contextlib.suppress(OSError):
                kids = [int(c) for c in (t / "children").read_text().split()]
                out += kids
                todo += kids
    return out


def _cores(pid: int) -> set[int]:
    """The cores a process's main thread may run on."""
    listed = Path(f"/proc/{pid}/status").read_text().split("Cpus_allowed_list:")[1].split()[0]
    out: set[int] = set()
    for part in listed.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def test_the_solver_sits_with_the_server_and_a_server_killed_alone_leaves_no_process(
        tmp_path: Path) -> None:
    """The re-planner's solver process is kept on the server's own cores (where its solves
    cost the workers least, as they did in a thread of the server). A kill -9 of the
    server process alone (its group spared, as an OOM kill does): its workers and the
    solver see it gone and exit, rather than live on as orphans (the solver did, before it
    watched its parent)."""
    write_cpu_profiles(tmp_path)
    two = [{**TINY, "name": n, "zoo_name": "tiny_cnn", "rate_rps": 5, "slo_ms": slo}
           for n, slo in (("tiny_a", 10000), ("tiny_b", 5000))]  # the server beside tiny_a
    srv = launch({"policy": "dstack", "profiles": str(tmp_path), "models": two,
                  "adapt": {"solve_in": "process"}}, tmp_path)  # (auto: a thread on CPU)
    children: list[int] = []
    try:
        wait_ready(srv)
        solver = int(re.search(r"re-plans solved in process (\d+)", srv.text())[1])  # type: ignore[index]
        if len(os.sched_getaffinity(0)) >= 2:  # a core each model's: the server on one
            assert _cores(srv.pid) < os.sched_getaffinity(0)
        assert _cores(solver) == _cores(srv.pid)
        children = _descendants(srv.pid)  # the solver, and the workers under their forkserver
        started = [c for c in children
                   if re.search(rb"spawn_main|forkserver", Path(f"/proc/{c}/cmdline").read_bytes())]
        assert len(started) >= 3, children  # the solver, the forkserver and a worker
        os.kill(srv.pid, signal.SIGKILL)
        srv.proc.wait(10)
        deadline = time.monotonic() + 15
        while any(alive(c) for c in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [c for c in children if alive(c)], [
            Path(f"/proc/{c}/cmdline").read_text() for c in children if alive(c)]
    finally:
        srv.kill()
        for c in children:
            if alive(c):
                with contextlib.suppress(ProcessLookupError):  # (it may end meanwhile)
                    os.kill(c, signal.SIGKILL)
