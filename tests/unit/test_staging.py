"""Double buffering, the dispatcher's side: a `Stager` over a real shared-memory arena puts
every batch's rows where the worker reads them, whatever was staged early, refused or left
over; rows in a client's device memory are named to a CUDA worker, which copies them
(`DeviceReader`, over a fake libcudart whose device memory is host memory); and the CUDA
worker's early copies (the GPU test)."""

from __future__ import annotations

import ctypes
import pickle

import numpy as np
import pytest
import torch

from dstack.common.types import DType, ModelSpec, TensorSpec
from dstack.runtime.cuda_ipc import CudaRuntime
from dstack.runtime.dispatch import Ticket
from dstack.runtime.messages import DeviceRows
from dstack.runtime.shm import Arena, ArenaLayout
from dstack.runtime.staging import DeviceInput, Stager
from dstack.runtime.upload import DeviceMemoryError, DeviceReader, first_row_to_copy
from tests.unit.test_shm import FakeCudart

SPEC = ModelSpec("m", (TensorSpec("x", DType.FP32, (-1, 3)), TensorSpec("k", DType.INT64, (-1,))),
                 (TensorSpec("y", DType.FP32, (-1, 3)),), max_batch_size=6)


class Requests:
    """Tickets with distinct inputs; `refuse` answers one without running it."""

    def __init__(self) -> None:
        self.inputs: dict[int, dict[str, np.ndarray]] = {}
        self.gone: set[int] = set()
        self.n = 0

    def new(self, rows: int) -> Ticket:
        self.n += 1
        t = Ticket(0, rows, 0.0, 1.0)
        base = 100 * self.n
        self.inputs[id(t)] = {
            "x": np.arange(base, base + 3 * rows, dtype=np.float32).reshape(rows, 3),
            "k": np.full(rows, self.n, dtype=np.int64)}
        return t

    def rows(self, tickets: list[Ticket]) -> dict[str, np.ndarray]:
        return {name: np.concatenate([self.inputs[id(t)][name] for t in tickets])
                for name in ("x", "k")}


@pytest.fixture
def arena() -> Arena:
    a = Arena(ArenaLayout.for_spec(SPEC))
    yield a
    a.close()


def stager(arena: Arena, req: Requests, on_device: bool = False) -> Stager:
    return Stager(arena, lambda t: req.inputs[id(t)], lambda t: id(t) in req.gone, on_device)


def check(arena: Arena, req: Requests, half: int, batch: list[Ticket]) -> None:
    n = sum(t.n for t in batch)
    got = arena.inputs(n, half)
    want = req.rows(batch)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
    del got


def test_rows_staged_on_arrival_are_the_batch_and_halves_alternate(arena: Arena) -> None:
    req = Requests()
    st = stager(arena, req)
    ts = [req.new(r) for r in (1, 2, 1, 3, 1)]
    for t in ts:
        st.add(t)
    # the first three fill 4 rows of half 0; the 3-row one does not fit after them
    assert arena.staged_rows(0) == 4
    half, fresh, _ = st.launch(ts[:3], 4)
    assert (half, fresh) == (0, 4)  # nothing written at launch
    check(arena, req, 0, ts[:3])
    st.restage()  # what is still queued goes into half 1 while batch 0 computes
    assert st.half == 1 and arena.staged_rows(1) == 4
    late = req.new(2)
    st.add(late)  # 6 rows: half 1 is full
    assert arena.staged_rows(1) == 6
    half, fresh, _ = st.launch([ts[3], ts[4], late], 6)
    assert (half, fresh) == (1, 6)
    check(arena, req, 1, [ts[3], ts[4], late])
    assert st.rows_ahead == 10 and st.rows_at_launch == 0


def test_a_refused_head_or_a_capped_batch_still_gets_the_right_rows(arena: Arena) -> None:
    req = Requests()
    st = stager(arena, req)
    ts = [req.new(r) for r in (2, 1, 1, 2)]
    for t in ts:
        st.add(t)
    req.gone.add(id(ts[0]))  # refused while queued: its rows sit at 0-1
    half, fresh, _ = st.launch(ts[1:3], 2)
    assert (half, fresh) == (0, 0)  # rewritten from row 0
    check(arena, req, 0, ts[1:3])
    st.restage()
    # ts[3] is left over from half 0; it goes to half 1 at row 0; a new one after it
    more = req.new(3)
    st.add(more)
    assert arena.staged_rows(1) == 5
    # a batch capped below what is staged takes the first one only
    half, fresh, _ = st.launch([ts[3]], 2)
    assert (half, fresh) == (1, 2)
    check(arena, req, 1, [ts[3]])
    st.restage()
    half, fresh, _ = st.launch([more], 3)
    assert half == 0
    check(arena, req, 0, [more])


