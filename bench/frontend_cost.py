"""The HTTP front end's CPU per infer request, without a model: `python -m
bench.frontend_cost [--requests N] [--connections C] [--reps R]`.

The server (`server.main.build_app`, uvicorn with the server's own connection protocol and
middleware, in a child process) runs over `EchoBackend`, which answers every request at
once with zeros. What the server's process then spends per request is the front end alone:
reading a 1x3x224x224 FP32 binary request (602 KB), its middleware, routing, decoding and
encoding, and writing a 4 KB binary answer. The benchmark's lean client
(bench/lean_http.py), in another process, sends the requests back to back on
`--connections` kept-alive connections. Printed per round: requests per second, the
server's user and kernel CPU per request (/proc), and its minor page faults per request
(new pages the allocator asked the OS for); then the medians.

`--backend runtime` serves a real runtime instead (`dstack.runtime.serving.Runtime`: one
model of next to no compute, `pool_linear`, on this machine's CPU, policy `shared`, SLO 1
s), as `dstack serve` does: the front end and the runtime's own work per request (admit,
stage into the worker's shared memory, hand each batch to the worker and back). `--backend
runtime-only` runs that runtime with no HTTP at all: `--connections` callers in the
server's process await `Runtime.infer` back to back with the same one-item input. The
three split what the server's process spends per request between the HTTP front end and
the runtime (the worker's process is not counted).

A/B between revisions: run the same copy of this file with `PYTHONPATH=<checkout>`.
(`python -m bench.bench_chaos --only refusal-cost` measures a refusal.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import numpy as np

from bench import chaos_load as cl
from bench.lean_http import LeanClient
from bench.servers import get_json

SHAPE = (1, 3, 224, 224)
OUTPUTS = 1000


#: `--backend runtime`'s model: next to no compute on the same 600 KB input. Its worker
#: has the server's priority: on two cores busy with the client and a saturated server,
#: a nicer worker (the default, `worker_nice`) starved, its batches of 8 took 0.8 s, and
#: the runtime refused the benchmark's requests.
RUNTIME_CONFIG = {"device": "cpu", "policy": "shared", "worker_nice": 0, "models": [
    {"name": "image", "zoo_name": "pool_linear", "slo_ms": 1000, "max_batch_size": 8,
     "max_queue_delay_ms": 0}]}


def _serve(addr_out: Any, steady: bool, backend: str = "echo") -> None:
    """The server's process: `build_app` over `EchoBackend` (or a real runtime) on an
    ephemeral port; with malloc's thresholds fixed as `dstack serve` fixes them, given
    `steady`."""
    import uvicorn

    from dstack.common.backend import ModelStats
    from dstack.common.config import parse_config
    from dstack.common.types import DType, ModelSpec, TensorSpec
    from server.main import bind, build_app, server_config

    if steady:
        try:
            from server.memory import steady_server_heap
        except ImportError:  # a revision from before it: glibc's adaptive thresholds
            pass
        else:
            steady_server_heap()

    if backend == "runtime":
        cfg = parse_config(RUNTIME_CONFIG)
        app = build_app(cfg)  # its lifespan starts the runtime and its worker
        server = uvicorn.Server(server_config(app, cfg.server, log_level="warning"))
        sock = bind("127.0.0.1", 0)
        addr_out.put(sock.getsockname())
        server.run(sockets=[sock])
        return

    cfg = parse_config({"models": [{"name": "image"}]})
    spec = ModelSpec("image", (TensorSpec("x", DType.FP32, (-1, *SHAPE[1:])),),
                     (TensorSpec("y", DType.FP32, (-1, OUTPUTS)),), max_batch_size=8)

    class EchoBackend:
        """One model, always ready; admits everything and answers at once."""

        def model_names(self) -> list[str]:
            return ["image"]

        def spec(self, model: str) -> ModelSpec:
            if model != "image":
                from dstack.common.errors import ModelNotFound
                raise ModelNotFound(f"unknown model {model!r}")
            return spec

        def is_ready(self) -> bool:
            return True

        def is_model_ready(self, model: str) -> bool:
            return True

        def refuse_early(self, model: str, since_s: float = 0.0) -> None:
            self.spec(model)  # the header's question, as the runtime has it: admitted

        async def infer(self, model: str, inputs: dict[str, np.ndarray],
                        since_received_s: float = 0.0) -> dict[str, np.ndarray]:
            return {"y": np.zeros((len(inputs["x"]), OUTPUTS), np.float32)}

        def stats(self, model: str) -> ModelStats:
            return ModelStats(model, *[0] * 9)

        def plan(self) -> None:
            return None

        def schedule(self) -> None:
            return None

        def policy_name(self) -> str:
            return "echo"

        def deploy_config(self) -> Any:
            return cfg

        async def start(self) -> None:
            pass

        async def stop(self) -> None:
            pass

    app = build_app(cfg, EchoBackend(), start_runtime=False)
    server = uvicorn.Server(server_config(app, cfg.server, log_level="warning"))
    sock = bind("127.0.0.1", 0)
    addr_out.put(sock.getsockname())
    server.run(sockets=[sock])


def _runtime_only(out: Any, requests: int, connections: int, reps: int) -> None:
    """The server's process without HTTP: the runtime of `--backend runtime`, and
    `connections` callers awaiting `infer` back to back, `requests` a round; puts each
    round's (requests/s, user s, kernel s) of this process."""
    from dstack.common.config import parse_config
    from dstack.common.pauses import freeze_startup_objects
    from dstack.runtime.serving import Runtime
    from server.memory import steady_server_heap

    steady_server_heap()
    x = np.ones(SHAPE, np.float32)

    async def run() -> None:
        rt = Runtime(parse_config(RUNTIME_CONFIG))
        await rt.start()
        freeze_startup_objects()  # as `dstack serve` does once it is up

        async def one(k: int) -> None:
            for _ in range(k):
                await rt.infer("image", {"input": x})

        try:
            await asyncio.gather(*(one(50) for _ in range(connections)))  # warm up
            for _ in range(reps):
                t0, c0 = time.perf_counter(), os.times()
                await asyncio.gather(*(one(requests // connections)
                                       for _ in range(connections)))
                c1 = os.times()
                out.put((connections * (requests // connections) / (time.perf_counter() - t0),
                         c1.user - c0.user, c1.system - c0.system))
        finally:
            await rt.stop()

    try:  # the loop `dstack serve` runs on (uvicorn's "auto": uvloop where installed)
        import uvloop
    except ImportError:
        asyncio.run(run())
    else:
        uvloop.run(run())


def request(names: tuple[str, str] = ("x", "y")) -> tuple[bytes, dict[str, str]]:
    """A one-item request's body and headers (binary input, binary output asked for), its
    input and output named `names`."""
    n = int(np.prod(SHAPE))
    header = json.dumps({
        "inputs": [{"name": names[0], "shape": list(SHAPE), "datatype": "FP32",
                    "parameters": {"binary_data_size": 4 * n}}],
        "outputs": [{"name": names[1], "parameters": {"binary_data": True}}]}).encode()
    return header + np.ones(n, np.float32).tobytes(), {
        "content-type": "application/octet-stream",
        "inference-header-content-length": str(len(header))}


async def send(url: str, n: int, connections: int,
               names: tuple[str, str] = ("x", "y")) -> None:
    """`n` requests back to back on `connections` kept-alive connections, each answer read
    whole; a request not answered 200 fails the run."""
    client = LeanClient(url)
    req = client.post("/v2/models/image/infer", *request(names))

    async def one(k: int) -> None:
        for _ in range(k):
            status, answer, _ = await client.send(req, 30)
            if status != 200:
                raise RuntimeError(f"answered {status}: {answer[:200]!r}")

    try:
        await asyncio.gather(*(one(n // connections) for _ in range(connections)))
    finally:
        client.close()


def wait_ready(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            get_json(url + "/v2/health/ready")
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=4000, help="per round")
    ap.add_argument("--connections", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3, help="rounds")
    ap.add_argument("--glibc-defaults", action="store_true",
                    help="leave malloc's thresholds adaptive (glibc's defaults), as the "
                         "server's process had them before `steady_server_heap`")
    ap.add_argument("--backend", choices=("echo", "runtime", "runtime-only"),
                    default="echo", help="what answers (module docstring)")
    args = ap.parse_args(argv)
    if args.backend == "runtime-only":
        return _main_runtime_only(args)
    names = ("input", "output") if args.backend == "runtime" else ("x", "y")
    addr_q: Any = mp.Queue()
    # (a runtime starts its worker as a child process: a daemonic process may have none)
    proc = mp.Process(target=_serve, args=(addr_q, not args.glibc_defaults, args.backend),
                      daemon=args.backend == "echo")
    proc.start()
    try:
        host, port = addr_q.get(timeout=120)
        url = f"http://{host}:{port}"
        wait_ready(url)
        asyncio.run(send(url, 50 * args.connections, args.connections, names))  # warm up
        rows = []
        for rep in range(args.reps):
            (u0, k0), f0 = cl.cpu_user_sys_s(proc.pid), cl.minor_faults(proc.pid)
            t0 = time.perf_counter()
            asyncio.run(send(url, args.requests, args.connections, names))
            wall = time.perf_counter() - t0
            (u1, k1), f1 = cl.cpu_user_sys_s(proc.pid), cl.minor_faults(proc.pid)
            n = args.connections * (args.requests // args.connections)
            row = (n / wall, 1e6 * (u1 - u0) / n, 1e6 * (k1 - k0) / n, (f1 - f0) / n)
            rows.append(row)
            print(f"round {rep + 1}: {row[0]:.0f} requests/s; server CPU per request: user "
                  f"{row[1]:.0f} us, kernel {row[2]:.0f} us; {row[3]:.0f} page faults",
                  flush=True)
        med = [statistics.median(r[i] for r in rows) for i in range(4)]
        print(f"median: {med[0]:.0f} requests/s; server CPU per request: user {med[1]:.0f} us, "
              f"kernel {med[2]:.0f} us, total {med[1] + med[2]:.0f} us; "
              f"{med[3]:.0f} page faults")
    finally:
        proc.terminate()
        proc.join(10)
    return 0


def _main_runtime_only(args: argparse.Namespace) -> int:
    out: Any = mp.Queue()
    proc = mp.Process(target=_runtime_only,
                      args=(out, args.requests, args.connections, args.reps))
    proc.start()
    try:
        rows = []
        for rep in range(args.reps):
            per_s, user, kernel = out.get(timeout=300)
            n = args.connections * (args.requests // args.connections)
            rows.append((per_s, 1e6 * user / n, 1e6 * kernel / n))
            print(f"round {rep + 1}: {per_s:.0f} requests/s; runtime's process CPU per "
                  f"request: user {rows[-1][1]:.0f} us, kernel {rows[-1][2]:.0f} us", flush=True)
        med = [statistics.median(r[i] for r in rows) for i in range(3)]
        print(f"median: {med[0]:.0f} requests/s; runtime's process CPU per request: user "
              f"{med[1]:.0f} us, kernel {med[2]:.0f} us, total {med[1] + med[2]:.0f} us")
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.terminate()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
