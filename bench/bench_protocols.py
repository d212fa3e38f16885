"""The server's CPU per request by protocol, side by side in one run against one server:
HTTP with binary tensors, gRPC, and system shared memory (over HTTP and over gRPC), each
a 600 KB batch-1 request of a model of next to no compute (`pool_linear`), sent in closed
loop by `--clients` threads of unmodified tritonclient clients, and the median time a
request took (`--clients 1`: the unloaded latency); with `--triton-python`, Triton
(`bench.bench_triton`) beside it. Written to out/bench/protocols.json
(docs/benchmarks.md, docs/shared-memory.md).

    python -m bench.bench_protocols --seconds 10 --clients 8,64 [--triton-python PYTHON]
        [--frontends N] [--protocols http,grpc,...] [--grpc-floor]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
import yaml
from tritonclient.utils import InferenceServerException

from bench.bench_triton import triton_serving
from bench.servers import ROOT, cpu_user_sys_s, free_port, get_json, serving

OUT = ROOT / "out" / "bench"
MODEL = "image"
CONFIG = {"device": "cpu", "policy": "shared", "worker_nice": 0, "models": [
    # an SLO no request misses on a busy machine: every request is answered, none refused
    {"name": MODEL, "zoo_name": "pool_linear", "slo_ms": 30000, "max_batch_size": 8,
     "max_queue_delay_ms": 0}]}
PROTOCOLS = ("http", "grpc", "shm-http", "shm-grpc")


class Client:
    """One client thread's way of sending the model's request by `protocol`."""

    def __init__(self, protocol: str, http_url: str, grpc_url: str, x: np.ndarray,
                 out_bytes: int, tag: str) -> None:
        self.regions: list[Any] = []
        lib: Any = grpcclient if protocol.endswith("grpc") else httpclient
        self.client = (lib.InferenceServerClient(grpc_url) if lib is grpcclient
                       else lib.InferenceServerClient(http_url, network_timeout=60))
        self.inputs = [lib.InferInput("input", list(x.shape), "FP32")]
        self.outputs: list[Any] | None = None
        if protocol.startswith("shm"):
            keys = (f"/bench_in_{tag}", f"/bench_out_{tag}")
            self.regions = [shm.create_shared_memory_region(f"in_{tag}", keys[0], x.nbytes),
                            shm.create_shared_memory_region(f"out_{tag}", keys[1], out_bytes)]
            shm.set_shared_memory_region(self.regions[0], [x])
            self.client.register_system_shared_memory(f"in_{tag}", keys[0], x.nbytes)
            self.client.register_system_shared_memory(f"out_{tag}", keys[1], out_bytes)
            self.inputs[0].set_shared_memory(f"in_{tag}", x.nbytes)
            out = lib.InferRequestedOutput("output")
            out.set_shared_memory(f"out_{tag}", out_bytes)
            self.outputs = [out]
            self.names = (f"in_{tag}", f"out_{tag}")
        elif lib is httpclient:
            self.inputs[0].set_data_from_numpy(x, binary_data=True)
            self.outputs = [lib.InferRequestedOutput("output", binary_data=True)]
        else:
            self.inputs[0].set_data_from_numpy(x)

    def send(self) -> bool:
        """One request; False when it was refused (its CPU counts all the same)."""
        try:
            self.client.infer(MODEL, self.inputs, outputs=self.outputs)
        except InferenceServerException as e:
            if "UNAVAILABLE" in str(e.status()) or "429" in str(e.status()):
                return False
            raise
        return True

    def close(self) -> None:
        for name in getattr(self, "names", ()):
            self.client.unregister_system_shared_memory(name)
        for r in self.regions:
            shm.destroy_shared_memory_region(r)
        self.client.close()


def processes(pid: int) -> list[int]:
    """`pid` and its descendants."""
    out = [pid]
    for p in out:
        for children in Path(f"/proc/{p}/task").glob("*/children"):
            out += map(int, children.read_text().split())
    return out


def measure(protocol: str, pids: list[int], make: Callable[[str], Client], seconds: float,
            warmup: int, clients: int) -> dict[str, float]:
    """`clients` threads (each its own client, made, used and closed in its thread:
    tritonclient.http's connections belong to their thread) sending `protocol`'s requests
    back to back for `seconds`, after `warmup`; the CPU of `pids` (the first: the server's
    own process) read between the barriers, without the clients' set-up and tear-down
    (registering and unregistering regions)."""
    end = [0.0]
    start = threading.Barrier(clients + 1, lambda: end.append(time.perf_counter() + seconds))
    done, read = threading.Barrier(clients + 1), threading.Barrier(clients + 1)
    errors: list[BaseException] = []
    sent, refused = [0] * clients, [0] * clients
    took: list[list[float]] = [[] for _ in range(clients)]  # each request's seconds

    def run(i: int) -> None:
        c = None
        try:
            c = make(f"{protocol}_{os.getpid()}_{i}".replace("-", "_"))
            for _ in range(max(1, warmup // clients)):
                c.send()
            start.wait()
            while time.perf_counter() < end[-1]:
                t0 = time.perf_counter()
                refused[i] += not c.send()
                took[i].append(time.perf_counter() - t0)
                sent[i] += 1
        except BaseException as e:  # noqa: BLE001 - reported after the join
            errors.append(e)
            for b in (start, done, read):
                b.abort()
        finally:
            try:
                done.wait()
                read.wait()
            except threading.BrokenBarrierError:
                pass
            if c is not None:
                c.close()

    def cpu() -> tuple[float, float, float]:
        user, kernel = cpu_user_sys_s(pids[0])
        return user, kernel, sum(sum(cpu_user_sys_s(p)) for p in pids)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    try:
        start.wait()
        u0, s0, a0 = cpu()
        t0 = time.perf_counter()
        done.wait()
        wall = time.perf_counter() - t0
        u1, s1, a1 = cpu()
        read.wait()
    except threading.BrokenBarrierError:
        pass
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    n = sum(sent)
    return {"cpu_us": 1e6 * (u1 - u0 + s1 - s0) / n, "user_us": 1e6 * (u1 - u0) / n,
            "kernel_us": 1e6 * (s1 - s0) / n, "all_cpu_us": 1e6 * (a1 - a0) / n,
            "per_s": n / wall, "requests": n, "refused": sum(refused),
            "p50_ms": 1000 * float(np.median([t for ts in took for t in ts]))}


@contextmanager
def grpc_floor(output_bytes: int) -> Iterator[tuple[str, int]]:
    """`bench.grpc_floor` in a subprocess, ready: (its address, its PID); stopped by PID."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bench.grpc_floor", "--port", str(port),
                             "--output-bytes", str(output_bytes)],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"bench.grpc_floor did not start (exit {proc.wait(10)})")
        yield f"127.0.0.1:{port}", proc.pid
    finally:
        proc.kill()
        proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=10, help="closed loop per protocol")
    p.add_argument("--warmup", type=int, default=40, help="requests per protocol first")
    p.add_argument("--clients", default="8,64", help="client threads; several run in turn")
    p.add_argument("--protocols", default=",".join(PROTOCOLS),
                   help=f"some of {','.join(PROTOCOLS)}")
    p.add_argument("--frontends", type=int, default=1,
                   help="dstack's server.frontends; with more than 1, CPU 'own' is the "
                        "server's process's, the front ends apart")
    p.add_argument("--grpc-floor", action="store_true",
                   help="also grpcio alone (`bench.grpc_floor`: a ModelInfer that answers "
                        "at once), on the grpc protocol")
    p.add_argument("--triton-python", default="", metavar="PYTHON",
                   help="also Triton: PyTriton under this Python (`make bench-triton`)")
    args = p.parse_args(argv)
    protocols = [q for q in args.protocols.split(",") if q]
    if unknown := set(protocols) - set(PROTOCOLS):
        p.error(f"--protocols: unknown {sorted(unknown)}; give some of {','.join(PROTOCOLS)}")
    OUT.mkdir(parents=True, exist_ok=True)
    grpc_port = free_port()
    cfg = OUT / "protocols.yaml"
    cfg.write_text(yaml.safe_dump({**CONFIG, "server": {
        "frontends": args.frontends, "grpc_port": grpc_port, "allow_client_shm": True}}))
    rows: list[dict[str, Any]] = []
    with ExitStack() as stack:
        srv = stack.enter_context(serving(cfg, OUT / "protocols.log"))
        servers = {"dstack": (srv.host, f"127.0.0.1:{grpc_port}", processes(srv.pid))}
        if args.triton_python:
            t = stack.enter_context(triton_serving(args.triton_python, cfg,
                                                   OUT / "protocols-triton.log"))
            pids = processes(t.pid)  # tritonserver first: the server's own process
            pids.sort(key=lambda q: Path(f"/proc/{q}/comm").read_text().strip() != "tritonserver")
            servers["triton"] = (t.host, t.grpc_url, pids)
        meta = get_json(f"{srv.host}/v2/models/{MODEL}")
        out_bytes = 4 * int(np.prod(meta["outputs"][0]["shape"][1:]))
        if args.grpc_floor:
            floor = stack.enter_context(grpc_floor(out_bytes))
            servers["grpcio"] = ("", floor[0], [floor[1]])
        x = np.random.default_rng(0).random([1, *meta["inputs"][0]["shape"][1:]],
                                            dtype=np.float32)
        for clients in map(int, args.clients.split(",")):
            for protocol in protocols:
                for name, (host, grpc_url, pids) in servers.items():
                    if name == "grpcio" and protocol != "grpc":
                        continue
                    make = partial(Client, protocol, host.removeprefix("http://"), grpc_url, x,
                                   out_bytes)
                    rows.append({"server": name, "protocol": protocol, "clients": clients,
                                 **measure(protocol, pids, make, args.seconds, args.warmup,
                                           clients)})
    print(f"server CPU per {x.nbytes / 1000:.0f} KB batch-1 request ({MODEL}: pool_linear), "
          f"{args.seconds:g} s of each, closed loop; CPU: the server's own process, and all")
    print(f"{'clients':>7s} {'protocol':9s} {'server':7s} {'req/s':>7s} {'CPU us':>7s} "
          f"{'user':>6s} {'kernel':>6s} {'all us':>7s} {'CPU/HTTP':>8s} {'req/s/HTTP':>10s} "
          f"{'refused':>7s} {'p50 ms':>7s}")
    by = {(r["server"], r["protocol"], r["clients"]): r for r in rows}
    for r in rows:
        # grpcio alone is set beside dstack's HTTP
        base = by.get((r["server"].replace("grpcio", "dstack"), "http", r["clients"]))
        print(f"{r['clients']:7d} {r['protocol']:9s} {r['server']:7s} {r['per_s']:7.0f} "
              f"{r['cpu_us']:7.0f} {r['user_us']:6.0f} {r['kernel_us']:6.0f} "
              f"{r['all_cpu_us']:7.0f} "
              + (f"{r['cpu_us'] / base['cpu_us']:8.2f} {r['per_s'] / base['per_s']:10.2f} "
                 if base else f"{'':8s} {'':10s} ") + f"{r['refused']:7d} {r['p50_ms']:7.2f}")
    for r in rows:
        if r["server"] == "dstack" and (tr := by.get(("triton", r["protocol"], r["clients"]))):
            print(f"dstack / Triton, {r['protocol']}, {r['clients']} clients: req/s "
                  f"{r['per_s'] / tr['per_s']:.2f}, CPU per request (all processes) "
                  f"{r['all_cpu_us'] / tr['all_cpu_us']:.2f}")
    (OUT / "protocols.json").write_text(json.dumps(
        {"input_bytes": int(x.nbytes), "args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
