"""Opening another process's device memory from its `cudaIpcMemHandle_t` (Triton's CUDA
shared-memory extension), through the CUDA runtime library torch loads (ctypes on
libcudart: cudaIpcOpenMemHandle, cudaMemcpy, cudaMemcpyAsync, cudaIpcCloseMemHandle).

The server's process opens a client's handle when it is registered (to check it, and to
write outputs into it); a CUDA worker opens it again when a batch first reads an input from
it, and copies those rows on the device (`dstack.runtime.upload.DeviceReader`).

`opener()` says whether this host can: without torch's CUDA or a device, it returns None
and the reason, and the registry refuses every CUDA call with it.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from dstack.common.errors import RequestError

_HOST_TO_DEVICE = 1  # cudaMemcpyKind
_DEVICE_TO_HOST = 2
_DEFAULT = 4  # by the pointers (unified addressing): device to device, either device
_LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class CudaRuntime:
    """The few libcudart calls the extension needs; an error is a RequestError naming
    the call and CUDA's own message."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        self.lock = threading.Lock()  # cudaSetDevice is per thread: set it with each call

    def check(self, rc: int, call: str) -> None:
        if rc != 0:
            why = self.lib.cudaGetErrorString(rc).decode(errors="replace")
            raise RequestError(f"CUDA shared memory: {call} failed: {why} (error {rc})")

    def __call__(self, handle: bytes, device_id: int, byte_size: int) -> IpcMapping:
        """Open `handle` on `device_id` (`server.shm.CudaOpener`)."""
        with self.lock:
            self.check(self.lib.cudaSetDevice(device_id), f"cudaSetDevice({device_id})")
            ptr = self.open(handle)
        return IpcMapping(self, ptr, device_id, byte_size)

    def open(self, handle: bytes) -> int:
        """`handle` opened in this thread's current device context: its pointer here.
        (A worker's context is on its own device, whatever the client called it: CUDA
        enables peer access where the memory is on another.)"""
        ptr = ctypes.c_void_p()
        raw = _Handle()
        ctypes.memmove(ctypes.addressof(raw), handle, ctypes.sizeof(raw))  # NULs and all
        self.check(self.lib.cudaIpcOpenMemHandle(
            ctypes.byref(ptr), raw, ctypes.c_uint(_LAZY_PEER_ACCESS)), "cudaIpcOpenMemHandle")
        return ptr.value or 0

    def close(self, ptr: int) -> None:
        self.lib.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr))

    def copy_async(self, dst: int, src: int, n: int, stream: int) -> None:
        """Copy `n` bytes between device pointers, queued on `stream` (a cudaStream_t)."""
        self.check(self.lib.cudaMemcpyAsync(ctypes.c_void_p(dst), ctypes.c_void_p(src),
                                            ctypes.c_size_t(n), _DEFAULT,
                                            ctypes.c_void_p(stream)), "cudaMemcpyAsync")


class IpcMapping:
    """An opened handle (`server.shm.CudaMapping`): copies between it and the host."""

    def __init__(self, rt: CudaRuntime, ptr: int, device_id: int, byte_size: int) -> None:
        self.rt, self.ptr, self.device_id, self.byte_size = rt, ptr, device_id, byte_size

    def _copy(self, dst: int, src: int, n: int, kind: int) -> None:
        with self.rt.lock:
            self.rt.check(self.rt.lib.cudaSetDevice(self.device_id), "cudaSetDevice")
            self.rt.check(self.rt.lib.cudaMemcpy(ctypes.c_void_p(dst), ctypes.c_void_p(src),
                                                 ctypes.c_size_t(n), kind), "cudaMemcpy")

    def read(self, offset: int, byte_size: int) -> np.ndarray:
        out = np.empty(byte_size, np.uint8)
        self._copy(out.ctypes.data, self.ptr + offset, byte_size, _DEVICE_TO_HOST)
        return out

    def write(self, offset: int, data: np.ndarray) -> None:
        self._copy(self.ptr + offset, data.ctypes.data, data.nbytes, _HOST_TO_DEVICE)

    def close(self) -> None:
        if self.ptr:
            with self.rt.lock:
                self.rt.close(self.ptr)
            self.ptr = 0


class LazyCudaRuntime:
    """The opener `opener()` gives: libcudart is loaded, and this process's CUDA context
    made, at the first registration, not when the server starts (a server that never
    sees a CUDA region holds no context of its own beside its workers')."""

    def __init__(self, cuda_major: str) -> None:
        self.major = cuda_major
        self.rt: CudaRuntime | None = None

    def __call__(self, handle: bytes, device_id: int, byte_size: int) -> IpcMapping:
        if self.rt is None:
            self.rt = load(self.major)
        return self.rt(handle, device_id, byte_size)


def load(major: str) -> CudaRuntime:
    """libcudart, as torch loaded it (its CUDA `major` version)."""
    import torch

    torch.cuda.init()  # loads libcudart: found again by its soname below
    for name in (f"libcudart.so.{major}", "libcudart.so"):
        try:
            return CudaRuntime(ctypes.CDLL(name))
        except OSError:
            continue
    raise RequestError(f"CUDA shared memory: libcudart.so.{major} (the CUDA runtime torch "
                       "uses) cannot be loaded")


def opener() -> tuple[LazyCudaRuntime | None, str]:
    """(the CUDA IPC opener, "") where torch sees a CUDA device, else (None, why)."""
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    if not torch.cuda.is_available():
        return None, "this server has no CUDA device (torch.cuda.is_available() is False)"
    return LazyCudaRuntime((torch.version.cuda or "12").split(".")[0]), ""
