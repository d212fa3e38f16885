"""CUDA shared memory on a real GPU (skipped without CUDA): a client's device tensors,
shared by their `cudaIpcMemHandle_t` (torch's own, as tritonclient's cuda_shared_memory
makes them), registered with a real `dstack serve --allow-client-shm` (`device: cuda`, its
worker an MPS client) over `tritonclient.http`; the worker reads the inputs from the
client's device memory itself (a batch's rows from several requests at their own offsets)
and the output is written into it."""

from __future__ import annotations

import base64
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.http as httpclient

from dstack.common import mps
from tests.e2e.server_process import TINY, ServerProcess

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(shutil.which(mps.CONTROL) is None, reason="no nvidia-cuda-mps-control"),
]


def server_config(tmp_path: Path) -> dict:
    """This module's server (tests/e2e/conftest.py `module_server`)."""
    return {"device": "cuda", "policy": "shared", "models": [TINY],
            "server": {"grpc_port": 0, "allow_client_shm": True, "frontends": 1}}


def _ipc(t: torch.Tensor) -> tuple[str, int, int]:
    """`t`'s allocation as the extension takes it: the handle (base64), the allocation's
    size to register, and `t`'s offset in it."""
    share = t.untyped_storage()._share_cuda_()
    handle, size, offset = share[1], int(share[2]), int(share[3])
    return base64.b64encode(handle).decode(), offset + size, offset


def test_cuda_regions_in_and_out(module_server: ServerProcess) -> None:
    client = httpclient.InferenceServerClient(module_server.url)
    assert "cuda_shared_memory" in client.get_server_metadata()["extensions"]
    x = torch.randn(2, 3, 32, 32, device="cuda")
    y = torch.zeros(2, 10, device="cuda")
    torch.cuda.synchronize()
    (hx, size_x, off_x), (hy, size_y, off_y) = _ipc(x), _ipc(y)
    client.register_cuda_shared_memory("x", hx, x.device.index, size_x)
    client.register_cuda_shared_memory("y", hy, y.device.index, size_y)
    assert {r["name"] for r in client.get_cuda_shared_memory_status()} == {"x", "y"}
    inp = httpclient.InferInput("input", [2, 3, 32, 32], "FP32")
    inp.set_shared_memory("x", x.numel() * 4, off_x)
    out = httpclient.InferRequestedOutput("output")
    out.set_shared_memory("y", y.numel() * 4, off_y)
    client.infer("tiny_cnn", [inp], outputs=[out])
    torch.cuda.synchronize()

    plain = httpclient.InferInput("input", [2, 3, 32, 32], "FP32")
    plain.set_data_from_numpy(x.cpu().numpy(), binary_data=True)
    want = client.infer("tiny_cnn", [plain]).as_numpy("output")
    np.testing.assert_allclose(y.cpu().numpy(), want, atol=1e-5)
    client.unregister_cuda_shared_memory()
    assert client.get_cuda_shared_memory_status() == []


def test_concurrent_requests_from_one_allocation_each_get_their_own_rows(
        module_server: ServerProcess) -> None:
    """Requests sent together are batched: each batch's rows come from one allocation at
    each request's own offset, copied on the device by the worker."""
    client = httpclient.InferenceServerClient(module_server.url, concurrency=8)
    xs = torch.randn(8, 2, 3, 32, 32, device="cuda")  # request i: xs[i], 2 rows
    torch.cuda.synchronize()
    handle, size, base = _ipc(xs)
    client.register_cuda_shared_memory("xs", handle, xs.device.index, size)
    per = xs[0].numel() * 4
    try:
        pending = []
        for i in range(8):
            inp = httpclient.InferInput("input", [2, 3, 32, 32], "FP32")
            inp.set_shared_memory("xs", per, base + i * per)
            pending.append(client.async_infer("tiny_cnn", [inp]))
        got = [p.get_result().as_numpy("output") for p in pending]
        for i, g in enumerate(got):
            plain = httpclient.InferInput("input", [2, 3, 32, 32], "FP32")
            plain.set_data_from_numpy(xs[i].cpu().numpy(), binary_data=True)
            want = client.infer("tiny_cnn", [plain]).as_numpy("output")
            # a wrong row differs by O(1); batch sizes may pick other (TF32) kernels
            np.testing.assert_allclose(g, want, rtol=1e-3, atol=1e-3, err_msg=f"request {i}")
    finally:
        client.unregister_cuda_shared_memory("xs")
    assert "cannot open clients' device memory" not in module_server.text()
