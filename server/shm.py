"""Triton's shared-memory extensions: the regions local clients register, and the tensors
requests read from and write into them (`shared_memory_region`, `shared_memory_offset`,
`shared_memory_byte_size`), for HTTP and gRPC alike.

System shared memory: a region is `byte_size` bytes at `offset` of a POSIX shared-memory
object (`key`, as `shm_open` names it: what `tritonclient.utils.shared_memory` creates),
mapped once at registration. An input read from it is a read-only numpy view of the
mapping: the server makes no copy of its own, the runtime's one copy into the worker's
arena is the only one. An output is written into it once, from the worker's answer.

CUDA shared memory: a region is a `cudaIpcMemHandle_t` of another process's device memory,
opened once at registration (`dstack.runtime.cuda_ipc`). An input read from it is a
`DeviceInput`: a CUDA worker opens the handle itself and copies the rows on the device;
anything else reads it through the host. An output is written into it from the host.
Without a CUDA device every CUDA call is refused with a message that says so.

Every offset and size is checked against the region before anything is read or written
(`RequestError`, 400 / INVALID_ARGUMENT, naming the region, the offset and the sizes).
A region unregistered while a request still uses it stays mapped until that request is
done: its arrays (system) or inputs (CUDA) hold the mapping, which is closed when the last
of them goes; then the workers that opened a CUDA region close it too.

Whether a request may use shared memory at all (`server.allow_client_shm`, a client on
this host) is decided by `SharedMemory.access`, the one gate for both protocols.
"""

from __future__ import annotations

import functools
import ipaddress
import math
import mmap
import os
import stat
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from dstack.common.errors import DStackError, RequestError
from dstack.common.types import DType
from dstack.runtime.staging import DeviceInput
from server.codec import NP_DTYPES

#: Regions registered at once, system and CUDA each (every system region holds a file
#: descriptor and a mapping): a client that registers without end is refused, not the server.
MAX_REGIONS = 1024
#: A region name or key longer than this is refused (Triton has no limit; NAME_MAX is 255).
MAX_NAME_CHARS = 255
#: The size of a `cudaIpcMemHandle_t` (CUDA_IPC_HANDLE_SIZE).
CUDA_IPC_HANDLE_BYTES = 64


class Forbidden(DStackError):
    """Shared memory asked for by a client that may not use it (403 / PERMISSION_DENIED)."""

    status_code = 403
    reason = "rejected"  # counted with the other requests refused for what they asked


def _int(value: object, what: str) -> int:
    # `type(x) is int`: JSON true/false parse as bool, which is not a size
    if type(value) is not int or value < 0:
        raise RequestError(f"{what} must be a non-negative integer, got {value!r}")
    return value


def _name(value: object, what: str = "region name") -> str:
    if not isinstance(value, str) or not value:
        raise RequestError(f"{what} must be a non-empty string, got {value!r}")
    if len(value) > MAX_NAME_CHARS:
        raise RequestError(f"{what} has {len(value)} characters, at most {MAX_NAME_CHARS}")
    return value


def shm_key(value: object) -> str:
    """A POSIX shared-memory object's name as `shm_open` takes it: one leading "/" at
    most and none after it (no path outside the shared-memory filesystem)."""
    key = _name(value, "key")
    bare = key[1:] if key.startswith("/") else key
    if not bare or "/" in bare or bare in (".", "..") or "\0" in bare:
        raise RequestError(f"key {key!r} is not a shared-memory object's name "
                           "(\"/name\", as shm_open takes it)")
    return key


def _shm_open(key: str) -> int:
    """`shm_open(key, O_RDWR)`: what Python's multiprocessing.shared_memory calls (its
    `_posixshmem`), without the resource tracker that would unlink the client's object."""
    try:
        import _posixshmem

        return int(_posixshmem.shm_open(key, os.O_RDWR, mode=0o600))
    except ImportError:  # pragma: no cover - Linux has it; elsewhere the usual mount point
        return os.open("/dev/shm/" + key.lstrip("/"), os.O_RDWR | os.O_NOFOLLOW)


