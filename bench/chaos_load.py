"""Load for the benchmarks, over the wire protocol only: open-loop infer requests (Poisson,
or at given instants) sent by a lean HTTP/1.1 client with every outcome counted, and, for
the chaos benchmark (`bench/bench_chaos.py`), big bodies from a child process, bodies over
the limit, slowloris sockets, stalled uploads and the fuzzer's cases on raw sockets.

Outcomes, per request: `ok` (200 within the SLO), `late` (200 after it), `refused` (429
by its body's "reason"; 503 with Retry-After as "unavailable"), `other_4xx`, `err_5xx`
(any other 5xx), `hung` (no answer within `hang_s`), `conn` (the connection failed).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httptools
import numpy as np

from bench.fuzz_requests import decode_json_error, fuzz_case, parse_status, wire_bytes
from bench.servers import get_json
from server import codec

#: An answer: status, body, headers (names lower-case).
Answer = tuple[int, bytes, dict[str, str]]


class _Connection(asyncio.Protocol):
    """One kept-alive connection, its answers parsed by httptools (uvicorn's C parser)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[tuple[Answer, bool]] | None = None
        self.body: list[bytes] = []
        self.headers: dict[str, str] = {}
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(ConnectionError(f"bad response: {e}"))
            assert self.transport is not None
            self.transport.close()

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        answer = (self.parser.get_status_code(), b"".join(self.body), self.headers)
        self.body, self.headers = [], {}
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result((answer, self.parser.should_keep_alive()))

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._fail(ConnectionError(f"connection lost: {exc or 'closed by the server'}"))

    def _fail(self, exc: Exception) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)


