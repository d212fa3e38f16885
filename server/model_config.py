"""Triton's model configuration extension: `GET /v2/models/{m}[/versions/{v}]/config`.

The JSON is shaped like Triton's HTTP answer (its `ModelConfig` protobuf as JSON), so
Triton tooling (`tritonclient`'s `get_model_config`, perf_analyzer, dashboards) reads it:
dims without the batch dimension, `TYPE_*` datatypes, dynamic batching in microseconds.
What Triton has no field for goes under `parameters`, in Triton's own form
(`{"key": {"string_value": "..."}}`, strings only):

- `slo_ms`, `priority`, `rate_rps`, `max_queue`: the deployment file's values;
- `policy`: the scheduling policy serving the model;
- `planned_batch_size`, `slice_percent`: the `dstack` plan's batch and slice for the
  model (as `/v1/plan` shows them), or under a policy without a plan the batch size the
  policy aims for now and the slice the worker runs in; absent while unknown.
"""

from __future__ import annotations

from typing import Any

from dstack.common.backend import InferenceBackend
from dstack.common.config import DeviceKind
from dstack.common.types import ModelSpec, TensorSpec

BACKEND = "pytorch"  # Triton's backend for `pytorch_libtorch` models


def triton_model_config(
    backend: InferenceBackend, spec: ModelSpec, platform: str
) -> dict[str, Any]:
    """The Triton model config of the served model `spec` (already checked to exist)."""
    cfg = backend.deploy_config()
    m = next(m for m in cfg.models if m.name == spec.name)
    batch, percent = _batch_and_slice(backend, spec.name)
    params = {
        "slo_ms": f"{m.slo_ms:g}",
        "priority": m.priority.value,
        "rate_rps": f"{m.rate_rps:g}",
        "max_queue": str(m.max_queue),
        "policy": backend.policy_name(),
    }
    if batch is not None:
        params["planned_batch_size"] = str(batch)
    if percent is not None:
        params["slice_percent"] = f"{percent:g}"
    gpu = cfg.device is DeviceKind.CUDA
    return {
        "name": spec.name,
        "platform": platform,
        "backend": BACKEND,
        "version_policy": {"latest": {"num_versions": 1}},
        "max_batch_size": spec.max_batch_size,
        "input": [_tensor(t) for t in spec.inputs],
        "output": [_tensor(t) for t in spec.outputs],
        "dynamic_batching": {
            "preferred_batch_size": [batch] if batch is not None else [],
            "max_queue_delay_microseconds": round(m.max_queue_delay_ms * 1000),
        },
        # One worker process per model: one instance, on the device it was deployed on.
        "instance_group": [{
            "name": spec.name,
            "kind": "KIND_GPU" if gpu else "KIND_CPU",
            "count": 1,
            "gpus": [0] if gpu else [],
        }],
        "parameters": {k: {"string_value": v} for k, v in params.items()},
    }


def _tensor(t: TensorSpec) -> dict[str, Any]:
    # Triton's dims leave out the batch dimension when max_batch_size > 0 (always here).
    return {"name": t.name, "data_type": f"TYPE_{t.datatype.value}", "dims": list(t.shape[1:])}


def _batch_and_slice(backend: InferenceBackend, model: str) -> tuple[int | None, float | None]:
    """The plan's batch and slice for `model`; without a plan, what the runtime runs now
    (optional backend extras, as `server.metrics` reads them)."""
    plan = backend.plan()
    for p in plan.models if plan is not None else ():
        if p.model == model:
            return p.batch, p.percent
    cap_of = getattr(backend, "current_batch_cap", None)
    slice_of = getattr(backend, "current_slice", None)
    cap = cap_of(model) if cap_of is not None else 0
    current = slice_of(model) if slice_of is not None else None
    return (cap or None), (current.percent if current is not None else None)
