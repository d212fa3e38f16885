"""What the HTTP and gRPC endpoints share: the KServe v2 operations over an
`InferenceBackend`, free of either protocol.

`server.app` (HTTP) and `server.grpc_server` (gRPC) each turn their wire format into
these calls and their answers or `DStackError`s back into it; admission, refusals,
the infer path and the counts behind `/metrics` and the statistics are the same for both.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dstack.common.backend import InferenceBackend, ModelStats
from dstack.common.errors import DStackError, ModelNotFound, RequestError, Unavailable
from dstack.common.types import ModelSpec, TensorSpec
from server import codec
from server.metrics import Metrics
from server.model_config import triton_model_config
from server.shm import SharedMemory

SERVER_NAME = "dstack"
MODEL_VERSION = "1"
PLATFORM = "pytorch_libtorch"  # what Triton reports for TorchScript models
EXTENSIONS = ["binary_tensor_data", "statistics", "model_repository", "model_configuration"]


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as of

    try:
        return of("dstack-serve")
    except PackageNotFoundError:
        return "0.0.0+unknown"


def _tensor_meta(t: TensorSpec) -> dict[str, Any]:
    return {"name": t.name, "datatype": t.datatype.value, "shape": list(t.shape)}


def model_metadata(spec: ModelSpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "versions": [MODEL_VERSION],
        "platform": PLATFORM,
        "inputs": [_tensor_meta(t) for t in spec.inputs],
        "outputs": [_tensor_meta(t) for t in spec.outputs],
        "max_batch_size": spec.max_batch_size,
    }


def triton_stats(s: ModelStats) -> dict[str, Any]:
    """One entry of Triton's `model_stats` from a `ModelStats`.

    Triton sums durations per request; we know the total time requests spent queued and
    the total time batches ran, so those are reported as `queue` and `compute_infer`, and
    the raw counters (refusals, SLO, pending) under `dstack`.
    """
    avg_batch = s.inference_count / s.execution_count if s.execution_count else 0.0
    return {
        "name": s.model,
        "version": MODEL_VERSION,
        "inference_count": s.inference_count,
        "execution_count": s.execution_count,
        "inference_stats": {
            "success": {"count": s.request_success},
            "fail": {"count": s.request_failure},
            "queue": {"count": s.request_success, "ns": s.queue_ns},
            "compute_infer": {"count": s.execution_count, "ns": s.compute_ns},
        },
        "dstack": {**s.to_dict(), "avg_batch_size": avg_batch},
    }


class ServingApi:
    """The operations of the KServe v2 surface over `backend`, for any protocol.

    `metrics` counts every failed infer request (`count_failure`), wherever it came from,
    so that the statistics and `/metrics` say the same; `observe_latency` times answered
    ones into the dashboard's histogram. `shm`: the shared-memory extensions (off: none)."""

    def __init__(self, backend: InferenceBackend, metrics: Metrics,
                 observe_latency: Callable[[str, float], None],
                 shm: SharedMemory | None = None) -> None:
        self.backend = backend
        self.metrics = metrics
        self.observe_latency = observe_latency
        self.shm = shm if shm is not None else SharedMemory(False)
        self.server_meta = {"name": SERVER_NAME, "version": version(),
                            "extensions": [*EXTENSIONS, *self.shm.extensions]}
        # A backend that can queue requests while a model's worker restarts says itself
        # whether one can be taken now (`Runtime.check_admission`); others must be ready.
        self.check_admission: Callable[[str], None] = getattr(
            backend, "check_admission", self.require_ready)
        # A backend that can tell whether it would refuse n items now, without queuing
        # them, says so once the request's header is parsed (`Runtime.check_batch`).
        # (model, n, since_s, ready_s): see `Runtime.check_batch`.
        self.check_batch: Callable[[str, int, float, float], None] | None = getattr(
            backend, "check_batch", None)
        # (model, seconds from the first byte to the whole body): `Runtime.observe_body`.
        self.observe_body: Callable[[str, float], None] | None = getattr(
            backend, "observe_body", None)
        # A request let through at its header with a hold on the queue (server.early.HELD)
        # gives it back just before its real batch is checked.
        self.release: Callable[..., None] | None = getattr(backend, "release", None)

    # ------------------------------------------------------------------ models

    def spec_of(self, model: str, version: str | None) -> ModelSpec:
        """The model's spec; ModelNotFound (404) for an unknown name or version (None
        and "" are the one version)."""
        spec = self.backend.spec(model)  # ModelNotFound (404) for unknown names
        if version and version != MODEL_VERSION:
            raise ModelNotFound(
                f"model {model} has no version {version!r} (only {MODEL_VERSION!r})"
            )
        return spec

    def require_ready(self, model: str) -> None:
        if not self.backend.is_model_ready(model):
            raise Unavailable(f"model {model} is not ready")

    def model_stats(self, model: str, version: str | None) -> dict[str, Any]:
        """Triton's statistics of one model (an entry of `model_stats`)."""
        self.spec_of(model, version)
        # Failures are counted in one place, where every failed infer request passes
        # (`count_failure`: refusals before the backend saw the request included), and
        # read from there by /metrics too, so that both say the same.
        s = dataclasses.replace(self.backend.stats(model),
                                request_failure=self.metrics.failures.total(model))
        return triton_stats(s)

    def model_config(self, model: str, version: str | None) -> dict[str, Any]:
        return triton_model_config(self.backend, self.spec_of(model, version), PLATFORM)

    # ------------------------------------------------------------------ repository

    def repository_index(self, only_ready: bool) -> list[dict[str, str]]:
        """Every model known, loaded or not, with its state (READY ones only if asked)."""
        index_of = getattr(self.backend, "repository_index", None)
        if index_of is not None:
            entries = [{"name": e.name, "version": MODEL_VERSION, "state": e.state.value,
                        **({"reason": e.reason} if e.reason else {})} for e in index_of()]
        else:
            entries = [{"name": m, "version": MODEL_VERSION,
                        "state": "READY" if self.backend.is_model_ready(m) else "UNAVAILABLE"}
                       for m in self.backend.model_names()]
        return [e for e in entries if not only_ready or e["state"] == "READY"]

    @staticmethod
    def load_config(config: object) -> dict[str, Any] | None:
        """The model config a load request carries in `parameters.config` (Triton's: the
        config as a JSON string; a JSON object is taken too), or None without one."""
        if isinstance(config, str):
            try:
                config = json.loads(config)
            except ValueError as e:
                raise RequestError(f"parameters.config is not JSON: {e}") from None
        if config is not None and not isinstance(config, dict):
            raise RequestError("parameters.config must be a JSON object (as a string)")
        return config

    def repository(self, action: str) -> Any:
        """The backend's `load_model` or `unload_model`; RequestError when it has none."""
        fn = getattr(self.backend, f"{action}_model", None)
        if fn is None:
            raise RequestError(f"this server cannot {action} models at run time")
        return fn

    # ------------------------------------------------------------------ infer

    async def decode_data(self, head: codec.RequestHead, model: str,
                          received: float) -> codec.InferRequest:
        """The request's JSON values, parsed on the loop a piece at a time (0.2 to
        1.4 ms each), letting other requests run between pieces (docs/limits.md).
        After the first piece of a body with more, the backend is asked again whether the
        request can meet its SLO, its parse taking yet what the rest takes at this
        piece's pace: a body that would be parsed too late is refused unparsed."""
        steps = codec.decode_data(head)
        first = self.check_batch is not None
        while True:
            t0 = time.perf_counter()  # the parser's time only, not other requests' turns
            try:
                done = next(steps)
            except StopIteration as end:
                return end.value  # type: ignore[no-any-return]
            if first and self.check_batch is not None:
                first = False
                rest_s = (time.perf_counter() - t0) * (head.json_bytes - done) / done
                self.check_batch(model, head.batch_size, time.monotonic() - received, rest_s)
            await asyncio.sleep(0)

    async def run(self, model: str, head: codec.RequestHead,
                  received: float) -> tuple[codec.InferRequest, dict[str, np.ndarray]]:
        """An admitted request (`check_admission` passed) whose header is parsed: refused
        by its batch size before its values are parsed, else parsed and run. `received`:
        its first byte (time.monotonic()), from which its deadline counts."""
        if self.check_batch is not None:
            self.check_batch(model, head.batch_size, time.monotonic() - received, 0.0)
        req = await self.decode_data(head, model, received)
        outputs = await self.backend.infer(model, req.inputs, time.monotonic() - received)
        return req, outputs

    def count_failure(self, model: str, e: BaseException, stage: str,
                      received: float | None) -> None:
        """An infer request for a known model failed with `e`: a `DStackError` counted
        (and a refusal timed) under `stage` (`server.metrics.REFUSAL_STAGES`), anything
        else counted as ours ("backend")."""
        if isinstance(e, DStackError):
            self.metrics.failed(model, e, stage, received)
        else:
            self.metrics.failures.add(model, "backend")
