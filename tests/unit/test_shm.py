"""The shared-memory registry (`server.shm`): regions registered, tensors read from and
written into them with every bound checked, the gate (off, remote clients), and the CUDA
paths with a fake handle opener (no GPU needed)."""

from __future__ import annotations

import ctypes
import json
import os
from collections.abc import Iterator
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from dstack.common.errors import DStackError, RequestError
from dstack.common.types import DType, ModelSpec, TensorSpec
from dstack.runtime.cuda_ipc import CudaRuntime
from dstack.runtime.staging import DeviceInput
from server import codec, grpc_codec
from server.shm import (
    CUDA_IPC_HANDLE_BYTES,
    Forbidden,
    RegistryAccess,
    SharedMemory,
    ShmRegistry,
    is_local_peer,
)
from server.shm_http import raw_handle

SPEC = ModelSpec("m", (TensorSpec("x", DType.FP32, (-1, 4)),),
                 (TensorSpec("y", DType.FP32, (-1, 4)),), max_batch_size=8)


@pytest.fixture
def shm() -> Iterator[shared_memory.SharedMemory]:
    """A client's POSIX shared-memory object of 64 KiB (as tritonclient makes one)."""
    obj = shared_memory.SharedMemory(f"dstack_test_{os.getpid()}", create=True, size=65536)
    yield obj
    obj.close()
    obj.unlink()


@pytest.fixture
def registry() -> Iterator[ShmRegistry]:
    reg = ShmRegistry()
    yield reg
    reg.close()


def _fill(obj: shared_memory.SharedMemory, at: int, x: np.ndarray) -> None:
    obj.buf[at:at + x.nbytes] = x.tobytes()


def test_register_status_unregister(shm, registry: ShmRegistry) -> None:  # noqa: ANN001
    registry.register_system("in", "/" + shm.name, 4096, 1024)
    registry.register_system("out", shm.name, 0, 16)  # shm_open's name without its "/"
    assert registry.system_status("in") == [
        {"name": "in", "key": "/" + shm.name, "offset": 4096, "byte_size": 1024}]
    assert [r["name"] for r in registry.system_status()] == ["in", "out"]
    with pytest.raises(RequestError, match="'in' is already registered"):
        registry.register_system("in", shm.name, 0, 16)
    registry.unregister_system("in")
    registry.unregister_system("never")  # Triton's: no error
    with pytest.raises(RequestError, match="no system shared memory region 'in'"):
        registry.system_status("in")
    registry.unregister_system()
    assert registry.system_status() == []


@pytest.mark.parametrize(("key", "offset", "size", "words"), [
    ("/../../etc/passwd", 0, 16, "not a shared-memory object's name"),
    ("a/b", 0, 16, "not a shared-memory object's name"),
    ("/", 0, 16, "not a shared-memory object's name"),
    ("", 0, 16, "key must be a non-empty string"),
    ("/dstack_no_such_object", 0, 16, "cannot open key '/dstack_no_such_object'"),
    (None, 0, 16, "key must be a non-empty string"),
    ("SHM", -1, 16, "offset must be a non-negative integer, got -1"),
    ("SHM", True, 16, "offset must be a non-negative integer, got True"),
    ("SHM", 0, "16", "byte_size must be a non-negative integer, got '16'"),
    ("SHM", 0, 0, "byte_size must be > 0"),
    ("SHM", 65000, 1000, "offset 65000 \\+ byte_size 1000 = 66000 runs past the end of key"),
    ("SHM", 2**63, 2**63, "runs past the end of key"),
])
def test_bad_registrations_name_what_is_wrong(shm, registry: ShmRegistry,  # noqa: ANN001
                                              key, offset, size, words) -> None:  # noqa: ANN001
    key = shm.name if key == "SHM" else key
    with pytest.raises(RequestError, match=words):
        registry.register_system("r", key, offset, size)
    assert registry.system_status() == []


