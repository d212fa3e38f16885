"""Real CPU workers: double buffering answers every request with its own rows (the same
outputs as one arena half), inputs in a client's device memory reach a CPU worker through
the host, and `batching: rate` serves requests correctly."""

from __future__ import annotations

import asyncio
import functools
import os

import numpy as np
import pytest
import torch

import models
from dstack.common.config import parse_config
from dstack.runtime.serving import Runtime
from dstack.runtime.staging import DeviceInput

pytestmark = pytest.mark.slow


def config(**top: object) -> dict:
    return {
        "policy": "shared",
        "cores": [0, 1] if len(os.sched_getaffinity(0)) >= 2 else None,
        "adapt": {"enabled": False},
        "models": [{"name": "tiny", "zoo_name": "tiny_cnn", "slo_ms": 5000,
                    "max_batch_size": 8, "max_queue_delay_ms": 2}],
        **top,
    }


@functools.cache
def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # as the worker does: the same random weights
    return models.load_model("tiny_cnn")


def reference(x: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return _model()(torch.from_numpy(x)).numpy()


def inputs(n_requests: int) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.standard_normal((1 + i % 3, 3, 32, 32), dtype=np.float32)
            for i in range(n_requests)]


async def _serve(rt: Runtime, xs: list[np.ndarray], gap_s: float) -> list[np.ndarray]:
    async def one(i: int) -> np.ndarray:
        await asyncio.sleep(gap_s * i)  # arrivals spread out: many land mid-batch
        return (await rt.infer("tiny", {"input": xs[i]}))["output"]

    return await asyncio.gather(*(one(i) for i in range(len(xs))))


def run(cfg: dict, xs: list[np.ndarray], gap_s: float) -> tuple[list[np.ndarray], Runtime]:
    async def main() -> tuple[list[np.ndarray], Runtime]:
        rt = Runtime(parse_config(cfg))
        await rt.start()
        try:
            return await _serve(rt, xs, gap_s), rt
        finally:
            await rt.stop()

    return asyncio.run(main())


def test_double_buffering_answers_every_request_with_its_own_rows() -> None:
    xs = inputs(160)
    want = [reference(x) for x in xs]
    outs: dict[bool, list[np.ndarray]] = {}
    for double in (True, False):
        got, rt = run(config(double_buffer=double), xs, gap_s=0.0005)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g.shape == w.shape, i
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=f"request {i}")
        outs[double] = got
        stagers = list(rt._stagers.values())
        if double:
            # rows were written ahead, while a batch computed, and batches alternated
            assert len(stagers) == 1 and stagers[0].rows_ahead > 0
            assert len(rt.batch_log) > 1
        else:
            assert not stagers
    for a, b in zip(outs[True], outs[False], strict=True):
        np.testing.assert_array_equal(a, b)


def test_device_memory_inputs_reach_a_cpu_worker_through_the_host() -> None:
    """A CUDA shared-memory input (`DeviceInput`, here read from a host array) given to a
    CPU worker is read once, into its rows, double-buffered or not; the worker takes the
    server's word that a client's allocation is gone (`ForgetMemory`, which it never
    answers) and its next batches are still answered right."""
    xs = inputs(24)
    reads = [0] * len(xs)

    def device_input(i: int) -> DeviceInput:
        def read() -> np.ndarray:
            reads[i] += 1
            return xs[i]
        return DeviceInput(bytes([i]) * 64, 0, xs[i].shape, xs[i].dtype, read)

    for double in (True, False):
        reads[:] = [0] * len(xs)

        async def main(double: bool) -> list[np.ndarray]:
            rt = Runtime(parse_config(config(double_buffer=double)))
            await rt.start()
            try:
                got = []
                for i in range(len(xs)):
                    if i % 4 == 0:
                        rt.forget_device_memory(bytes([i]) * 64)
                    plain = {"input": xs[i]} if i % 2 else {"input": device_input(i)}
                    got.append((await rt.infer("tiny", plain))["output"])
                return got
            finally:
                await rt.stop()

        got = asyncio.run(main(double))
        for i, g in enumerate(got):
            np.testing.assert_allclose(g, reference(xs[i]), rtol=1e-4, atol=1e-5,
                                       err_msg=f"request {i}, double_buffer {double}")
        assert reads == [0 if i % 2 else 1 for i in range(len(xs))], double


def test_rate_batching_serves_requests_correctly_with_real_workers() -> None:
    xs = inputs(200)
    cfg = config()
    cfg["models"][0]["batching"] = "rate"
    got, rt = run(cfg, xs, gap_s=0.002)
    for g, x in zip(got, xs, strict=True):
        np.testing.assert_allclose(g, reference(x), rtol=1e-4, atol=1e-5)
    assert rt.stats("tiny").inference_count == sum(x.shape[0] for x in xs)
    # the rule had a rate to go on (not only the window it starts with)
    assert "tiny" in rt.policy.rate_batches  # type: ignore[union-attr]