def test_a_request_the_stager_never_saw_is_written_at_launch(arena: Arena) -> None:
    req = Requests()
    st = stager(arena, req)
    before = req.new(2)  # admitted before this worker's stager existed (a new worker)
    t = req.new(1)
    st.add(t)
    half, fresh, _ = st.launch([before, t], 3)
    assert (half, fresh) == (0, 0)
    check(arena, req, 0, [before, t])
    assert st.rows_at_launch == 3


class ClientDevice:
    """A client's device allocation, faked: host memory behind a fake libcudart; each
    `DeviceInput` of it counts its reads through the host."""

    HANDLE = bytes(range(64))

    def __init__(self) -> None:
        self.lib = FakeCudart(size=4096)
        self.mem = np.frombuffer(self.lib.mem, np.uint8)
        self.used = 0
        self.host_reads = 0

    def put(self, x: np.ndarray) -> DeviceInput:
        offset = self.used + 8  # not at the start of the allocation
        self.mem[offset:offset + x.nbytes] = x.reshape(-1).view(np.uint8)
        self.used = offset + x.nbytes

        def read() -> np.ndarray:
            self.host_reads += 1
            return x

        return DeviceInput(self.HANDLE, offset, x.shape, x.dtype, read)


def test_device_rows_are_named_to_a_cuda_worker_which_copies_them(arena: Arena) -> None:
    """Rows staged early, rows written at launch and rows in a client's device memory
    make up the batch the worker computes: the device rows never pass through the host."""
    req = Requests()
    dev = ClientDevice()
    st = stager(arena, req, on_device=True)
    ts = [req.new(r) for r in (2, 1, 3)]
    want = req.rows(ts)
    for t in ts[1:]:  # their "x" is in the client's device memory, "k" is not
        req.inputs[id(t)]["x"] = dev.put(req.inputs[id(t)]["x"])
    for t in ts[:2]:
        st.add(t)  # staged early; the last is written at launch
    half, fresh, rows = st.launch(ts, 6)
    assert fresh == 3
    assert rows == (DeviceRows(0, 2, dev.HANDLE, 8, 12), DeviceRows(0, 3, dev.HANDLE, 28, 36))
    assert dev.host_reads == 0 and st.rows_on_device == 4

    # the worker: its device tensors start as the arena's rows, then the device rows
    xs = [torch.from_numpy(a.copy()) for a in arena.inputs(6, half).values()]
    reader = DeviceReader(lambda: CudaRuntime(dev.lib))  # type: ignore[arg-type]
    reader.copy(rows, xs, stream=7)
    np.testing.assert_array_equal(xs[0].numpy(), want["x"])
    np.testing.assert_array_equal(xs[1].numpy(), want["k"])
    assert dev.lib.handles == [dev.HANDLE]  # opened once for both rows
    assert dev.lib.streams == [7, 7]  # on the worker's copy stream
    with pytest.raises(RuntimeError, match="run past its 6 rows"):
        reader.copy([DeviceRows(0, 5, dev.HANDLE, 8, 24)], xs, stream=7)
    reader.forget(dev.HANDLE)
    reader.forget(dev.HANDLE)  # once only
    assert dev.lib.closed == [ctypes.addressof(dev.lib.mem)]
    reader.copy(rows[:1], xs, stream=7)  # registered again: opened again
    assert dev.lib.handles == [dev.HANDLE] * 2
    reader.close()
    assert len(dev.lib.closed) == 2


def test_device_rows_of_a_request_the_stager_never_saw(arena: Arena) -> None:
    """Admitted before the worker was ready (no stager then): its rows are named all the
    same when its batch is launched."""
    req = Requests()
    dev = ClientDevice()
    st = stager(arena, req, on_device=True)
    t = req.new(2)
    req.inputs[id(t)]["x"] = dev.put(req.inputs[id(t)]["x"])
    _, _, rows = st.launch([t], 2)
    assert rows == (DeviceRows(0, 0, dev.HANDLE, 8, 24),) and dev.host_reads == 0