class SystemRegion:
    """A registered system shared-memory region, mapped. `view` and `write` check every
    offset and size against it; the mapping is closed when the region is unregistered
    and no array of a request still uses it (else when the last one goes)."""

    def __init__(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self.name, self.key, self.offset, self.byte_size = name, key, offset, byte_size
        try:
            fd = _shm_open(key)
        except OSError as e:
            raise RequestError(f"system shared memory region {name!r}: cannot open key "
                               f"{key!r}: {e.strerror or e}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise RequestError(f"system shared memory region {name!r}: key {key!r} is "
                                   "not a shared-memory object")
            if offset + byte_size > st.st_size:
                raise RequestError(
                    f"system shared memory region {name!r}: offset {offset} + byte_size "
                    f"{byte_size} = {offset + byte_size} runs past the end of key {key!r} "
                    f"({st.st_size} bytes)")
            # mmap's own offset must be a multiple of the allocation granularity
            start = offset - offset % mmap.ALLOCATIONGRANULARITY
            self.mm = mmap.mmap(fd, offset + byte_size - start, offset=start)
            self.base = offset - start
        except BaseException:
            os.close(fd)
            raise
        # kept to notice a client that shrank its object under us (touching a page past
        # its end would kill the server with SIGBUS): `_check_size`
        self.fd = fd

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset,
                "byte_size": self.byte_size}

    def _bounds(self, offset: int, byte_size: int, where: str) -> None:
        if offset + byte_size > self.byte_size:
            raise RequestError(
                f"{where}: shared memory region {self.name!r} holds {self.byte_size} bytes; "
                f"shared_memory_offset {offset} + shared_memory_byte_size {byte_size} = "
                f"{offset + byte_size} runs past its end")
        if self.fd < 0:
            raise RequestError(f"{where}: shared memory region {self.name!r} was "
                               "unregistered while the request used it")
        size = os.fstat(self.fd).st_size
        if self.offset + offset + byte_size > size:
            raise RequestError(f"{where}: shared memory region {self.name!r}: key "
                               f"{self.key!r} was shrunk to {size} bytes under the region")

    def view(self, offset: int, byte_size: int, dt: DType, shape: tuple[int, ...],
             where: str) -> np.ndarray:
        """A read-only array of `shape` and `dt` over the region's bytes at `offset` (no
        copy); it holds the mapping for as long as it lives."""
        self._bounds(offset, byte_size, where)
        dtype = NP_DTYPES[dt]
        arr = np.frombuffer(self.mm, dtype, byte_size // dtype.itemsize, self.base + offset)
        arr.flags.writeable = False
        return arr.reshape(shape)

    def write(self, offset: int, data: np.ndarray, where: str) -> None:
        self._bounds(offset, data.nbytes, where)
        start = self.base + offset
        dst = np.frombuffer(self.mm, np.uint8, data.nbytes, start)
        dst[:] = np.ascontiguousarray(data).reshape(-1).view(np.uint8)

    def close(self) -> None:
        """Unregistered: the descriptor goes now, the mapping as soon as no request's
        array holds it (a `BufferError` says some still do: the last one closes it)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            self.mm.close()
        except BufferError:
            pass


class CudaMapping(Protocol):
    """Another process's device memory, opened from its `cudaIpcMemHandle_t`."""

    def read(self, offset: int, byte_size: int) -> np.ndarray:
        """`byte_size` bytes from `offset`, on the host (uint8)."""

    def write(self, offset: int, data: np.ndarray) -> None:
        """`data`'s bytes at `offset`."""

    def close(self) -> None:
        """Close the handle (cudaIpcCloseMemHandle)."""


class CudaOpener(Protocol):
    def __call__(self, handle: bytes, device_id: int, byte_size: int) -> CudaMapping:
        """Open `handle` on `device_id`; RequestError when CUDA refuses it."""


class CudaRegion:
    """A registered CUDA region. `closed`: unregistered (no new request may use it, nor
    an answer be written into it); its handle stays open while `users` (requests' inputs
    that read from it) live, then `on_close(handle)` tells the workers to close theirs."""

    def __init__(self, name: str, handle: bytes, device_id: int, byte_size: int,
                 mapping: CudaMapping, on_close: Callable[[bytes], None]) -> None:
        self.name, self.handle, self.device_id = name, handle, device_id
        self.byte_size = byte_size
        self.mapping = mapping
        self.on_close = on_close
        self.closed = False
        self.users = 0

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "device_id": self.device_id, "byte_size": self.byte_size}

    def _bounds(self, offset: int, byte_size: int, where: str) -> None:
        if offset + byte_size > self.byte_size:
            raise RequestError(
                f"{where}: CUDA shared memory region {self.name!r} holds {self.byte_size} "
                f"bytes; shared_memory_offset {offset} + shared_memory_byte_size "
                f"{byte_size} = {offset + byte_size} runs past its end")
        if self.closed:
            raise RequestError(f"{where}: CUDA shared memory region {self.name!r} was "
                               "unregistered while the request used it")

    def view(self, offset: int, byte_size: int, dt: DType, shape: tuple[int, ...],
             where: str) -> DeviceInput:
        """The input: read where it is used (on the device by a CUDA worker); the region
        stays open while it lives."""
        self._bounds(offset, byte_size, where)
        np_dt = NP_DTYPES[dt]

        def read() -> np.ndarray:  # one copy, device to host
            return self.mapping.read(offset, byte_size).view(np_dt).reshape(shape)

        x = DeviceInput(self.handle, offset, shape, np_dt, read)
        self.users += 1
        # not at the interpreter's exit, when CUDA may be torn down: the process ends
        weakref.finalize(x, self._release).atexit = False
        return x

    def write(self, offset: int, data: np.ndarray, where: str) -> None:
        self._bounds(offset, data.nbytes, where)
        self.mapping.write(offset, np.ascontiguousarray(data))

    def _release(self) -> None:
        self.users -= 1
        if self.closed and self.users == 0:
            self._close_handle()

    def close(self) -> None:
        """Unregistered: the handle is closed now, or when the last input reading from
        it goes."""
        if self.closed:
            return
        self.closed = True
        if self.users == 0:
            self._close_handle()

    def _close_handle(self) -> None:
        self.mapping.close()
        self.on_close(self.handle)