def test_input_is_a_view_of_the_region_and_outputs_are_written(shm, registry) -> None:  # noqa: ANN001
    registry.register_system("r", shm.name, 8192, 4096)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    _fill(shm, 8192 + 64, x)
    access = RegistryAccess(registry)
    params = {"shared_memory_region": "r", "shared_memory_offset": 64,
              "shared_memory_byte_size": 32}
    got = access.input(params, DType.FP32, (2, 4), "input 'x'")
    np.testing.assert_array_equal(got, x)
    assert not got.flags.writeable
    _fill(shm, 8192 + 64, x + 1)  # no copy: the client's later write shows through
    np.testing.assert_array_equal(got, x + 1)

    target = access.output({"shared_memory_region": "r", "shared_memory_offset": 128,
                            "shared_memory_byte_size": 64}, "output 'y'")
    answer = target.write("y", x * 3)
    assert answer == {"shared_memory_region": "r", "shared_memory_byte_size": 32,
                      "shared_memory_offset": 128}
    back = np.frombuffer(shm.buf, np.float32, 8, 8192 + 128).reshape(2, 4).copy()
    np.testing.assert_array_equal(back, x * 3)
    with pytest.raises(RequestError, match="output 'y' has 256 bytes but "
                       "shared_memory_byte_size is 64 \\(region 'r'\\)"):
        target.write("y", np.zeros((8, 8), np.float32))


@pytest.mark.parametrize(("params", "words"), [
    ({"shared_memory_region": "r", "shared_memory_offset": 4090,
      "shared_memory_byte_size": 32},
     "input 'x': shared memory region 'r' holds 4096 bytes; shared_memory_offset 4090 \\+ "
     "shared_memory_byte_size 32 = 4122 runs past its end"),
    ({"shared_memory_region": "r", "shared_memory_offset": 2**62,
      "shared_memory_byte_size": 32}, "runs past its end"),
    ({"shared_memory_region": "r", "shared_memory_byte_size": 16},
     "shared_memory_byte_size 16 does not match shape \\[2,4\\] of FP32 \\(32 bytes\\)"),
    ({"shared_memory_region": "nope", "shared_memory_byte_size": 32},
     "input 'x': no shared memory region 'nope' is registered"),
    ({"shared_memory_region": "r"}, "shared_memory_region 'r' needs shared_memory_byte_size"),
    ({"shared_memory_region": "r", "shared_memory_offset": -8,
      "shared_memory_byte_size": 32}, "shared_memory_offset must be a non-negative integer"),
    ({"shared_memory_region": "r", "shared_memory_offset": 1.5,
      "shared_memory_byte_size": 32}, "shared_memory_offset must be a non-negative integer"),
    ({"shared_memory_region": 7, "shared_memory_byte_size": 32},
     "shared_memory_region must be a non-empty string"),
    ({"shared_memory_region": "x" * 300, "shared_memory_byte_size": 32}, "at most 255"),
])
def test_bounds_are_checked(shm, registry, params, words) -> None:  # noqa: ANN001
    registry.register_system("r", shm.name, 0, 4096)
    with pytest.raises(RequestError, match=words):
        RegistryAccess(registry).input(params, DType.FP32, (2, 4), "input 'x'")


def test_region_unregistered_while_in_use(shm, registry) -> None:  # noqa: ANN001
    registry.register_system("r", shm.name, 0, 4096)
    x = np.full((2, 4), 7, np.float32)
    _fill(shm, 0, x)
    access = RegistryAccess(registry)
    params = {"shared_memory_region": "r", "shared_memory_byte_size": 32}
    held = access.input(params, DType.FP32, (2, 4), "input 'x'")
    target = access.output(params, "output 'y'")
    registry.unregister_system("r")
    # the request that holds the region reads it still; its answer is refused, not written
    np.testing.assert_array_equal(held, x)
    with pytest.raises(RequestError, match="region 'r' was unregistered while the request"):
        target.write("y", x)
    with pytest.raises(RequestError, match="no shared memory region 'r'"):
        access.input(params, DType.FP32, (2, 4), "input 'x'")
    del held  # the last user: the mapping goes with it


