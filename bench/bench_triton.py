"""Benchmark: dstack against Triton on issue 2's single-model figure, side by side:
resnet18 served by dstack and by Triton (`bench/pytriton_serve.py`: PyTriton, same batching
settings), each under 8 tritonclient aio clients in closed loop, in 1 s windows alternating
in random order with the model in process at b2, b4, b8 (docs/benchmarks.md).
`triton_serving` here starts Triton for `make bench-triton` too.

    .venv/bin/python -m bench.bench_triton --python .venv-triton/bin/python [--rounds 30]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

if not __package__:  # run as a script: bench/ is on sys.path, the repository root is not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.bench_mix import InProcess, TritonClients, ceiling_ratio, figure  # noqa: E402
from bench.servers import ROOT, free_port, interrupt, models_of, serving, wait_ready  # noqa: E402

SLO_MS = 3000.0


@dataclass
class TritonServer:
    host: str  # http://127.0.0.1:PORT
    grpc_url: str  # 127.0.0.1:PORT
    pid: int  # PyTriton's process, where the models run; tritonserver is its child


@contextmanager
def triton_serving(python: str, config: Path, log: Path, timeout_s: float = 180
                   ) -> Iterator[TritonServer]:
    """The models of a dstack `config` behind PyTriton (`bench/pytriton_serve.py`) under
    `python`, on free 127.0.0.1 ports, ready; stopped by PID on every path."""
    ports = [free_port() for _ in range(3)]
    entries = models_of(config)
    proc = subprocess.Popen([python, str(ROOT / "bench" / "pytriton_serve.py"), *map(str, ports),
                             json.dumps(entries)], stdout=log.open("w"), stderr=subprocess.STDOUT)
    host = f"http://127.0.0.1:{ports[0]}"
    try:
        wait_ready(proc, [f"{host}/v2/models/{m['name']}/ready" for m in entries], log,
                   timeout_s, "PyTriton")
        yield TritonServer(host, f"127.0.0.1:{ports[1]}", proc.pid)
    finally:
        interrupt(proc, 30)  # PyTriton stops its tritonserver child


async def measure(hosts: dict[str, str], direct: InProcess, rounds: int
                  ) -> dict[str, list[float]]:
    clients = {k: TritonClients(h, "resnet18", 8) for k, h in hosts.items()}
    try:
        for tc in clients.values():
            await tc.window(1.0, SLO_MS)  # connect and warm up
        res: dict[str, list[float]] = {"batch": [], "ceiling": [], **{k: [] for k in hosts}}
        for r in range(rounds):
            b = (2, 4, 8)[r % 3]
            for k in random.sample(["ceiling", *hosts], len(hosts) + 1):
                if k == "ceiling":
                    res[k].append(await asyncio.to_thread(direct.items_s, b, 1.0, 0.25))
                else:
                    res[k].append((await clients[k].window(1.0, SLO_MS, 0.25))[1])
            res["batch"].append(b)
        return res
    finally:
        for tc in clients.values():
            await tc.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", required=True, help="the Python of a venv with nvidia-pytriton")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--out", default="out/bench/triton.json")
    args = ap.parse_args(argv)
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    config = ROOT / "configs/bench-single-resnet18-shared.yaml"
    with triton_serving(args.python, config, out.with_suffix(".log")) as triton, \
            serving(config, out.with_name("server-triton-compare.log")) as srv, \
            InProcess("resnet18", sorted(os.sched_getaffinity(0))) as direct:
        res = asyncio.run(measure({"dstack": srv.host, "triton": triton.host}, direct,
                                  args.rounds))
    out.write_text(json.dumps(res, indent=1))
    for k in ("dstack", "triton"):
        fig = ceiling_ratio(res[k], res["ceiling"], res["batch"])
        print(f"{k:7s} {np.mean(res[k]):5.1f} req/s within SLO = {figure(fig)}")
    d = np.array(res["dstack"]) / np.array(res["triton"])
    print(f"dstack / triton: {np.mean(res['dstack']) / np.mean(res['triton']):.3f} "
          f"(per round: median {np.median(d):.3f}, quartiles "
          f"{np.percentile(d, 25):.3f}-{np.percentile(d, 75):.3f}); wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
