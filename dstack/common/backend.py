"""The seam between the HTTP server and the runtime.

`server/` speaks HTTP and the wire format and calls only this interface; the runtime
(`dstack.runtime.serving.Runtime`) implements it. Tests of the server may use a small fake.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from dstack.common.config import DeployConfig
from dstack.common.types import ModelSpec, Plan, Schedule


@dataclass(frozen=True, slots=True)
class ModelStats:
    """Counts since start-up, as Triton reports them (`/v2/models/{m}/stats`)."""

    model: str
    request_success: int
    request_failure: int
    inference_count: int  # items inferred (sum of batch sizes)
    execution_count: int  # batches run
    queue_ns: int  # total time requests spent queued
    compute_ns: int  # total time spent in batches
    refused: int  # refused for queue full or SLO
    slo_met: int  # successes answered within the SLO
    pending: int  # requests queued or running now

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}


class InferenceBackend(Protocol):
    """What the server needs. Every method is called on the server's event loop."""

    def model_names(self) -> list[str]: ...

    def spec(self, model: str) -> ModelSpec:
        """The served spec (max batch from the config). Raises ModelNotFound."""
        ...

    def is_ready(self) -> bool: ...

    def is_model_ready(self, model: str) -> bool: ...

    async def infer(self, model: str, inputs: dict[str, np.ndarray],
                    since_received_s: float = 0.0) -> dict[str, np.ndarray]:
        """Run one request of n items (every input has leading dimension n, already
        checked against the spec). Returns every output with leading dimension n.
        `since_received_s`: how long ago the server received the request (its SLO
        counts from then). Raises a DStackError subclass on every failure path; never
        hangs."""
        ...

    def stats(self, model: str) -> ModelStats: ...

    def plan(self) -> Plan | None: ...

    def schedule(self) -> Schedule | None: ...

    def policy_name(self) -> str: ...

    def deploy_config(self) -> DeployConfig:
        """The deployment being served (each model's SLO, batching, priority; the device)."""
        ...

    def forget_device_memory(self, handle: bytes) -> None:
        """A client's device allocation (its `cudaIpcMemHandle_t`) is no longer registered
        and no request reads from it: workers that opened it close it."""
        ...
