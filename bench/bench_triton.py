"""Benchmark: dstack against Triton on issue 2's single-model figure, side by side.

resnet18 served by dstack (`configs/bench-single-resnet18-shared.yaml`) and by Triton
(`bench/pytriton_resnet18.py`: PyTriton's Triton server, same batching settings, the model
in a Python process), each under 8 tritonclient aio clients in closed loop, in 1 s windows
alternating in random order with 1 s windows of the model in process at b2, b4, b8 in turn
(`make bench`'s method, `bench.ceiling.ceiling_ratio`). Prints each server's goodput
against the in-process ceiling and dstack / Triton per round. PyTriton is not a dependency
of dstack; it lives in a virtual environment of its own:

    python3 -m venv .venv-triton
    .venv-triton/bin/pip install nvidia-pytriton==0.7.0 torch==2.14.1 torchvision==0.29.1
    cp bench/pytriton_sitecustomize.py .venv-triton/lib/python3.11/site-packages/sitecustomize.py
    .venv/bin/python bench/bench_triton.py --python .venv-triton/bin/python [--rounds 30]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

if not __package__:  # run as a script: bench/ is on sys.path, the repository root is not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.ceiling import InProcess, ceiling_ratio, figure  # noqa: E402
from bench.loads import TritonClients  # noqa: E402
from bench.servers import ROOT, free_port, interrupt, serving  # noqa: E402

SLO_MS = 3000.0


def start_triton(python: str, port: int, log: Path, timeout_s: float = 120
                 ) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([python, str(ROOT / "bench" / "pytriton_resnet18.py"), str(port)],
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"PyTriton exited ({proc.returncode}); see {log}")
        try:
            with urllib.request.urlopen(
                    f"http://127.0.0.1:{port}/v2/models/resnet18/ready", timeout=2):
                return proc
        except OSError:
            time.sleep(0.5)
    interrupt(proc, 30)
    raise RuntimeError(f"PyTriton not ready in {timeout_s:g} s; see {log}")


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
    port = free_port()
    triton = start_triton(args.python, port, out.with_suffix(".log"))
    try:
        with serving(ROOT / "configs/bench-single-resnet18-shared.yaml",
                     out.with_name("server-triton-compare.log")) as srv, \
                InProcess("resnet18", sorted(os.sched_getaffinity(0))) as direct:
            res = asyncio.run(measure({"dstack": srv.host, "triton": f"http://127.0.0.1:{port}"},
                                      direct, args.rounds))
    finally:
        interrupt(triton, 30)  # PyTriton stops its tritonserver child
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
