"""The server's CPU per request by protocol, side by side in one run against one server:
HTTP with binary tensors, gRPC, and system shared memory (over HTTP and over gRPC), each
a 600 KB batch-1 request of a model of next to no compute (`pool_linear`, the accept-cost
model of `bench.bench_chaos`: what the server's own process spends, not the model).

The server's CPU (its own process, user + kernel, from /proc/PID/stat; its worker apart)
is read before and after `--requests` requests of each protocol, sent by `--clients`
threads with unmodified tritonclient clients (each shared-memory client with its own input
and output regions), after `--warmup` requests of it. Printed: CPU per request, requests
a second, and the ratio of each to HTTP's; written to out/bench/protocols.json.

    python -m bench.bench_protocols --requests 400 --clients 4
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
import yaml
from tritonclient.utils import InferenceServerException

from bench.chaos_load import cpu_user_sys_s
from bench.servers import ROOT, free_port, serving

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


def measure(protocol: str, pid: int, make: Callable[[str], Client], n: int, warmup: int,
            clients: int) -> dict[str, float]:
    """`n` requests of `protocol` from `clients` threads (each its own client, made, used
    and closed in its thread: tritonclient.http's connections belong to their thread),
    after `warmup`; the server's CPU read between the barriers, without the clients'
    set-up and tear-down (registering and unregistering regions)."""
    k = n // clients
    start, done, read = (threading.Barrier(clients + 1) for _ in range(3))
    errors: list[BaseException] = []
    refused = [0] * clients

    def run(i: int) -> None:
        c = None
        try:
            c = make(f"{protocol}_{os.getpid()}_{i}".replace("-", "_"))
            for _ in range(max(1, warmup // clients)):
                c.send()
            start.wait()
            for _ in range(k):
                refused[i] += not c.send()
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

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    try:
        start.wait()
        u0, s0 = cpu_user_sys_s(pid)
        t0 = time.perf_counter()
        done.wait()
        wall = time.perf_counter() - t0
        u1, s1 = cpu_user_sys_s(pid)
        read.wait()
    except threading.BrokenBarrierError:
        pass
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    sent = k * clients
    return {"cpu_us": 1e6 * (u1 - u0 + s1 - s0) / sent, "user_us": 1e6 * (u1 - u0) / sent,
            "kernel_us": 1e6 * (s1 - s0) / sent, "per_s": sent / wall, "requests": sent,
            "refused": sum(refused)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=400, help="requests per protocol")
    p.add_argument("--warmup", type=int, default=40, help="requests per protocol first")
    p.add_argument("--clients", type=int, default=4, help="client threads")
    p.add_argument("--protocols", default=",".join(PROTOCOLS),
                   help=f"comma-separated, of {', '.join(PROTOCOLS)}")
    args = p.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    grpc_port = free_port()
    cfg = OUT / "protocols.yaml"
    cfg.write_text(yaml.safe_dump({**CONFIG, "server": {
        "frontends": 1, "grpc_port": grpc_port, "allow_client_shm": True}}))
    rows: dict[str, dict[str, float]] = {}
    with serving(cfg, OUT / "protocols.log") as srv:
        meta = json.loads(_get(f"{srv.host}/v2/models/{MODEL}"))
        shape = [1, *meta["inputs"][0]["shape"][1:]]
        out_bytes = 4 * int(np.prod(meta["outputs"][0]["shape"][1:]))
        x = np.random.default_rng(0).random(shape, dtype=np.float32)
        http_url = srv.host.removeprefix("http://")
        for protocol in args.protocols.split(","):
            rows[protocol] = measure(
                protocol, srv.pid,
                lambda tag, pr=protocol: Client(pr, http_url, f"127.0.0.1:{grpc_port}", x,
                                                out_bytes, tag),
                args.requests, args.warmup, args.clients)
    base = rows.get("http")
    print(f"server CPU per {x.nbytes / 1000:.0f} KB batch-1 request ({MODEL}: pool_linear), "
          f"{args.requests} requests each, {args.clients} client threads")
    print(f"{'protocol':10s} {'CPU us':>8s} {'user':>7s} {'kernel':>7s} {'req/s':>8s} "
          f"{'CPU/HTTP':>9s} {'req/s/HTTP':>11s} {'refused':>8s}")
    for name, r in rows.items():
        ratio = f"{r['cpu_us'] / base['cpu_us']:9.2f}" if base else f"{'':9s}"
        rate = f"{r['per_s'] / base['per_s']:11.2f}" if base else ""
        print(f"{name:10s} {r['cpu_us']:8.0f} {r['user_us']:7.0f} {r['kernel_us']:7.0f} "
              f"{r['per_s']:8.0f} {ratio} {rate} {r['refused']:8.0f}")
    (OUT / "protocols.json").write_text(json.dumps(
        {"input_bytes": int(x.nbytes), "args": vars(args), "rows": rows}, indent=1))
    return 0


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return str(r.read().decode())


if __name__ == "__main__":
    raise SystemExit(main())