Region = SystemRegion | CudaRegion


@dataclass(frozen=True, slots=True)
class OutputTarget:
    """Where a requested output goes: `byte_size` bytes at `offset` of `region` (the
    region itself, held until the answer is written, even if unregistered meanwhile)."""

    region: Region
    offset: int
    byte_size: int

    def write(self, name: str, data: np.ndarray) -> dict[str, Any]:
        """Write output `name` into the region: the parameters its answer carries."""
        where = f"output {name!r}"
        if data.nbytes > self.byte_size:
            raise RequestError(
                f"{where} has {data.nbytes} bytes but shared_memory_byte_size is "
                f"{self.byte_size} (region {self.region.name!r})")
        self.region.write(self.offset, data, where)
        params: dict[str, Any] = {"shared_memory_region": self.region.name,
                                  "shared_memory_byte_size": data.nbytes}
        if self.offset:
            params["shared_memory_offset"] = self.offset
        return params


class ShmAccess(Protocol):
    """What a request's codec asks for its shared-memory tensors (`SharedMemory.access`)."""

    def input(self, params: Mapping[str, object], dt: DType, shape: tuple[int, ...],
              where: str) -> np.ndarray | DeviceInput: ...

    def output(self, params: Mapping[str, object], where: str) -> OutputTarget: ...


class Denied:
    """A request that may not use shared memory: each tensor that asks is refused with
    `error`."""

    def __init__(self, error: DStackError) -> None:
        self.error = error

    def input(self, params: Mapping[str, object], dt: DType, shape: tuple[int, ...],
              where: str) -> np.ndarray:
        raise type(self.error)(f"{where}: {self.error.message}")

    def output(self, params: Mapping[str, object], where: str) -> OutputTarget:
        raise type(self.error)(f"{where}: {self.error.message}")


#: Shared memory asked for by a request that has no access (pure codec calls, tests).
NO_ACCESS = Denied(RequestError("shared-memory tensors are not enabled on this server "
                                "(server.allow_client_shm / --allow-client-shm)"))


def tensor_params(params: Mapping[str, object], where: str) -> tuple[str, int, int]:
    """A tensor's `shared_memory_region`, `shared_memory_offset` (default 0) and
    `shared_memory_byte_size`, checked; RequestError naming the bad one."""
    region = _name(params.get("shared_memory_region"), f"{where}: shared_memory_region")
    offset = _int(params.get("shared_memory_offset", 0), f"{where}: shared_memory_offset")
    size = params.get("shared_memory_byte_size")
    if size is None:
        raise RequestError(f"{where}: shared_memory_region {region!r} needs "
                           "shared_memory_byte_size")
    return region, offset, _int(size, f"{where}: shared_memory_byte_size")


