"""A server whose event loop falls behind refuses from the header what it would no longer
answer in time (real tiny_cnn worker): every request it has not admitted yet still waits
for the loop several times (its body, its batch's launch and end, its answer), so the
checks before admission count the loop's lag (`Runtime.loop_lag_s`). Without it, a loop
short of CPU let requests in that then expired in the queue, each one's body read and
parsed for nothing: the server took more CPU the further it fell behind, and its goodput
went to nothing (docs/decisions.md). /metrics shows the lag."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import httpx
import numpy as np
import pytest

from dstack.common.config import parse_config
from dstack.common.errors import DeadlineRefused
from dstack.runtime.serving import Runtime
from server import codec
from server.app import create_app
from tests.integration.test_metrics import samples

X = np.zeros((1, 3, 32, 32), np.float32)


async def _post(http: httpx.AsyncClient) -> httpx.Response:
    body, hlen = codec.encode_request({"input": X})
    return await http.post("/v2/models/tiny/infer", content=body,
                           headers={codec.HEADER_LENGTH: str(hlen)})


@contextlib.asynccontextmanager
async def _served_tiny() -> AsyncIterator[tuple[Runtime, httpx.AsyncClient]]:
    """tiny_cnn (100 ms SLO) served by a real runtime through the app, its estimate
    trusted: five requests answered, each in a few ms."""
    cfg = parse_config({"models": [{"name": "tiny", "zoo_name": "tiny_cnn", "slo_ms": 100,
                                    "max_batch_size": 4}]})
    rt = Runtime(cfg)
    await rt.start()
    transport = httpx.ASGITransport(app=create_app(rt, max_body_bytes=1 << 22))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     timeout=60) as http:
            for _ in range(5):
                assert (await _post(http)).status_code == 200
            yield rt, http
    finally:
        await rt.stop()


async def _hog(seconds: float, block_s: float) -> None:
    """Hold the loop for `block_s` at a time: what a server short of CPU looks like."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(block_s)
        await asyncio.sleep(0)


def test_requests_are_refused_at_the_header_while_the_loop_runs_late() -> None:
    async def main() -> None:
        async with _served_tiny() as (rt, http):
            rt.refuse_early("tiny")  # an idle loop: admitted
            time.sleep(0.3)  # a single block (the app's start-up, say) ...
            await asyncio.sleep(0.1)
            assert rt.loop_lag_s < 0.01  # ... says nothing of the requests after it
            rt.refuse_early("tiny")
            # A loop that stays 250 ms behind runs its timer 4 times a second: the mean
            # is over time, not over samples, so it sees most of that within 2 s.
            hog = asyncio.create_task(_hog(3.0, 0.25))
            await asyncio.sleep(2.0)
            assert rt.loop_lag_s > 0.15
            with pytest.raises(DeadlineRefused) as refused:
                rt.refuse_early("tiny")
            assert refused.value.rule == "work_ahead"
            assert "the server's loop that long to get to it" in refused.value.message
            lag = samples((await http.get("/metrics")).text)["dstack_event_loop_lag_seconds"]
            assert lag[()] > 0.15
            await hog
            for _ in range(80):  # the lag dies down with the loop's, within seconds
                await asyncio.sleep(0.1)
                if rt.loop_lag_s < 0.02:
                    break
            assert rt.loop_lag_s < 0.02
            rt.refuse_early("tiny")
            assert (await _post(http)).status_code == 200

    asyncio.run(main())


def test_metrics_count_each_tick_the_loop_was_held_up() -> None:
    """/metrics `dstack_event_loop_late_seconds`: how late each tick of the loop's 10 ms
    timer fired, a Prometheus histogram. An idle loop has no tick over 250 ms late; a loop
    held three times for 300 ms has three ticks between 250 ms and 1 s late, and their
    time in the sum."""
    def late(text: str) -> tuple[dict[str, float], float]:
        got = samples(text)
        return ({dict(k)["le"]: v for k, v in got["dstack_event_loop_late_seconds_bucket"].items()},
                got["dstack_event_loop_late_seconds_sum"][()])

    async def main() -> None:
        async with _served_tiny() as (_, http):
            await asyncio.sleep(0.3)
            idle, idle_sum = late((await http.get("/metrics")).text)
            assert idle["+Inf"] >= 10  # ticks, cumulative buckets
            assert idle["0.25"] == idle["+Inf"]
            for _ in range(3):
                time.sleep(0.3)  # the timer falls due within the first 10 ms of it
                await asyncio.sleep(0.05)
            held, held_sum = late((await http.get("/metrics")).text)
            assert held["1.0"] - held["0.25"] >= 3
            assert held_sum - idle_sum > 0.85

    asyncio.run(main())


def test_a_check_before_the_body_counts_the_time_bodies_take_to_arrive() -> None:
    """Bodies that take most of the SLO to read: a request is refused at its header (no
    body read) rather than let through and refused, or answered late, once its body is
    in; when bodies come fast again, or none has been read for a couple of seconds,
    requests are let through again."""
    async def main() -> None:
        async with _served_tiny() as (rt, http):  # each body read in well under 1 ms
            rt.refuse_early("tiny")
            for _ in range(40):  # then bodies take 120 ms of the 100 ms SLO to come
                rt.observe_body("tiny", 0.12)
            with pytest.raises(DeadlineRefused) as refused:
                rt.refuse_early("tiny")
            assert refused.value.rule == "work_ahead"
            assert "more to arrive or parse" in refused.value.message
            rt.check_batch("tiny", 1)  # the same request with its body in: admitted
            for _ in range(60):
                assert (await _post(http)).status_code == 200  # fast bodies again
            rt.refuse_early("tiny")
            # Slow bodies again, then none read: refusing at the header reads no body,
            # so the estimate fades by itself and the model is let through once more.
            for _ in range(40):
                rt.observe_body("tiny", 0.12)
            with pytest.raises(DeadlineRefused):
                rt.refuse_early("tiny")
            await asyncio.sleep(2.0)
            rt.refuse_early("tiny")

    asyncio.run(main())