class LeanClient:
    """Requests to one `http://host:port`, each one prepared bytes object, on kept-alive
    connections reused one request at a time (`fresh`: a new connection for each request,
    closed after it); one future per request and no task, timer or header object of its
    own (aiohttp took more of the cores it shares with the server than the server did)."""

    def __init__(self, base_url: str, *, fresh: bool = False) -> None:
        u = urlsplit(base_url)
        if u.scheme != "http" or u.hostname is None or u.port is None:
            raise ValueError(f"want http://host:port, got {base_url!r}")
        self.host, self.port, self.fresh = u.hostname, u.port, fresh
        self.idle: list[_Connection] = []

    def post(self, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        """The whole request, ready to send (build it once, send it many times)."""
        head = [f"POST {path} HTTP/1.1", f"host: {self.host}:{self.port}",
                f"content-length: {len(body)}", *(f"{k}: {v}" for k, v in headers.items())]
        return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body

    async def send(self, request: bytes, timeout_s: float) -> Answer:
        """Send a request made by `post` and wait for its answer; TimeoutError after
        `timeout_s` (the connection is closed), ConnectionError when it fails."""
        loop = asyncio.get_running_loop()
        conn = None
        while self.idle and conn is None:
            conn = self.idle.pop()
            if conn.lost:  # closed by the server while idle (its keep-alive timeout)
                conn = None
        if conn is None:
            _, conn = await loop.create_connection(_Connection, self.host, self.port)
        waiter: asyncio.Future[tuple[Answer, bool]] = loop.create_future()
        conn.waiter = waiter
        assert conn.transport is not None
        conn.transport.write(request)
        expiry = loop.call_later(timeout_s, _expire, waiter)
        try:
            answer, keep = await waiter
        except BaseException:
            conn.transport.close()
            raise
        finally:
            expiry.cancel()
        if keep and not self.fresh and not conn.lost:
            self.idle.append(conn)
        else:
            conn.transport.close()
        return answer

    def close(self) -> None:
        for conn in self.idle:
            if conn.transport is not None:
                conn.transport.close()
        self.idle.clear()


def _expire(waiter: asyncio.Future[tuple[Answer, bool]]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


@dataclass
class Tally:
    sent: int = 0
    ok: int = 0
    late: int = 0
    refused: Counter = field(default_factory=Counter)  # reason -> count
    other_4xx: int = 0
    err_5xx: int = 0
    hung: int = 0
    conn: int = 0
    latencies_ms: list[float] = field(default_factory=list)  # answered 200
    answered_at: list[float] = field(default_factory=list)  # their perf_counter() at the answer
    refusal_ms: list[float] = field(default_factory=list)  # time to a 429 / 503
    refusal_ms_by_reason: dict[str, list[float]] = field(default_factory=dict)
    non_json_errors: int = 0  # a 4xx / 5xx whose body is not {"error": ...}
    samples_5xx: list[str] = field(default_factory=list)

    def add(self, other: Tally) -> None:
        for k in ("sent", "ok", "late", "other_4xx", "err_5xx", "hung", "conn",
                  "non_json_errors"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        for k in ("latencies_ms", "answered_at", "refusal_ms"):
            getattr(self, k).extend(getattr(other, k))
        self.refused.update(other.refused)
        for k, v in other.refusal_ms_by_reason.items():
            self.refusal_ms_by_reason.setdefault(k, []).extend(v)
        self.samples_5xx += other.samples_5xx[:3]

    @property
    def accepted(self) -> int:
        return self.ok + self.late

    @property
    def errors(self) -> int:
        """Neither answered nor refused: other 4xx, 5xx, hung, connection failed."""
        return self.other_4xx + self.err_5xx + self.hung + self.conn

    def latencies_within(self, spans: list[tuple[float, float]]) -> list[float]:
        """Latencies (ms) of the answers whose request was under way during any of `spans`
        (perf_counter() intervals)."""
        return [ms for ms, at in zip(self.latencies_ms, self.answered_at, strict=True)
                if any(at - ms / 1000 < b and at > a for a, b in spans)]

    def record(self, status: int, body: bytes, headers: Any, ms: float, slo_ms: float,
               at: float = float("nan")) -> None:
        self.sent += 1
        if status == 200:
            self.latencies_ms.append(ms)
            self.answered_at.append(at)
            self.ok += ms <= slo_ms
            self.late += ms > slo_ms
            return
        if decode_json_error(body) is None:
            self.non_json_errors += 1
        if status == 429 or (status == 503 and headers.get("retry-after") is not None):
            reason = "unavailable"
            if status == 429:
                try:
                    reason = str(json.loads(body).get("reason", "unspecified"))
                except ValueError:
                    reason = "unspecified"
            self.refused[reason] += 1
            self.refusal_ms.append(ms)
            self.refusal_ms_by_reason.setdefault(reason, []).append(ms)
        elif 400 <= status < 500:
            self.other_4xx += 1
        else:
            self.err_5xx += 1
            if len(self.samples_5xx) < 3:
                self.samples_5xx.append(f"{status} {body[:200]!r}")


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def p99(t: Tally) -> float:
    """p99 latency (ms) of the answered requests; NaN when none was answered."""
    return pct(t.latencies_ms, 99)


def total(tallies: dict[str, Tally]) -> Tally:
    t = Tally()
    for x in tallies.values():
        t.add(x)
    return t


class Burner:
    """A child process that copies memory for `cores` of one core (its CPU time held to
    `cores` x the clock) until the block ends: the CPU and the cache traffic of a client
    sending 600 KB bodies, without the requests. `pid` is the process's."""

    def __init__(self, cores: float) -> None:
        self.cores = cores
        self._proc: Any = None

    @property
    def pid(self) -> int:
        return int(self._proc.pid)

    def __enter__(self) -> Burner:
        import subprocess
        import sys

        self._proc = subprocess.Popen(
            [sys.executable, "-c",
             f"from bench.chaos_load import _burn; _burn({self.cores!r})"],
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            stdout=subprocess.PIPE)
        if not self._proc.stdout.readline():  # its start-up done, or it died
            self.__exit__()
            raise RuntimeError("the burner process exited before it started burning")
        return self

    def __exit__(self, *_: object) -> None:
        self._proc.kill()
        self._proc.wait()
        self._proc.stdout.close()


def _burn(cores: float, chunk: int = 600_000) -> None:
    src = bytearray(chunk)
    print("burning", flush=True)
    t0, c0 = time.monotonic(), time.process_time()
    while True:
        if time.process_time() - c0 < cores * (time.monotonic() - t0):
            bytes(src)  # one copy of a body
        else:
            time.sleep(0.0005)


def one_item_body(model_meta: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    t = model_meta["inputs"][0]
    x = np.random.default_rng(0).random([1, *t["shape"][1:]], dtype=np.float32)
    body, hlen = codec.encode_request({t["name"]: x})
    return body, {"Content-Type": "application/octet-stream", codec.HEADER_LENGTH: str(hlen)}


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


async def open_loop(host: str, rates: dict[str, float], slos_ms: dict[str, float],
                    duration_s: float, *, seed: int = 1, **kw: Any) -> dict[str, Tally]:
    """Poisson arrivals per model at `rates` (requests/s) for `duration_s` (`send_at`)."""
    arrivals = poisson_arrivals(np.random.default_rng(seed), rates, duration_s)
    return await send_at(host, arrivals, {m: slos_ms[m] for m in rates}, **kw)


async def send_at(host: str, arrivals: list[tuple[float, str]], slos_ms: dict[str, float], *,
                  hang_s: float = 10.0, max_inflight: int = 1024,
                  stop: asyncio.Event | None = None, fresh_connections: bool = False
                  ) -> dict[str, Tally]:
    """One one-item binary infer request per `(instant s, model)` of `arrivals` (sorted),
    each sent at its instant (open loop; until `stop` is set) by `LeanClient` (cheap in this
    process, which shares the server's cores). Latency from send to full answer.
    `fresh_connections`: each request on a new connection, closed after it (as from many
    clients), instead of kept-alive ones reused."""
    metas = {m: get_json(f"{host}/v2/models/{m}") for m in slos_ms}
    client = LeanClient(host, fresh=fresh_connections)
    requests = {m: client.post(f"/v2/models/{m}/infer", *one_item_body(metas[m]))
                for m in slos_ms}
    out = {m: Tally() for m in slos_ms}
    sem = asyncio.Semaphore(max_inflight)

    async def one(m: str) -> None:
        t = out[m]
        async with sem:
            t0 = time.perf_counter()
            try:
                status, data, rh = await client.send(requests[m], hang_s)
            except TimeoutError:
                t.sent += 1
                t.hung += 1
                return
            except OSError:  # ConnectionError among them
                t.sent += 1
                t.conn += 1
                return
            t1 = time.perf_counter()
            t.record(status, data, rh, (t1 - t0) * 1000, slos_ms[m], t1)

    try:
        t_start = time.perf_counter()
        tasks = []
        for at, m in arrivals:
            if stop is not None and stop.is_set():
                break
            delay = t_start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(m)))
        await asyncio.gather(*tasks)
    finally:
        client.close()
    return out


async def open_loop_sharded(host: str, rates: dict[str, float], slos_ms: dict[str, float],
                            duration_s: float, *, seed: int = 1, procs: int = 1
                            ) -> tuple[dict[str, Tally], float]:
    """`open_loop` split over `procs` processes (each a `procs`-th of every rate, a seed of
    its own), for loads one Python process cannot send. Returns the merged tallies and the
    CPU seconds the shards used (the forkserver's children: `os.times()` misses them);
    procs 1: `open_loop` here, 0 s."""
    if procs <= 1:
        return await open_loop(host, rates, slos_ms, duration_s, seed=seed), 0.0
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")  # forks from a clean, single-threaded process
    ctx.set_forkserver_preload(["bench.chaos_load"])
    start_at = time.time() + 0.5 + 0.05 * procs  # every shard starts its clock together
    pipes, shards = [], []
    for i in range(procs):
        mine, theirs = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_shard, daemon=True, args=(
            theirs, host, {m: r / procs for m, r in rates.items()}, slos_ms, duration_s,
            seed * 1000 + i, start_at))
        proc.start()
        theirs.close()
        pipes.append(mine)
        shards.append(proc)
    try:
        results = [await asyncio.to_thread(c.recv) for c in pipes]
    finally:
        for proc in shards:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
    merged = {m: Tally() for m in rates}
    for tallies, _ in results:
        for m, t in tallies.items():
            merged[m].add(t)
    return merged, sum(cpu for _, cpu in results)


def _shard(conn: Any, host: str, rates: dict[str, float], slos_ms: dict[str, float],
           duration_s: float, seed: int, start_at: float) -> None:
    from dstack.common.pauses import freeze_startup_objects

    freeze_startup_objects()
    time.sleep(max(0.0, start_at - time.time()))
    tallies = asyncio.run(open_loop(host, rates, slos_ms, duration_s, seed=seed))
    conn.send((tallies, sum(os.times()[:2])))
    conn.close()


# ------------------------------------------------------------------ big bodies from a child


def big_json(mb: float) -> bytes:
    """A valid mobilenet request (batch 8) of about `mb` MB: its floats written with as
    many digits as make it that big, so that all of it is numbers to parse."""
    n = 8 * 3 * 224 * 224
    digits = max(1, int(mb * 1e6 / n) - 3)
    flat = np.char.mod(f"%.{digits}f", np.random.default_rng(0).random(n))
    head = '{"inputs":[{"name":"input","datatype":"FP32","shape":[8,3,224,224],"data":['
    return (head + ",".join(flat.tolist()) + "]}]}").encode()


@dataclass(frozen=True, slots=True)
class BigBodiesResult:
    statuses: dict[str, int]  # "200", "429", "503", or the client error's name -> count
    slowest_s: dict[str, float]  # status -> its slowest answer
    cpu_s: float  # CPU the sending process used while sending


class BigBodySender:
    """Sends `n` concurrent POSTs of a `big_json(mb)` body to `url` from a spawned process
    (built there once), so that the process timing other traffic holds no delay of its
    own from sending hundreds of MB; `send()` is one storm."""

    def __init__(self, url: str, n: int, mb: float, hang_s: float = 120.0) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self.url, self.n, self.hang_s = url, n, hang_s
        self._pool = ProcessPoolExecutor(1, multiprocessing.get_context("spawn"),
                                         initializer=_big_body_init, initargs=(mb,))
        self.body_bytes = self._pool.submit(_big_body_len).result(120)

    def __enter__(self) -> BigBodySender:
        return self

    async def send(self) -> BigBodiesResult:
        fut = self._pool.submit(_big_body_storm, self.url, self.n, self.hang_s)
        return await asyncio.wrap_future(fut)

    def __exit__(self, *_: object) -> None:
        self._pool.shutdown(cancel_futures=True)


_BODY = b""


def _big_body_init(mb: float) -> None:
    global _BODY
    _BODY = big_json(mb)


def _big_body_len() -> int:
    return len(_BODY)


def _big_body_storm(url: str, n: int, hang_s: float) -> BigBodiesResult:
    cpu0 = time.process_time()
    got = post_bodies(url, _BODY, n, n, hang_s)
    return BigBodiesResult({k: len(v) for k, v in sorted(got.items())},
                           {k: max(v) for k, v in sorted(got.items())},
                           time.process_time() - cpu0)


def post_bodies(url: str, body: bytes, n: int, threads: int, hang_s: float, *,
                variants: bool = False) -> dict[str, list[float]]:
    """`n` POSTs of `body` to `url` from `threads` threads on kept-alive http.client
    connections: it sends a whole body before it reads, and `sendall` hands the kernel the
    body as it is (aiohttp moved the rest of a 60 MB body at each piece sent: 4 s of CPU
    for 20 bodies, on the workers' cores). With `variants`, of every four: a declared
    length, the same with `Connection: close`, chunked, chunked with `Connection: close`.
    What each got (a status, or the error's name) -> the seconds each took."""
    import http.client
    from concurrent.futures import ThreadPoolExecutor
    from urllib.parse import urlsplit

    u, piece = urlsplit(url), 1 << 16
    got: dict[str, list[float]] = {}

    def one_thread(k: int) -> None:
        c: http.client.HTTPConnection | None = None
        for i in range(k, n, threads):
            headers = {"Content-Type": "application/json",
                       **({"Connection": "close"} if variants and i % 2 == 1 else {})}
            c = c or http.client.HTTPConnection(u.hostname, u.port, timeout=hang_s)
            t0 = time.perf_counter()
            try:
                if variants and i % 4 >= 2:  # chunked
                    c.request("POST", u.path, encode_chunked=True,
                              body=(body[j:j + piece] for j in range(0, len(body), piece)),
                              headers={**headers, "Transfer-Encoding": "chunked"})
                else:
                    c.request("POST", u.path, body=body, headers=headers)
                r = c.getresponse()
                r.read()
                status, keep = str(r.status), not r.will_close
            except (OSError, http.client.HTTPException) as e:
                status, keep = type(e).__name__, False
            if not keep:
                c.close()
                c = None
            got.setdefault(status, []).append(time.perf_counter() - t0)
        if c is not None:
            c.close()

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one_thread, range(threads)))
    return got


