"""A small hand-written backend for the HTTP tests: numpy models, settable readiness."""

from __future__ import annotations

import numpy as np

from dstack.common.backend import ModelStats
from dstack.common.config import DeployConfig, parse_config
from dstack.common.errors import BackendError, ModelNotFound
from dstack.common.types import DType, ModelSpec, Plan, Schedule, TensorSpec

SPECS = {
    "double": ModelSpec(
        "double",
        (TensorSpec("x", DType.FP32, (-1, 3)),),
        (TensorSpec("y", DType.FP32, (-1, 3)), TensorSpec("argmax", DType.INT64, (-1,))),
        max_batch_size=4,
    ),
    "flip": ModelSpec(
        "flip",
        (TensorSpec("mask", DType.BOOL, (-1, 2)), TensorSpec("k", DType.UINT8, (-1, 2))),
        (TensorSpec("out", DType.BOOL, (-1, 2)),),
        max_batch_size=2,
    ),
    "broken": ModelSpec(
        "broken",
        (TensorSpec("x", DType.INT32, (-1,)),),
        (TensorSpec("y", DType.INT32, (-1,)),),
        max_batch_size=8,
    ),
}
# The deployment the fake reports (`deploy_config`): what `/config` reads.
DEPLOY = parse_config({
    "policy": "shared",
    "models": [
        {"name": "double", "slo_ms": 250, "max_batch_size": 4, "max_queue_delay_ms": 3,
         "max_queue": 64, "rate_rps": 20, "priority": "high"},
        {"name": "flip", "max_batch_size": 2},
        {"name": "broken"},
    ],
})


class FakeBackend:
    """Numpy models behind the InferenceBackend interface, with settable readiness."""

    def __init__(self) -> None:
        self.ready: dict[str, bool] = dict.fromkeys(SPECS, True)
        self.plan_: Plan | None = None
        self.schedule_: Schedule | None = None
        self.calls: dict[str, list[int]] = {m: [] for m in SPECS}
        self.failures: dict[str, int] = dict.fromkeys(SPECS, 0)
        self.started = self.stopped = False
        self.forgotten: list[bytes] = []  # handles of closed CUDA regions

    def model_names(self) -> list[str]:
        return list(SPECS)

    def spec(self, model: str) -> ModelSpec:
        if model not in SPECS:
            raise ModelNotFound(f"unknown model {model!r}")
        return SPECS[model]

    def is_ready(self) -> bool:
        return all(self.ready.values())

    def is_model_ready(self, model: str) -> bool:
        return self.ready[model]

    async def infer(self, model: str, inputs: dict[str, np.ndarray],
                    since_received_s: float = 0.0) -> dict[str, np.ndarray]:
        self.calls[model].append(next(iter(inputs.values())).shape[0])
        if model == "double":
            x = np.asarray(inputs["x"])  # read as a worker reads it (a CUDA region's too)
            return {"y": x * 2, "argmax": x.argmax(axis=1).astype(np.int64)}
        if model == "flip":
            return {"out": ~inputs["mask"] ^ (inputs["k"] > 0)}
        self.failures[model] += 1
        if inputs["x"][0] == 0:
            raise BackendError("worker for broken died")
        raise RuntimeError("boom")

    def stats(self, model: str) -> ModelStats:
        n = self.calls[model]
        return ModelStats(
            model=model,
            request_success=len(n) - self.failures[model],
            request_failure=self.failures[model],
            inference_count=sum(n),
            execution_count=len(n),
            queue_ns=1000 * len(n),
            compute_ns=5000 * len(n),
            refused=0,
            slo_met=len(n),
            pending=0,
        )

    def plan(self) -> Plan | None:
        return self.plan_

    def schedule(self) -> Schedule | None:
        return self.schedule_

    def policy_name(self) -> str:
        return "fake"

    def deploy_config(self) -> DeployConfig:
        return DEPLOY

    def forget_device_memory(self, handle: bytes) -> None:
        self.forgotten.append(handle)

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True