def test_a_worker_that_cannot_open_device_memory_gets_it_through_the_host(
        arena: Arena) -> None:
    """CUDA refuses the worker the client's handle: its batch fails with the kind of error
    that says so, and the dispatcher's next batches, rows staged before it knew included,
    carry those rows in the arena."""
    dev = ClientDevice()
    refused = DeviceReader(lambda: CudaRuntime(FakeCudart(open_rc=400)))  # type: ignore[arg-type]
    xs = [torch.zeros(6, 3)]
    with pytest.raises(DeviceMemoryError, match="cudaIpcOpenMemHandle failed"):
        refused.copy([DeviceRows(0, 0, dev.HANDLE, 8, 12)], xs, stream=0)

    req = Requests()
    st = stager(arena, req, on_device=True)
    ts = [req.new(r) for r in (1, 2)]
    want = req.rows(ts)
    for t in ts:
        req.inputs[id(t)]["x"] = dev.put(req.inputs[id(t)]["x"])
        st.add(t)  # staged without their "x"
    st.through_host()
    half, fresh, rows = st.launch(ts, 3)
    assert rows == () and fresh == 0 and dev.host_reads == 2
    np.testing.assert_array_equal(arena.inputs(3, half)["x"], want["x"])


def test_a_cpu_worker_gets_device_rows_through_its_arena(arena: Arena) -> None:
    req = Requests()
    dev = ClientDevice()
    st = stager(arena, req)  # not on_device
    ts = [req.new(r) for r in (1, 2)]
    want = req.rows(ts)
    req.inputs[id(ts[1])]["x"] = dev.put(req.inputs[id(ts[1])]["x"])
    st.add(ts[0])
    half, _, rows = st.launch(ts, 3)
    assert rows == () and dev.host_reads == 1
    check(arena, req, half, ts)
    np.testing.assert_array_equal(arena.inputs(3, half)["x"], want["x"])
    # to a node of a cluster: pickled as the host array
    sent = pickle.loads(pickle.dumps(req.inputs[id(ts[1])]))  # noqa: S301 - our own bytes
    assert type(sent["x"]) is np.ndarray
    np.testing.assert_array_equal(sent["x"], want["x"][1:])


def test_the_worker_copies_what_changed_after_its_early_copy() -> None:
    assert first_row_to_copy(copied=4, fresh_from=4) == 4  # nothing written at launch
    assert first_row_to_copy(copied=4, fresh_from=6) == 4  # rows 4-5 staged late
    assert first_row_to_copy(copied=4, fresh_from=0) == 0  # rewritten from row 0
    assert first_row_to_copy(copied=0, fresh_from=5) == 0


@pytest.mark.gpu
def test_cuda_inputs_copy_staged_rows_early_and_match_the_arena(arena: Arena) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from dstack.runtime.upload import CudaInputs

    req = Requests()
    st = stager(arena, req)
    up = CudaInputs(arena, torch.device("cuda"))
    try:
        assert up.pinned
        ts = [req.new(r) for r in (1, 2)]
        for t in ts:
            st.add(t)
        up.prefetch(0)  # what the worker does while the batch before computes
        assert up.copied[0] == 3
        late = req.new(2)
        st.add(late)
        half, fresh, _ = st.launch([*ts, late], 5)
        xs = up.batch(half, 5, fresh)
        torch.cuda.synchronize()
        want = req.rows([*ts, late])
        np.testing.assert_array_equal(xs[0].cpu().numpy(), want["x"])
        np.testing.assert_array_equal(xs[1].cpu().numpy(), want["k"])
        # a refused head: rewritten from row 0 after an early copy of the old rows
        st.restage()
        a, b = req.new(1), req.new(1)
        st.add(a)
        st.add(b)
        up.prefetch(1)
        req.gone.add(id(a))
        half, fresh, _ = st.launch([b], 1)
        xs = up.batch(half, 1, fresh)
        torch.cuda.synchronize()
        np.testing.assert_array_equal(xs[0].cpu().numpy(), req.rows([b])["x"])
    finally:
        up.close()
