"""The gap between batches, exactly (`python -m bench.batch_gap [MODEL] [N] [ROUNDS]`).

The runtime in process with a real CPU worker (no HTTP), a backlog of N one-item requests
sent at once, so that every batch but the first has its successor queued when it ends;
each gap is the next batch's compute start minus this batch's end, both from the worker's
own clock (`Runtime.batch_log`). Double buffering on and off alternate, ROUNDS times each,
so that the machine's drift falls on both alike.
"""

from __future__ import annotations

import asyncio
import os
import sys

import numpy as np

from dstack.common.config import parse_config
from dstack.runtime.serving import Runtime


async def one_run(model: str, n: int, double: bool) -> tuple[list[float], list[float]]:
    cfg = parse_config({
        "policy": "shared", "double_buffer": double, "adapt": {"enabled": False},
        "models": [{"name": model, "slo_ms": 60000, "max_batch_size": 8,
                    "max_queue_delay_ms": 1, "max_queue": 100000}]})
    rt = Runtime(cfg)
    await rt.start()
    try:
        shape = rt.spec(model).inputs[0].shape[1:]
        x = np.random.default_rng(0).random((1, *shape), dtype=np.float32)
        await asyncio.gather(*(rt.infer(model, {"input": x}) for _ in range(16)))  # warm
        rt.batch_log.clear()
        await asyncio.gather(*(rt.infer(model, {"input": x}) for _ in range(n)))
        log = sorted(rt.batch_log, key=lambda b: b.start_s)
    finally:
        await rt.stop()
    gaps = [b.start_s - (a.start_s + a.compute_s) for a, b in zip(log, log[1:], strict=False)]
    return gaps, [b.compute_s for b in log]


def main() -> int:
    model = sys.argv[1] if len(sys.argv) > 1 else "tiny_cnn"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 800
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    print(f"load average at start: {os.getloadavg()}", flush=True)
    gaps: dict[str, list[float]] = {"on": [], "off": []}
    comp: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(rounds):
        for double in (True, False):
            k = "on" if double else "off"
            g, c = asyncio.run(one_run(model, n, double))
            gaps[k] += g
            comp[k] += c
            print(f"round {r} double buffering {k:3s}: median gap {1000 * np.median(g):.3f} ms, "
                  f"median compute {1000 * np.median(c):.2f} ms, {len(c)} batches", flush=True)
    for k in ("on", "off"):
        g, c = np.array(gaps[k]) * 1000, np.array(comp[k]) * 1000
        print(f"{model}, double buffering {k:3s}: gap median {np.median(g):.3f} ms, mean "
              f"{g.mean():.3f}, p90 {np.percentile(g, 90):.3f}; compute median "
              f"{np.median(c):.2f} ms; {len(g)} gaps")
    print(f"load average at end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":  # spawned workers import this module: only the parent runs it
    sys.exit(main())
