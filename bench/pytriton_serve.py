"""Models of the project's zoo behind Triton, for `bench/bench_triton.py`: PyTriton
(Triton's C++ HTTP and gRPC front ends and dynamic batcher; the models in this Python
process, built with `weights=None`), each with the batch limit and queue delay of its
entry in a dstack config, the allocator settings of a dstack worker, the process's cores
split between the models' torch threads, and its shared-memory API open to clients.

    PYTHON_OF_A_PYTRITON_VENV bench/pytriton_serve.py HTTP_PORT GRPC_PORT METRICS_PORT MODELS

MODELS: the JSON list of a config's `models` entries (`name`, `zoo_name`, `max_batch_size`,
`max_queue_delay_ms`).
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dstack.common.heap import keep_heap  # noqa: E402

keep_heap()
import numpy as np  # noqa: E402
import torch  # noqa: E402
from pytriton.decorators import batch  # noqa: E402
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor  # noqa: E402
from pytriton.triton import (  # noqa: E402
    DEFAULT_PROTECTED_ENDPOINTS,
    Triton,
    TritonConfig,
    TritonSecurityConfig,
)

import models  # noqa: E402

http_port, grpc_port, metrics_port = map(int, sys.argv[1:4])
entries = json.loads(sys.argv[4])
torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // len(entries)))


def infer_fn(net: torch.nn.Module, out_name: str):  # type: ignore[no-untyped-def]
    @batch
    def infer(**inputs: np.ndarray) -> dict[str, np.ndarray]:
        with torch.inference_mode():
            return {out_name: net(*map(torch.from_numpy, inputs.values())).numpy()}
    return infer


def tensors(specs) -> list[Tensor]:  # type: ignore[no-untyped-def]
    return [Tensor(name=t.name, dtype=np.dtype(t.datatype.name.lower().replace("fp", "float")),
                   shape=tuple(t.shape[1:])) for t in specs]


config = TritonConfig(http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                      http_address="127.0.0.1", grpc_address="127.0.0.1")
# PyTriton guards the shared-memory API with a token that tritonclient does not send;
# tritonserver itself leaves it open, as dstack's `server.allow_client_shm: true` does.
security = TritonSecurityConfig(
    restricted_endpoints=[e for e in DEFAULT_PROTECTED_ENDPOINTS if e != "shared-memory"])
with Triton(config=config, security_config=security) as triton:
    for m in entries:
        zoo = m.get("zoo_name", m["name"])
        spec = models.spec(zoo)
        delay_us = int(1000 * m.get("max_queue_delay_ms", 0))
        triton.bind(model_name=m["name"],
                    infer_func=infer_fn(models.load_model(zoo), spec.outputs[0].name),
                    inputs=tensors(spec.inputs), outputs=tensors(spec.outputs),
                    config=ModelConfig(max_batch_size=m.get("max_batch_size", 8),
                                       batcher=DynamicBatcher(
                                           max_queue_delay_microseconds=delay_us)))
    triton.serve()
