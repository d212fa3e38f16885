"""Shadow re-provisioning on a real GPU: change a model's MPS slice under load and measure
the switch-over gap.

`python bench/bench_gpu_shadow.py [--model resnet50] [--from-pct 30] [--to-pct 60]`

The runtime serves `--model` (policy spatial, a private MPS daemon started by the runtime)
under an open-loop Poisson load; mid-run a shadow worker is started at the new percentage
(`Runtime._start_worker`, as `_replan` does), the switch waits until the old worker is
between batches, attaches the shadow and stops the old one. Reported, from the workers' own
batch timestamps (CLOCK_MONOTONIC, shared by all processes): the gap between the end of the
last batch on the old worker and the start of the first on the new one, the usual gap
between consecutive batches, and how many requests failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from dstack.common.config import parse_config
from dstack.common.types import Cell, DeviceInfo, Profile
from dstack.runtime.serving import Runtime


def profiles(directory: Path, model: str, knee: float) -> None:
    cells = [Cell(b, p, 2.0 + 0.2 * b, 2.5 + 0.2 * b, p, None)
             for b in (1, 8) for p in (knee, 100.0)]
    Profile(model, DeviceInfo("cuda", "bench", 132, "SMs"), "mps", (1, 8), (knee, 100.0),
            tuple(cells), knee={1: knee, 8: knee}, provenance="hand-made for the bench"
            ).save(directory / f"{model}.json")


async def run(a: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp())
    profiles(tmp, a.model, a.from_pct)
    cfg = parse_config({
        "device": "cuda", "policy": "spatial", "profiles": str(tmp), "adapt": {"enabled": False},
        "models": [{"name": a.model, "zoo_name": a.model, "slo_ms": 500, "max_batch_size": 8,
                    "max_queue_delay_ms": 2, "rate_rps": a.rate}],
    })
    rt = Runtime(cfg)
    await rt.start()
    shape = rt.spec(a.model).inputs[0].shape[1:]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, *shape), dtype=np.float32)
    results: list[object] = []
    switch: dict[str, float] = {}

    async def one() -> None:
        try:
            await rt.infer(a.model, {"input": x})
            results.append(True)
        except Exception as e:  # noqa: BLE001 - counted
            results.append(e)

    switched = asyncio.Event()

    async def load() -> None:
        # until `--seconds` have passed and the switch is `--after` seconds behind us
        tasks = []
        t_end = time.monotonic() + a.seconds
        while time.monotonic() < t_end or not switched.is_set() or (
                time.monotonic() < switch["attach_at"] + a.after):
            tasks.append(asyncio.create_task(one()))
            await asyncio.sleep(rng.exponential(1 / a.rate))
        await asyncio.gather(*tasks)

    async def do_switch() -> None:
        await asyncio.sleep(a.switch_at)
        st = rt.models[a.model]
        old = st.worker
        assert old is not None
        t0 = time.monotonic()
        shadow = await rt._start_worker(a.model, rt.slices.slice_for(a.to_pct))
        switch["shadow_start_s"] = time.monotonic() - t0
        while st.running:
            await asyncio.sleep(0.0005)
        switch["attach_at"] = time.monotonic()
        rt._attach(a.model, shadow)
        rt._wake.set()
        switched.set()
        await old.stop()
        switch["old_pid"], switch["new_pid"] = float(old.pid or 0), float(shadow.pid or 0)

    try:
        await asyncio.gather(load(), do_switch())
    finally:
        log = list(rt.batch_log)
        await rt.stop()
    old_b = [b for b in log if b.worker_pid == int(switch["old_pid"])]
    new_b = [b for b in log if b.worker_pid == int(switch["new_pid"])]
    last_old_end = max(b.start_s + b.compute_s for b in old_b)
    first_new = min(b.start_s for b in new_b)
    seq = sorted(log, key=lambda b: b.start_s)
    gaps = [seq[i + 1].start_s - (seq[i].start_s + seq[i].compute_s) for i in range(len(seq) - 1)]
    return {
        "model": a.model, "from_pct": a.from_pct, "to_pct": a.to_pct, "rate_rps": a.rate,
        "requests": len(results), "failed": sum(1 for r in results if r is not True),
        "batches_old": len(old_b), "batches_new": len(new_b),
        "switch_gap_ms": round((first_new - last_old_end) * 1000, 3),
        "attach_to_first_new_batch_ms": round((first_new - switch["attach_at"]) * 1000, 3),
        "median_gap_between_batches_ms": round(statistics.median(gaps) * 1000, 3),
        "shadow_start_s": round(switch["shadow_start_s"], 2),
        "mean_compute_ms_old": round(statistics.mean(b.compute_s for b in old_b) * 1000, 3),
        "mean_compute_ms_new": round(statistics.mean(b.compute_s for b in new_b) * 1000, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--from-pct", type=float, default=30.0)
    ap.add_argument("--to-pct", type=float, default=60.0)
    ap.add_argument("--rate", type=float, default=200.0, help="requests per second")
    ap.add_argument("--seconds", type=float, default=6.0, help="load at least this long")
    ap.add_argument("--switch-at", type=float, default=2.0, help="start the shadow after S s")
    ap.add_argument("--after", type=float, default=3.0, help="load this long after the switch")
    ap.add_argument("--repeat", type=int, default=1)
    a = ap.parse_args()
    for _ in range(a.repeat):
        print(json.dumps(asyncio.run(run(a))), flush=True)


if __name__ == "__main__":
    main()