def test_shrunk_object_is_refused_not_read(registry) -> None:  # noqa: ANN001
    obj = shared_memory.SharedMemory(f"dstack_test_shrink_{os.getpid()}", create=True,
                                     size=8192)
    try:
        registry.register_system("r", obj.name, 0, 8192)
        os.truncate(f"/dev/shm/{obj.name}", 1024)  # touching past it would be SIGBUS
        with pytest.raises(RequestError, match="was shrunk to 1024 bytes"):
            RegistryAccess(registry).input(
                {"shared_memory_region": "r", "shared_memory_offset": 4096,
                 "shared_memory_byte_size": 32}, DType.FP32, (2, 4), "input 'x'")
    finally:
        registry.unregister_system()
        obj.close()
        obj.unlink()


@pytest.mark.parametrize(("peer", "local"), [
    ("ipv4:127.0.0.1:5000", True), ("ipv6:[::1]:5000", True), ("unix:/tmp/s", True),
    ("127.0.0.1", True), ("::1", True), ("ipv6:[::ffff:127.0.0.1]:1", True),
    ("ipv4:10.0.0.2:5000", False), ("192.168.1.4", False), ("ipv6:[2001:db8::1]:1", False),
    (None, False), ("", False), ("testclient", False),
])
def test_only_clients_on_this_host(peer, local) -> None:  # noqa: ANN001
    assert is_local_peer(peer) is local


def test_the_gate_off_remote_and_on(registry) -> None:  # noqa: ANN001
    off = SharedMemory(False)
    assert off.extensions == []
    with pytest.raises(RequestError, match="not enabled on this server"):
        off.check("127.0.0.1")
    on = SharedMemory(True, registry)
    assert on.extensions == ["system_shared_memory"]  # no CUDA opener: not listed
    with pytest.raises(Forbidden, match="only for clients on this host.*10.1.2.3") as e:
        on.check("ipv4:10.1.2.3:99")
    assert e.value.status_code == 403
    assert on.check("ipv4:127.0.0.1:99") is registry
    with pytest.raises(DStackError, match="input 'x': shared memory is only for clients"):
        on.access("10.1.2.3").input({}, DType.FP32, (1, 4), "input 'x'")


def test_http_and_grpc_requests_take_their_tensors_from_regions(shm, registry) -> None:  # noqa: ANN001
    registry.register_system("r", shm.name, 0, 4096)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    _fill(shm, 256, x)
    access = RegistryAccess(registry)
    body = codec.encode_request({"x": x}, binary=False)[0]
    head = json.loads(body)
    del head["inputs"][0]["data"]
    head["inputs"][0]["parameters"] = {"shared_memory_region": "r",
                                       "shared_memory_offset": 256,
                                       "shared_memory_byte_size": 32}
    head["outputs"] = [{"name": "y", "parameters": {"shared_memory_region": "r",
                                                    "shared_memory_offset": 512,
                                                    "shared_memory_byte_size": 32}}]
    rh = codec.parse_request(json.dumps(head).encode(), None, SPEC, access)
    np.testing.assert_array_equal(rh.binary_inputs["x"], x)
    req = codec.InferRequest(None, rh.binary_inputs, rh.outputs, False, 2)
    body, hlen = codec.encode_response("m", req, {"y": x * 2}, SPEC)
    assert hlen is None
    out = json.loads(body)["outputs"][0]
    assert out["parameters"] == {"shared_memory_region": "r", "shared_memory_byte_size": 32,
                                 "shared_memory_offset": 512} and "data" not in out
    np.testing.assert_array_equal(np.frombuffer(shm.buf, np.float32, 8, 512), (x * 2).ravel())

    msg = pb.ModelInferRequest(model_name="m")
    t = msg.inputs.add(name="x", datatype="FP32", shape=[2, 4])
    t.parameters["shared_memory_region"].string_param = "r"
    t.parameters["shared_memory_offset"].int64_param = 256
    t.parameters["shared_memory_byte_size"].int64_param = 32
    o = msg.outputs.add(name="y")
    o.parameters["shared_memory_region"].string_param = "r"
    o.parameters["shared_memory_byte_size"].int64_param = 32
    gh = grpc_codec.parse_request(msg, SPEC, access)
    np.testing.assert_array_equal(gh.binary_inputs["x"], x)
    resp = grpc_codec.encode_response(
        "m", codec.InferRequest(None, gh.binary_inputs, gh.outputs, True, 2), {"y": x + 5},
        SPEC, "1")
    assert list(resp.raw_output_contents) == [b""]  # its place kept, as Triton keeps it
    assert resp.outputs[0].parameters["shared_memory_region"].string_param == "r"
    np.testing.assert_array_equal(np.frombuffer(shm.buf, np.float32, 8, 0), (x + 5).ravel())
    with pytest.raises(RequestError, match="shared-memory tensors are not enabled"):
        grpc_codec.parse_request(msg, SPEC)