class ShmRegistry:
    """The regions registered with this server, system and CUDA, by name. `cuda`: opens a
    `cudaIpcMemHandle_t` (None: no CUDA device here, every CUDA call is refused)."""

    def __init__(self, cuda: CudaOpener | None = None, cuda_missing: str = "") -> None:
        self.system: dict[str, SystemRegion] = {}
        self.cuda: dict[str, CudaRegion] = {}
        self.cuda_open = cuda
        self.cuda_missing = cuda_missing or "this server has no CUDA device"
        #: Told a CUDA region's handle once it is closed: the backend's workers close
        #: theirs (`InferenceBackend.forget_device_memory`).
        self.forget_device_memory: Callable[[bytes], None] = lambda handle: None

    # ------------------------------------------------------------------ system

    def register_system(self, name: object, key: object, offset: object,
                        byte_size: object) -> None:
        name = _name(name)
        if name in self.system:
            raise RequestError(f"system shared memory region {name!r} is already registered "
                               "(unregister it first)")
        if len(self.system) >= MAX_REGIONS:
            raise RequestError(f"{MAX_REGIONS} system shared memory regions are registered "
                               "already: unregister some first")
        key = shm_key(key)
        offset = _int(offset, "offset")
        size = _int(byte_size, "byte_size")
        if size == 0:
            raise RequestError(f"system shared memory region {name!r}: byte_size must be > 0")
        self.system[name] = SystemRegion(name, key, offset, size)

    def unregister_system(self, name: str | None = None) -> None:
        """Unregister `name` (None: every region). An unknown name is no error (Triton's)."""
        _unregister(self.system, name)

    def system_status(self, name: str | None = None) -> list[dict[str, Any]]:
        return _status(self.system, name, "system")

    # ------------------------------------------------------------------ CUDA

    def _need_cuda(self) -> CudaOpener:
        if self.cuda_open is None:
            raise RequestError(f"CUDA shared memory is not available: {self.cuda_missing}")
        return self.cuda_open

    def register_cuda(self, name: object, raw_handle: object, device_id: object,
                      byte_size: object) -> None:
        name = _name(name)
        if not isinstance(raw_handle, bytes) or len(raw_handle) != CUDA_IPC_HANDLE_BYTES:
            got = len(raw_handle) if isinstance(raw_handle, bytes) else type(raw_handle).__name__
            raise RequestError(f"CUDA shared memory region {name!r}: raw_handle must be a "
                               f"cudaIpcMemHandle_t of {CUDA_IPC_HANDLE_BYTES} bytes, got {got}")
        device = _int(device_id, "device_id")
        size = _int(byte_size, "byte_size")
        if size == 0:
            raise RequestError(f"CUDA shared memory region {name!r}: byte_size must be > 0")
        opener = self._need_cuda()
        if name in self.cuda:
            raise RequestError(f"CUDA shared memory region {name!r} is already registered "
                               "(unregister it first)")
        if len(self.cuda) >= MAX_REGIONS:
            raise RequestError(f"{MAX_REGIONS} CUDA shared memory regions are registered "
                               "already: unregister some first")
        self.cuda[name] = CudaRegion(name, raw_handle, device, size,
                                     opener(raw_handle, device, size),
                                     lambda handle: self.forget_device_memory(handle))

    def unregister_cuda(self, name: str | None = None) -> None:
        self._need_cuda()
        _unregister(self.cuda, name)

    def cuda_status(self, name: str | None = None) -> list[dict[str, Any]]:
        self._need_cuda()
        return _status(self.cuda, name, "CUDA")

    # ------------------------------------------------------------------ requests

    def region(self, name: str, where: str) -> Region:
        region: Region | None = self.system.get(name) or self.cuda.get(name)
        if region is None:
            raise RequestError(f"{where}: no shared memory region {name!r} is registered")
        return region

    def close(self) -> None:
        self.unregister_system()
        for r in list(self.cuda.values()):
            r.close()
        self.cuda.clear()


