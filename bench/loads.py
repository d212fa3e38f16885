"""Load for a benchmark, over the wire protocol only: open-loop Poisson arrivals (aiohttp)
and closed-loop tritonclient (aio) clients, with the outcome of every request counted."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.servers import get_json
from server import codec


def one_item_body(model_meta: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    t = model_meta["inputs"][0]
    x = np.random.default_rng(0).random([1, *t["shape"][1:]], dtype=np.float32)
    body, hlen = codec.encode_request({t["name"]: x})
    return body, {"Content-Type": "application/octet-stream", codec.HEADER_LENGTH: str(hlen)}


@dataclass
class Outcome:
    latencies_ms: list[float] = field(default_factory=list)  # answered (200)
    ok: int = 0  # answered within the SLO
    late: int = 0
    refused: int = 0
    error: int = 0
    lag_ms: float = 0.0  # worst generator lag behind the Poisson schedule

    @property
    def sent(self) -> int:
        return self.ok + self.late + self.refused + self.error


async def open_loop(host: str, rates: dict[str, float], slos_ms: dict[str, float],
                    duration_s: float, seed: int = 1, max_inflight: int = 512
                    ) -> dict[str, Outcome]:
    """Poisson arrivals per model at `rates` for `duration_s` (`send_at`)."""
    arrivals = poisson_arrivals(np.random.default_rng(seed), rates, duration_s)
    return await send_at(host, arrivals, {m: slos_ms[m] for m in rates},
                         max_inflight=max_inflight)


def poisson_arrivals(rng: np.random.Generator, rates: dict[str, float], duration_s: float
                     ) -> list[tuple[float, str]]:
    """`(instant s, model)` of Poisson arrivals per model at `rates` (rps; a model at 0
    gets none) for `duration_s`, in time order."""
    arrivals: list[tuple[float, str]] = []
    for m, rate in rates.items():
        if rate > 0:
            times = np.cumsum(rng.exponential(1 / rate, int(rate * duration_s * 2) + 10))
            arrivals += [(float(t), m) for t in times[times < duration_s]]
    return sorted(arrivals)


async def send_at(host: str, arrivals: list[tuple[float, str]], slos_ms: dict[str, float],
                  max_inflight: int = 512) -> dict[str, Outcome]:
    """One one-item binary infer request per `(instant s, model)` of `arrivals` (sorted),
    each sent at its instant (open loop; at most `max_inflight` at once, a later one waits
    and its lag is counted); latency from the send to the full response."""
    import aiohttp

    metas = {m: get_json(f"{host}/v2/models/{m}") for m in slos_ms}
    bodies = {m: one_item_body(metas[m]) for m in slos_ms}
    out = {m: Outcome() for m in slos_ms}
    sem = asyncio.Semaphore(max_inflight)
    conn = aiohttp.TCPConnector(limit=max_inflight, force_close=False)
    timeout = aiohttp.ClientTimeout(total=max(10.0, 5 * max(slos_ms.values()) / 1000))
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as http:

        async def one(m: str, at: float, t_start: float) -> None:
            o = out[m]
            async with sem:
                t0 = time.perf_counter()
                o.lag_ms = max(o.lag_ms, (t0 - t_start - at) * 1000)
                body, headers = bodies[m]
                try:
                    async with http.post(f"{host}/v2/models/{m}/infer", data=body,
                                         headers=headers) as r:
                        await r.read()
                        status = r.status
                except (aiohttp.ClientError, TimeoutError):
                    o.error += 1
                    return
                ms = (time.perf_counter() - t0) * 1000
                if status in (429, 503):
                    o.refused += 1
                elif status != 200:
                    o.error += 1
                else:
                    o.latencies_ms.append(ms)
                    o.ok += ms <= slos_ms[m]
                    o.late += ms > slos_ms[m]

        t_start = time.perf_counter()
        tasks = []
        for at, m in arrivals:
            delay = t_start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(m, at, t_start)))
        await asyncio.gather(*tasks)
    return out


class TritonClients:
    """`n` tritonclient aio clients (one each) for `model`, kept connected across windows;
    `window()` runs them in a closed loop."""

    def __init__(self, host: str, model: str, n: int) -> None:
        import tritonclient.http.aio as aio
        from tritonclient.http import InferInput

        meta = get_json(f"{host}/v2/models/{model}")
        t = meta["inputs"][0]
        x = np.random.default_rng(0).random([1, *t["shape"][1:]], dtype=np.float32)
        self.model = model
        self.clients = [aio.InferenceServerClient(host.removeprefix("http://"))
                        for _ in range(n)]
        self.inp = InferInput(t["name"], list(x.shape), "FP32")
        self.inp.set_data_from_numpy(x, binary_data=True)

    async def window(self, duration_s: float, slo_ms: float, warmup_s: float = 0.0
                     ) -> tuple[float, float, float, int]:
        """(req/s, goodput within the SLO, p99 ms, requests refused) in steady state: each
        client's requests started after the first `warmup_s` and answered within the next
        `duration_s`, over the time from the first one's start to the last one's answer
        (answers counted in a fixed window are off by up to a whole batch)."""
        from tritonclient.utils import InferenceServerException

        lat: list[float] = []
        rps = good_rps = 0.0
        refused = 0
        begin = time.perf_counter() + warmup_s
        end = begin + duration_s

        async def loop(c: Any) -> None:
            nonlocal rps, good_rps, refused
            first = last = 0.0
            answered = ok = 0
            while True:
                t0 = time.perf_counter()
                if t0 >= end:
                    break
                try:
                    await c.infer(self.model, [self.inp])
                    done = True
                except InferenceServerException:
                    done = False  # refused (429/503): counts against goodput, not a crash
                t1 = time.perf_counter()
                if t0 < begin or t1 > end:
                    continue
                if not first:
                    first = t0
                last = t1
                refused += not done
                if done:
                    answered += 1
                    lat.append((t1 - t0) * 1000)
                    ok += lat[-1] <= slo_ms
            if last > first:
                rps += answered / (last - first)
                good_rps += ok / (last - first)

        await asyncio.gather(*(loop(c) for c in self.clients))
        p99 = float(np.percentile(lat, 99)) if lat else float("nan")
        return rps, good_rps, p99, refused

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients))


def p99(o: Outcome) -> float:
    """p99 latency (ms) of the answered requests; NaN when none was answered."""
    return float(np.percentile(o.latencies_ms, 99)) if o.latencies_ms else float("nan")