# --------------------------------------------------------------------------- CUDA


class FakeMapping:
    """Device memory stood in for by host bytes."""

    def __init__(self, size: int) -> None:
        self.mem = np.zeros(size, np.uint8)
        self.closed = False

    def read(self, offset: int, byte_size: int) -> np.ndarray:
        return self.mem[offset:offset + byte_size].copy()

    def write(self, offset: int, data: np.ndarray) -> None:
        self.mem[offset:offset + data.nbytes] = data.reshape(-1).view(np.uint8)

    def close(self) -> None:
        self.closed = True


def test_cuda_without_a_device_says_so() -> None:
    reg = ShmRegistry(None, "this server has no CUDA device")
    handle = bytes(CUDA_IPC_HANDLE_BYTES)
    for call in (lambda: reg.register_cuda("c", handle, 0, 64), reg.cuda_status,
                 reg.unregister_cuda):
        with pytest.raises(RequestError, match="CUDA shared memory is not available: this "
                           "server has no CUDA device"):
            call()


def test_cuda_regions_with_a_fake_handle() -> None:
    opened: list[tuple[bytes, int, int]] = []
    mappings: list[FakeMapping] = []

    def opener(handle: bytes, device_id: int, byte_size: int) -> FakeMapping:
        opened.append((handle, device_id, byte_size))
        mappings.append(FakeMapping(byte_size))
        return mappings[-1]

    reg = ShmRegistry(opener)
    handle = bytes(range(CUDA_IPC_HANDLE_BYTES))
    with pytest.raises(RequestError, match="cudaIpcMemHandle_t of 64 bytes, got 3"):
        reg.register_cuda("c", b"abc", 0, 64)
    reg.register_cuda("c", handle, 1, 256)
    assert opened == [(handle, 1, 256)]
    assert reg.cuda_status() == [{"name": "c", "device_id": 1, "byte_size": 256}]
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    mappings[0].write(32, x)
    access = RegistryAccess(reg)
    params = {"shared_memory_region": "c", "shared_memory_offset": 32,
              "shared_memory_byte_size": 32}
    np.testing.assert_array_equal(access.input(params, DType.FP32, (2, 4), "input 'x'"), x)
    with pytest.raises(RequestError, match="CUDA shared memory region 'c' holds 256 bytes"):
        access.input({**params, "shared_memory_offset": 240}, DType.FP32, (2, 4), "input 'x'")
    target = access.output(params, "output 'y'")
    reg.unregister_cuda("c")
    assert mappings[0].closed
    with pytest.raises(RequestError, match="'c' was unregistered while the request"):
        target.write("y", x)


