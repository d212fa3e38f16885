"""Unloading a model with requests queued (real tiny_cnn workers): the queued ones are
answered, later ones are refused naming the unload, the other model is served all along."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from dstack.common.config import parse_config
from dstack.common.errors import ModelNotFound, Unavailable
from dstack.runtime.serving import Runtime

X = np.zeros((1, 3, 32, 32), np.float32)


def test_unload_finishes_the_queue_then_refuses_naming_the_unload() -> None:
    cfg = parse_config({"models": [
        {"name": n, "zoo_name": "tiny_cnn", "slo_ms": 20_000, "max_batch_size": 2}
        for n in ("a", "b")]})

    async def main() -> None:
        rt = Runtime(cfg)
        await rt.start()
        try:
            queued = [asyncio.create_task(rt.infer("b", {"input": X})) for _ in range(12)]
            await asyncio.sleep(0)  # admitted, most of them still queued
            unload = asyncio.create_task(rt.unload_model("b"))
            other = [asyncio.create_task(rt.infer("a", {"input": X})) for _ in range(6)]
            await asyncio.sleep(0.001)
            with pytest.raises(Unavailable, match="being unloaded"):
                await rt.infer("b", {"input": X})
            assert await unload is True
            for t in (*queued, *other):  # every one answered
                assert (await t)["output"].shape == (1, 10)
            with pytest.raises(ModelNotFound, match="not loaded: unloaded"):
                await rt.infer("b", {"input": X})
            assert rt.model_names() == ["a"] and rt.is_ready()
            assert [(e.name, e.state.value) for e in rt.repository_index()] == [
                ("a", "READY"), ("b", "UNAVAILABLE")]
            assert await rt.unload_model("b") is False  # not loaded: nothing to do
            assert await rt.load_model("b") is True  # the config it had
            assert (await rt.infer("b", {"input": X}))["output"].shape == (1, 10)
            assert await rt.load_model("b") is False
        finally:
            await rt.stop()

    asyncio.run(main())