# ------------------------------------------------------------------ hostile sockets


@dataclass
class SlowlorisResult:
    opened: int = 0  # sockets connected (and half a header sent), refills included
    connect_failed: int = 0
    closed: Counter = field(default_factory=Counter)  # how the server closed them -> count
    lifetime_s: dict[str, list[float]] = field(default_factory=dict)  # the same -> open..close
    still_open: int = 0  # not closed by the server within `wait_s` after the attack


def _close_kind(data: bytes) -> str:
    """How the server closed a half-header socket: "bare close" (the header timeout),
    "503 make room" (evicted at the connection cap), "503 refused" (over the cap when it
    connected), or the status line."""
    if not data:
        return "bare close"
    status, _, body = parse_status(data)
    if status == 503:
        return "503 make room" if b"make room" in body else "503 refused"
    return str(status or data[:40])


async def slowloris(host: str, port: int, n: int, hold_s: float, wait_s: float,
                    refill_s: float = 0.1) -> SlowlorisResult:
    """`n` connections that each send half a request header and stop, kept at `n` for
    `hold_s` (a socket the server closes is opened again `refill_s` later); then each
    still open is watched for up to `wait_s`. A socket's life: its connect to its close."""
    out = SlowlorisResult()
    t_stop = time.monotonic() + hold_s

    async def slot() -> None:
        while (t_open := time.monotonic()) < t_stop:
            try:
                r, w = await asyncio.open_connection(host, port)
                w.write(b"POST /v2/models/x/infer HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                await w.drain()
            except OSError:
                out.connect_failed += 1
                await asyncio.sleep(refill_s)
                continue
            out.opened += 1
            try:
                data = await asyncio.wait_for(r.read(), max(t_stop, t_open) + wait_s
                                              - time.monotonic())
                kind = _close_kind(data)
            except TimeoutError:
                out.still_open += 1
                w.close()
                return
            except ConnectionError:
                kind = "reset"
            finally:
                w.close()
            out.closed[kind] += 1
            out.lifetime_s.setdefault(kind, []).append(time.monotonic() - t_open)
            await asyncio.sleep(refill_s)

    await asyncio.gather(*(slot() for _ in range(n)))
    return out


async def stalled_uploads(host: str, port: int, n: int, declared: int, sent: int,
                          wait_s: float) -> Counter:
    """`n` uploads that declare `declared` bytes, send `sent` and stop: what each got
    within `wait_s` (status, "closed" with nothing, or "hung")."""
    async def one() -> str:
        r, w = await asyncio.open_connection(host, port)
        w.write(b"POST /v2/models/resnet18/infer HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % declared
                + b"{" + b" " * (sent - 1))
        await w.drain()
        try:
            data = await asyncio.wait_for(r.read(), wait_s)
        except TimeoutError:
            return "hung"
        except ConnectionError:
            return "reset"
        finally:
            w.close()
        status, _, body = parse_status(data)
        if not status:
            return "closed"
        return f"{status}" + ("" if decode_json_error(body) else " (not JSON)")

    return Counter(await asyncio.gather(*(one() for _ in range(n))))


async def fuzz(host: str, port: int, models: dict[str, dict[str, Any]], n: int, *,
               seed: int, concurrency: int, max_body_bytes: int, hang_s: float
               ) -> tuple[Counter, Tally, list[str]]:
    """`n` fuzzer cases on raw sockets (some with HTTP-level lies), `concurrency` at a
    time: status counts, a tally (5xx, hung, non-JSON errors), and examples of the bad."""
    rng = random.Random(seed)
    statuses: Counter = Counter()
    tally = Tally()
    bad: list[str] = []
    queue: asyncio.Queue = asyncio.Queue(maxsize=4 * concurrency)

    async def worker() -> None:
        while (item := await queue.get()) is not None:
            case, raw, lie = item
            try:
                r, w = await asyncio.open_connection(host, port)
            except OSError:
                tally.conn += 1
                continue
            try:
                w.write(raw)
                data = await asyncio.wait_for(r.read(), hang_s)
            except TimeoutError:
                tally.hung += 1
                if len(bad) < 5:
                    bad.append(f"hung: {case.mutations} {lie}")
                continue
            except ConnectionError:
                data = b""
            finally:
                w.close()
            status, _, body = parse_status(data)
            statuses[status] += 1
            tally.sent += 1
            if status == 429:
                try:
                    tally.refused[str(json.loads(body).get("reason", "unspecified"))] += 1
                except ValueError:
                    tally.refused["unspecified"] += 1
            elif 400 <= status < 500:
                tally.other_4xx += 1
            if status >= 500 or (status >= 400 and decode_json_error(body) is None):
                tally.err_5xx += status >= 500
                tally.non_json_errors += status < 500
                if len(bad) < 5:
                    bad.append(f"{status}: {case.mutations} {lie} {body[:150]!r}")

    workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
    for _ in range(n):
        case = fuzz_case(rng, models, max_body_bytes=max_body_bytes, over_limit_rate=0.005)
        raw, lie = wire_bytes(case, rng, lie_rate=0.05)
        await queue.put((case, raw, lie))
    for _ in workers:
        await queue.put(None)
    await asyncio.gather(*workers)
    return statuses, tally, bad