class RegistryAccess:
    """A permitted request's view of the registry (`ShmAccess`)."""

    def __init__(self, registry: ShmRegistry) -> None:
        self.registry = registry

    def input(self, params: Mapping[str, object], dt: DType, shape: tuple[int, ...],
              where: str) -> np.ndarray | DeviceInput:
        name, offset, size = tensor_params(params, where)
        count = math.prod(shape)
        want = count * NP_DTYPES[dt].itemsize
        if size != want:
            raise RequestError(
                f"{where}: shared_memory_byte_size {size} does not match shape "
                f"[{','.join(map(str, shape))}] of {dt.value} ({want} bytes)")
        return self.registry.region(name, where).view(offset, size, dt, shape, where)

    def output(self, params: Mapping[str, object], where: str) -> OutputTarget:
        name, offset, size = tensor_params(params, where)
        region = self.registry.region(name, where)
        region._bounds(offset, size, where)  # before the request runs
        return OutputTarget(region, offset, size)


@functools.lru_cache(maxsize=4096)
def is_local_peer(peer: str | None) -> bool:
    """Whether a connection's peer is on this host: a loopback address, or a Unix socket
    (`peer` as gRPC's `context.peer()` says it: "ipv4:127.0.0.1:5000", "ipv6:[::1]:5000",
    "unix:/path"; or a bare address, as ASGI's `scope["client"][0]`). Remembered per
    peer: it is asked for every request, and `ipaddress` takes tens of µs to answer."""
    if not peer:
        return False
    if peer.startswith("unix:"):
        return True
    host = peer
    if peer.startswith(("ipv4:", "ipv6:")):
        host = peer[5:].rsplit(":", 1)[0]
    try:
        ip = ipaddress.ip_address(host.strip("[]").split("%")[0])
    except ValueError:
        return False
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return (mapped or ip).is_loopback


class SharedMemory:
    """The server's shared-memory extensions: the registry and who may use it. `allowed`:
    `server.allow_client_shm` (off: every call and every shared-memory tensor refused)."""

    def __init__(self, allowed: bool, registry: ShmRegistry | None = None) -> None:
        self.allowed = allowed
        if registry is None:  # CUDA looked for only when on: it imports torch
            registry = ShmRegistry(*cuda_opener()) if allowed else ShmRegistry()
        self.registry = registry
        self._access = RegistryAccess(registry)

    @property
    def extensions(self) -> list[str]:
        """What `GET /v2` lists: the extensions a client on this host can use."""
        if not self.allowed:
            return []
        cuda = ["cuda_shared_memory"] if self.registry.cuda_open is not None else []
        return ["system_shared_memory", *cuda]

    def check(self, peer: str | None) -> ShmRegistry:
        """The registry, for a client at `peer` (`is_local_peer`'s form); RequestError
        when shared memory is off, Forbidden when the client is not on this host."""
        if not self.allowed:
            raise NO_ACCESS.error
        if not is_local_peer(peer):
            who = peer or "not known"
            raise Forbidden("shared memory is only for clients on this host (loopback or "
                            f"a Unix socket); this one is {who}")
        return self.registry

    def access(self, peer: str | None) -> ShmAccess:
        """What a request from `peer` may do with its shared-memory tensors."""
        if not self.allowed:
            return NO_ACCESS
        try:
            self.check(peer)
        except DStackError as e:
            return Denied(e)
        return self._access


def cuda_opener() -> tuple[CudaOpener | None, str]:
    """The CUDA IPC opener of this host and, without one, why (`dstack.runtime.cuda_ipc`)."""
    from dstack.runtime.cuda_ipc import opener

    return opener()


def _unregister(regions: dict[str, Any], name: str | None) -> None:
    """Close and forget `name` in `regions` (None: every one); an unknown name is no error."""
    for n in list(regions) if name is None else [name]:
        region = regions.pop(n, None)
        if region is not None:
            region.close()


def _status(regions: dict[str, Any], name: str | None, kind: str) -> list[dict[str, Any]]:
    """Triton's status list: every region of `regions`, or `name`'s (400 if unknown)."""
    if name is None:
        return [r.status() for r in regions.values()]
    region = regions.get(name)
    if region is None:
        raise RequestError(f"no {kind} shared memory region {name!r} is registered")
    return [region.status()]
