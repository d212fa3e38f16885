"""resnet18 behind Triton, for `bench/bench_triton.py`: PyTriton (Triton's C++ HTTP front
end and dynamic batcher; the model in this Python process) with the settings of
`configs/bench-single-resnet18-shared.yaml`: batches up to 8, 5 ms queue delay, the two
cores and threads and the allocator settings of a dstack worker.

    PYTHON_OF_A_PYTRITON_VENV bench/pytriton_resnet18.py PORT
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dstack.common.heap import keep_heap  # noqa: E402

keep_heap()
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torchvision  # noqa: E402
from pytriton.decorators import batch  # noqa: E402
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor  # noqa: E402
from pytriton.triton import Triton, TritonConfig  # noqa: E402

port = int(sys.argv[1])
cores = sorted(os.sched_getaffinity(0))
torch.set_num_threads(len(cores))
model = torchvision.models.resnet18(weights=None).eval()


@batch
def infer_fn(input: np.ndarray) -> dict[str, np.ndarray]:  # noqa: A002 - the tensor's name
    with torch.inference_mode():
        return {"output": model(torch.from_numpy(input)).numpy()}


config = TritonConfig(http_port=port, grpc_port=port + 1, metrics_port=port + 2,
                      http_address="127.0.0.1")
with Triton(config=config) as triton:
    triton.bind(model_name="resnet18", infer_func=infer_fn,
                inputs=[Tensor(name="input", dtype=np.float32, shape=(3, 224, 224))],
                outputs=[Tensor(name="output", dtype=np.float32, shape=(1000,))],
                config=ModelConfig(max_batch_size=8,
                                   batcher=DynamicBatcher(max_queue_delay_microseconds=5000)))
    triton.serve()