def test_metrics_show_what_admission_counts_besides_compute() -> None:
    """/metrics gives the terms a refusal's message adds up (`dstack_admission_seconds`:
    the body's arrival, the loop's turns, a batch's hand-over, the answer's way out) and
    the margin: bodies that take 120 ms to come show as a body term of 120 ms, the one
    that refuses the next request at its header."""
    def terms(text: str) -> dict[str, float]:
        got = samples(text)["dstack_admission_seconds"]
        return {dict(k)["term"]: v for k, v in got.items() if dict(k)["model"] == "tiny"}

    async def main() -> None:
        async with _served_tiny() as (rt, http):
            text = (await http.get("/metrics")).text
            before = terms(text)
            assert set(before) == {"body", "loop", "overhead", "delivery"}
            assert 0 < before["overhead"] < 0.1  # five batches handed over and back
            assert before["body"] < 0.05
            assert samples(text)["dstack_admission_margin"][(("model", "tiny"),)] >= 1.0
            for _ in range(40):
                rt.observe_body("tiny", 0.12)
            after = terms((await http.get("/metrics")).text)
            assert after["body"] == pytest.approx(0.12, rel=0.2)  # it fades while idle
            with pytest.raises(DeadlineRefused, match="more to arrive or parse"):
                rt.refuse_early("tiny")

    asyncio.run(main())


def test_while_bodies_come_slower_than_usual_fewer_are_read_at_once() -> None:
    """Bodies slower than usual (what reading too many at once does to a busy process)
    bring the number read at once down to two: a third request let through at its header
    meanwhile is refused there, by a message that says so, and counted; when one is back,
    or has taken longer than `reading.COUNTS_S` (a stalled upload), another is let
    through; a stalled upload's place is not taken over by the requests after it."""
    async def main() -> None:
        async with _served_tiny() as (rt, http):
            assert rt.read_limit is not None and rt.read_limit.limit == 64
            for _ in range(50):
                rt.observe_body("tiny", 0.02)  # the usual time was well under 1 ms
            assert rt.read_limit.limit == 2
            gauge = samples((await http.get("/metrics")).text)["dstack_body_reads_limit"]
            assert gauge == {(): 2.0}
            before = rt.stats("tiny").refused
            stalled = rt.refuse_early("tiny", hold=True)
            second = rt.refuse_early("tiny", hold=True)
            assert stalled is not None and second is not None and stalled != second
            with pytest.raises(DeadlineRefused) as refused:
                rt.refuse_early("tiny", hold=True)
            assert refused.value.rule == "work_ahead"
            assert "reading 2 request bodies already" in refused.value.message
            assert "server.max_body_reads 64" in refused.value.message
            assert rt.stats("tiny").refused == before + 1
            rt.check_batch("tiny", 1)  # a request whose body is in is not held back by it
            rt.release("tiny", second)
            third = rt.refuse_early("tiny", hold=True)
            await asyncio.sleep(0.06)  # `stalled` and `third` have taken 60 ms: not counted
            for _ in range(5):  # requests come and go; `stalled` is still being read
                rt.release("tiny", rt.refuse_early("tiny", hold=True))
            rt.refuse_early("tiny", hold=True)
            rt.refuse_early("tiny", hold=True)
            with pytest.raises(DeadlineRefused):
                rt.refuse_early("tiny", hold=True)
            rt.release("tiny", stalled)
            rt.release("tiny", third)

    asyncio.run(main())


def test_a_model_kept_up_with_whose_slo_dwarfs_its_bodies_is_not_held_to_the_read_limit() -> None:
    """Bodies ten times slower than usual bring the limit to two. While they still take a
    small part of the model's SLO (1.5 ms of 100 ms) and the server refuses none of its
    requests, a third request is let through at its header all the same; a request is
    refused there while its bodies take 20 ms, and while a third of its model's header
    checks were refused."""
    def bodies(rt: Runtime, seconds: float, n: int) -> None:
        for _ in range(n):
            rt.observe_body("tiny", seconds)

    async def main() -> None:
        async with _served_tiny() as (rt, http):
            assert rt.read_limit is not None
            bodies(rt, 0.00015, 50)
            bodies(rt, 0.0015, 60)
            assert rt.read_limit.limit == 2
            held = [rt.refuse_early("tiny", hold=True) for _ in range(3)]
            bodies(rt, 0.02, 40)
            with pytest.raises(DeadlineRefused, match="reading 3 request bodies already"):
                rt.refuse_early("tiny", hold=True)
            # No body read for a second: what they take fades, and the three let through
            # are no longer counted as being read (`reading.COUNTS_S`).
            await asyncio.sleep(1.0)
            held += [rt.refuse_early("tiny", hold=True) for _ in range(3)]
            for _ in range(6):  # each one's deadline gone by at its header
                with pytest.raises(DeadlineRefused, match="over its SLO"):
                    rt.refuse_early("tiny", since_s=1.0, hold=True)
            with pytest.raises(DeadlineRefused, match="reading 3 request bodies already"):
                rt.refuse_early("tiny", hold=True)
            for token in held:
                rt.release("tiny", token)

    asyncio.run(main())


def test_no_limit_on_bodies_read_at_once_when_configured_off() -> None:
    cfg = parse_config({"server": {"max_body_reads": 0},
                        "models": [{"name": "tiny", "zoo_name": "tiny_cnn", "slo_ms": 100}]})
    assert Runtime(cfg).read_limit is None