def test_a_cuda_input_is_read_where_it_is_used_and_holds_its_region() -> None:
    """An input from a CUDA region is read when a worker takes it, not when the request is
    parsed; unregistered meanwhile, the region stays open until the input is gone, then
    the workers are told to close the handle too (once)."""
    mapping = FakeMapping(256)
    reg = ShmRegistry(lambda handle, device_id, byte_size: mapping)
    forgotten: list[bytes] = []
    reg.forget_device_memory = forgotten.append
    handle = bytes([9]) * CUDA_IPC_HANDLE_BYTES
    reg.register_cuda("c", handle, 0, 256)
    params = {"shared_memory_region": "c", "shared_memory_offset": 64,
              "shared_memory_byte_size": 32}
    x = RegistryAccess(reg).input(params, DType.FP32, (2, 4), "input 'x'")
    assert isinstance(x, DeviceInput)
    assert (x.handle, x.offset, x.nbytes, x.shape) == (handle, 64, 32, (2, 4))
    want = np.arange(8, dtype=np.float32).reshape(2, 4)
    mapping.write(64, want)  # written after the request was parsed: still read
    target = RegistryAccess(reg).output(params, "output 'y'")
    reg.unregister_cuda("c")
    assert not mapping.closed and not forgotten
    np.testing.assert_array_equal(np.asarray(x), want)
    with pytest.raises(RequestError, match="'c' was unregistered while the request"):
        target.write("y", want)  # no answer goes into an unregistered region
    del x
    assert mapping.closed and forgotten == [handle]
    reg.close()
    assert forgotten == [handle]


def test_cuda_raw_handle_of_an_http_body() -> None:
    import base64

    handle = bytes(range(64))
    assert raw_handle({"raw_handle": {"b64": base64.b64encode(handle).decode()}}) == handle
    with pytest.raises(RequestError, match='raw_handle must be \\{"b64"'):
        raw_handle({"raw_handle": "abc"})
    with pytest.raises(RequestError, match="raw_handle.b64 is not base64"):
        raw_handle({"raw_handle": {"b64": "!!!"}})


class FakeCudart:
    """libcudart's few calls, in Python: device memory is a host buffer."""

    def __init__(self, open_rc: int = 0, size: int = 256) -> None:
        self.mem = (ctypes.c_uint8 * size)()
        self.open_rc = open_rc
        self.handles: list[bytes] = []
        self.closed: list[int] = []
        self.streams: list[int] = []

        def error_string(rc: int) -> bytes:
            return b"invalid resource handle"

        self.cudaGetErrorString = error_string

    def cudaSetDevice(self, device: int) -> int:  # noqa: N802 - libcudart's names
        return 0

    def cudaIpcOpenMemHandle(self, ptr: Any, handle: Any, flags: Any) -> int:  # noqa: N802
        self.handles.append(bytes(handle))
        ctypes.cast(ptr, ctypes.POINTER(ctypes.c_void_p))[0] = ctypes.addressof(self.mem)
        return self.open_rc

    def cudaMemcpy(self, dst: Any, src: Any, n: Any, kind: int) -> int:  # noqa: N802
        ctypes.memmove(dst.value, src.value, n.value)
        return 0

    def cudaMemcpyAsync(self, dst: Any, src: Any, n: Any, kind: int,  # noqa: N802
                        stream: Any) -> int:
        self.streams.append(stream.value)
        return self.cudaMemcpy(dst, src, n, kind)

    def cudaIpcCloseMemHandle(self, ptr: Any) -> int:  # noqa: N802
        self.closed.append(ptr.value)
        return 0


def test_cuda_runtime_calls_with_a_fake_libcudart() -> None:
    lib = FakeCudart()
    handle = bytes([0, 7] * 32)  # NULs inside: passed whole
    mapping = CudaRuntime(lib)(handle, 0, 256)  # type: ignore[arg-type]
    assert lib.handles == [handle]
    mapping.write(16, np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(mapping.read(16, 16).view(np.float32), np.arange(4))
    mapping.close()
    mapping.close()  # once only
    assert lib.closed == [ctypes.addressof(lib.mem)]
    with pytest.raises(RequestError, match="cudaIpcOpenMemHandle failed: invalid resource "
                       "handle \\(error 400\\)"):
        CudaRuntime(FakeCudart(open_rc=400))(handle, 0, 256)  # type: ignore[arg-type]
