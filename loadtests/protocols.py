"""How a Locust user sends its model's requests (`--protocol`), on the wire only:

- `http`: KServe v2 binary tensors over HTTP (`server.codec`'s client functions);
- `grpc`: the KServe v2 / Triton gRPC endpoint, with the unmodified `tritonclient.grpc`
  client (`--grpc-url`, default the HTTP host's name on port 8001);
- `shm`: HTTP, the tensors in the user's own system shared-memory regions
  (`tritonclient.utils.shared_memory`, registered with the server as Triton's extension
  has it): the request is a small JSON header, the input is written once per user and
  each answer is written by the server into the output region. Needs a server on this
  host with `server.allow_client_shm`.

`GrpcSender.send()` returns an `Outcome`: the status (200 for an answer; gRPC's
UNAVAILABLE, a refusal, counted as 503), an error text, and the bytes received.
`ShmSender` makes the HTTP request's body and checks its answer; Locust's HTTP client
sends it as it sends `http`'s.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from itertools import count
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from server import codec

PROTOCOLS = ("http", "grpc", "shm")
_REGIONS = count()


@dataclass(frozen=True, slots=True)
class Outcome:
    status: int  # HTTP's, or its equivalent for a gRPC status
    error: str = ""
    length: int = 0


def grpc_url(host: str, given: str | None) -> str:
    """`given`, else the HTTP host's name on Triton's gRPC port 8001."""
    if given:
        return given
    return f"{urlsplit(host).hostname or '127.0.0.1'}:8001"


class GrpcSender:
    """One model's requests over gRPC (`tritonclient.grpc`, one channel per user)."""

    def __init__(self, url: str, model: str, inputs: dict[str, np.ndarray]) -> None:
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(url)
        self.model = model
        self.inputs = []
        for name, arr in inputs.items():
            inp = grpcclient.InferInput(name, list(arr.shape), codec.datatype_of(arr).value)
            inp.set_data_from_numpy(arr)
            self.inputs.append(inp)

    def send(self) -> Outcome:
        from tritonclient.utils import InferenceServerException

        try:
            result = self.client.infer(self.model, self.inputs, client_timeout=60)
        except InferenceServerException as e:
            status = str(e.status())
            code = 503 if status.endswith("UNAVAILABLE") else 500
            return Outcome(code, f"{status}: {e.message()}")
        response = result.get_response()
        return Outcome(200, length=sum(len(c) for c in response.raw_output_contents))

    def close(self) -> None:
        self.client.close()


class ShmSender:
    """One model's requests over HTTP with its tensors in this user's own system
    shared-memory regions (one for the inputs, one for the outputs whose size is known;
    an output with a dynamic dimension comes back in the body, binary)."""

    def __init__(self, post: Any, model: str, inputs: dict[str, np.ndarray],
                 outputs: list[dict[str, Any]]) -> None:
        import tritonclient.utils.shared_memory as shm

        self.shm = shm
        self.post = post  # (path, body, headers) -> HTTP status
        self.model = model
        tag = f"{os.getpid()}_{next(_REGIONS)}"
        self.names = (f"locust_in_{tag}", f"locust_out_{tag}")
        in_bytes = sum(a.nbytes for a in inputs.values())
        sized = [(o, _one_item_bytes(o)) for o in outputs]
        out_bytes = sum(n for _, n in sized if n is not None) or 1
        self.regions = [
            shm.create_shared_memory_region(self.names[0], f"/{self.names[0]}", in_bytes),
            shm.create_shared_memory_region(self.names[1], f"/{self.names[1]}", out_bytes)]
        shm.set_shared_memory_region(self.regions[0], list(inputs.values()))
        for name, size in zip(self.names, (in_bytes, out_bytes), strict=True):
            status = post(f"/v2/systemsharedmemory/region/{name}/register",
                          json.dumps({"key": f"/{name}", "offset": 0,
                                      "byte_size": size}).encode(), {})
            if status != 200:
                self.close()
                raise RuntimeError(f"registering shared memory region {name} failed: "
                                   f"HTTP {status} (does the server run on this host with "
                                   "server.allow_client_shm?)")
        head: dict[str, Any] = {"inputs": [], "outputs": []}
        at = 0
        for name, arr in inputs.items():
            head["inputs"].append({
                "name": name, "datatype": codec.datatype_of(arr).value,
                "shape": list(arr.shape), "parameters": {
                    "shared_memory_region": self.names[0], "shared_memory_offset": at,
                    "shared_memory_byte_size": arr.nbytes}})
            at += arr.nbytes
        at = 0
        for o, size in sized:
            if size is None:
                head["outputs"].append({"name": o["name"], "parameters": {"binary_data": True}})
                continue
            head["outputs"].append({"name": o["name"], "parameters": {
                "shared_memory_region": self.names[1], "shared_memory_offset": at,
                "shared_memory_byte_size": size}})
            at += size
        self.body = json.dumps(head).encode()
        self.headers = {"Content-Type": "application/json"}

    def check(self, content: bytes, header_length: str | None) -> str | None:
        """What is wrong with an answer's body (None: nothing): every output either
        written into the region or sent."""
        try:
            head = json.loads(content[:int(header_length)] if header_length else content)
            outputs = head["outputs"]
        except (ValueError, KeyError, TypeError) as e:
            return f"bad response: {e}"
        for o in outputs:
            params = o.get("parameters") or {}
            if not ("shared_memory_region" in params or "binary_data_size" in params
                    or "data" in o):
                return f"bad response: output {o.get('name')!r} neither in shared memory nor sent"
        return None

    def close(self) -> None:
        for name in self.names:
            try:
                self.post(f"/v2/systemsharedmemory/region/{name}/unregister", b"", {})
            except Exception:  # noqa: BLE001 - the server may be gone; the regions go anyway
                pass
        for region in self.regions:
            self.shm.destroy_shared_memory_region(region)
        self.regions = []


def _one_item_bytes(output: dict[str, Any]) -> int | None:
    """Bytes of one item of `output` (its metadata), None for a dynamic dimension."""
    dims = output["shape"][1:]
    if any(d < 0 for d in dims):
        return None
    dtype = codec.NP_DTYPES[codec.DType(output["datatype"])]
    return int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
