"""The runtime on a real NVIDIA GPU with MPS slices (skipped without CUDA): a private
control daemon started and stopped by the runtime, workers proven to be MPS clients, and
refusals when there is no daemon."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import models
from dstack.common import mps
from dstack.common.config import parse_config
from dstack.common.errors import Unavailable
from dstack.common.slices import MpsSlices, SliceSpec
from dstack.common.types import Cell, DeviceInfo, Profile
from dstack.runtime.serving import Runtime
from dstack.runtime.worker import WorkerConfig, WorkerHandle, arena_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(shutil.which(mps.CONTROL) is None, reason="no nvidia-cuda-mps-control"),
]

KNEES = {"tiny_a": 30.0, "tiny_b": 50.0}


def write_cuda_profiles(directory: Path) -> None:
    """Hand-made CUDA profiles of tiny_cnn whose knees give the two models 30% and 50%."""
    for name, kp in KNEES.items():
        cells = [Cell(b, pct, 1.0 + 0.1 * b, 1.2 + 0.1 * b, pct, None)
                 for b in (1, 8) for pct in (kp, 100.0)]
        Profile(name, DeviceInfo("cuda", "test-gpu", 132, "SMs"), "mps", (1, 8),
                (kp, 100.0), tuple(cells), knee={1: kp, 8: kp},
                provenance="hand-made for tests").save(directory / f"{name}.json")


def deploy(profiles: Path, weights: Path | None = None) -> dict:
    extra = {"weights": str(weights)} if weights else {}
    return {
        "device": "cuda", "policy": "spatial", "profiles": str(profiles),
        "adapt": {"enabled": False},
        "models": [{"name": n, "zoo_name": "tiny_cnn", "slo_ms": 2000, "max_batch_size": 8,
                    "max_queue_delay_ms": 2, "rate_rps": 20, **extra} for n in KNEES],
    }


def reference(x: np.ndarray, weights: Path) -> np.ndarray:
    m = models.load_model("tiny_cnn", weights=weights)
    with torch.inference_mode():
        return m(torch.from_numpy(x)).numpy()


def test_two_models_on_mps_slices_serve_correct_outputs(tmp_path: Path) -> None:
    write_cuda_profiles(tmp_path)
    # the workers' random init differs from ours: serve weights from a file instead
    weights = tmp_path / "w.pt"
    torch.manual_seed(0)
    torch.save(models.load_model("tiny_cnn").state_dict(), weights)
    cfg = parse_config(deploy(tmp_path, weights))
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((1 + i % 3, 3, 32, 32), dtype=np.float32) for i in range(24)]
    names = list(KNEES)

    async def main() -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
        slices = MpsSlices(base_env=env)  # no pipe directory set: starts a private daemon
        rt = Runtime(cfg, slices=slices)
        await rt.start()
        daemon_env = {**env, **slices.worker_env()}
        pipe = daemon_env["CUDA_MPS_PIPE_DIRECTORY"]
        try:
            for n in names:
                assert rt.current_slice(n) == SliceSpec(KNEES[n], (), "cuda", "mps")
            # both workers are clients of the runtime's own daemon
            servers = mps.server_list(daemon_env)
            clients = {c for s in servers for c in mps.client_list(daemon_env, s)}
            for n in names:
                assert rt.supervisor.worker(n).pid in clients  # type: ignore[union-attr]
            outs = await asyncio.gather(*(rt.infer(names[i % 2], {"input": x})
                                          for i, x in enumerate(xs)))
            for x, out in zip(xs, outs, strict=True):
                # GPU (cuDNN may use TF32) against the CPU: close, not bit-equal
                np.testing.assert_allclose(out["output"], reference(x, weights), rtol=2e-2,
                                           atol=2e-3)
        finally:
            await rt.stop()
        assert not os.path.exists(pipe), "the runtime's private MPS daemon was not cleaned up"

    asyncio.run(main())


def test_runtime_refuses_when_no_daemon_answers(tmp_path: Path) -> None:
    write_cuda_profiles(tmp_path)
    cfg = parse_config(deploy(tmp_path))
    empty = tmp_path / "no-daemon"
    empty.mkdir()
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(empty)}

    async def main() -> None:
        rt = Runtime(cfg, slices=MpsSlices(base_env=env))  # pipe set: attach, never start
        with pytest.raises(mps.MpsError, match="no MPS control daemon answers"):
            await rt.start()

    asyncio.run(main())


def test_worker_that_fell_back_to_plain_cuda_fails_to_start(tmp_path: Path) -> None:
    """Its pipe directory has no daemon: the driver silently makes a plain CUDA context,
    which the worker must notice and refuse."""
    empty = tmp_path / "no-daemon"
    empty.mkdir()
    spec = models.spec("tiny_cnn")
    wcfg = WorkerConfig(
        model="tiny", zoo_name="tiny_cnn", spec=spec, slice=SliceSpec(30.0, (), "cuda", "mps"),
        arena_name="", layout=arena_for(spec),
        extra_env={"CUDA_MPS_PIPE_DIRECTORY": str(empty), "CUDA_MPS_LOG_DIRECTORY": str(empty)},
    )

    async def main() -> None:
        h = WorkerHandle.create(wcfg)
        try:
            with pytest.raises(Unavailable, match="not running under MPS"):
                await h.start(timeout_s=120)
        finally:
            await h.kill()

    asyncio.run(main())
