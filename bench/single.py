"""The single-model figure: closed-loop tritonclient clients against one model, in windows
that alternate with the model's in-process windows (`bench.ceiling`)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.ceiling import InProcess, ceiling_ratio
from bench.loads import TritonClients
from bench.servers import Server, cpu_s, model_stats, models_of, peak_rss_mb, serving


def bench_single(config: Path, model: str, outdir: Path, *, cores: list[int],
                 batches: list[int], clients: int = 8, rounds: int = 36,
                 window_s: float = 1.0, warmup_s: float = 0.25) -> dict[str, Any]:
    """`clients` tritonclient clients against the server, in `rounds` windows that
    alternate with windows of the model in process (while the server idles), whose batch
    size goes round `batches`: this machine's speed drifts from second to second by more
    than the gap being measured, and which batch size is best in process is itself within
    that noise, so both are measured beside the server's windows all through the run (see
    `ceiling_ratio`)."""
    slo = float(models_of(config)[0]["slo_ms"])

    async def measure(srv: Server, direct: InProcess) -> list[dict[str, float]]:
        pids = (srv.pid, os.getpid())  # the server, these clients
        tc = TritonClients(srv.host, model, clients)
        try:
            await tc.window(1.0, slo)  # connect and warm the HTTP path and the worker
            out = []
            for i in range(rounds):
                b = batches[i % len(batches)]
                ceil = direct.items_s(b, window_s, warmup_s)  # blocks; clients idle
                # Where the time goes, over the whole server window (warm-up included):
                # the worker's busy share (its batches' compute time from the stats) and
                # the CPU the server and the clients spend per answered request.
                s0, (c0, m0), t0 = model_stats(srv.host, model), [*map(cpu_s, pids)], time.time()
                rps, good, p99, refused = await tc.window(window_s, slo, warmup_s)
                s1, (c1, m1), t1 = model_stats(srv.host, model), [*map(cpu_s, pids)], time.time()
                n = max(1, s1["inference_count"] - s0["inference_count"])
                out.append({"batch": b, "ceiling_items_s": ceil, "rps": rps,
                            "goodput_rps": good, "p99_ms": p99, "refused": refused,
                            "worker_busy": (s1["compute_ns"] - s0["compute_ns"]) / 1e9 / (t1 - t0),
                            "avg_batch": n / max(1, s1["execution_count"] - s0["execution_count"]),
                            "server_cpu_ms": 1000 * (c1 - c0) / n,
                            "client_cpu_ms": 1000 * (m1 - m0) / n})
            return out
        finally:
            await tc.close()

    with serving(config, outdir / f"server-{config.stem}.log") as srv, \
            InProcess(model, cores) as direct:
        per_round = asyncio.run(measure(srv, direct))
        rss = peak_rss_mb(srv)

    # All windows have the same length, so means of the rates are rates over all windows.
    def mean(key: str) -> float:
        return float(np.mean([r[key] for r in per_round]))

    def col(key: str) -> list[float]:
        return [r[key] for r in per_round]

    fig = ceiling_ratio(col("goodput_rps"), col("ceiling_items_s"), col("batch"))
    return {"rps": mean("rps"), "goodput_rps": mean("goodput_rps"),
            # A window can answer nothing: when the machine slows down so far that no
            # request both starts after the warm-up and ends inside it (seen with other work
            # running). It counts as zero goodput; `refused` tells a refusal from that.
            "p99_ms": float(np.nanmedian(col("p99_ms"))), **fig,
            "refused": int(sum(col("refused"))),
            "windows_answering_nothing": sum(r["rps"] == 0 for r in per_round),
            "rps_ratio_to_ceiling": mean("rps") / fig["ceiling_items_s"],
            **{k: mean(k) for k in ("worker_busy", "avg_batch", "server_cpu_ms",
                                    "client_cpu_ms")},
            "rounds": per_round, "window_s": window_s, "warmup_s": warmup_s,
            "rss_mb": rss}

