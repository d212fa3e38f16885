"""Double buffering, the dispatcher's side: a `Stager` over a real shared-memory arena puts
every batch's rows where the worker reads them, whatever was staged early, refused or left
over; and the CUDA worker's early copies (the GPU test)."""

from __future__ import annotations

import numpy as np
import pytest

from dstack.common.types import DType, ModelSpec, TensorSpec
from dstack.runtime.dispatch import Ticket
from dstack.runtime.shm import Arena, ArenaLayout
from dstack.runtime.staging import Stager
from dstack.runtime.upload import first_row_to_copy

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


def stager(arena: Arena, req: Requests) -> Stager:
    return Stager(arena, lambda t: req.inputs[id(t)], lambda t: id(t) in req.gone)


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
    half, fresh = st.launch(ts[:3], 4)
    assert (half, fresh) == (0, 4)  # nothing written at launch
    check(arena, req, 0, ts[:3])
    st.restage()  # what is still queued goes into half 1 while batch 0 computes
    assert st.half == 1 and arena.staged_rows(1) == 4
    late = req.new(2)
    st.add(late)  # 6 rows: half 1 is full
    assert arena.staged_rows(1) == 6
    half, fresh = st.launch([ts[3], ts[4], late], 6)
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
    half, fresh = st.launch(ts[1:3], 2)
    assert (half, fresh) == (0, 0)  # rewritten from row 0
    check(arena, req, 0, ts[1:3])
    st.restage()
    # ts[3] is left over from half 0; it goes to half 1 at row 0; a new one after it
    more = req.new(3)
    st.add(more)
    assert arena.staged_rows(1) == 5
    # a batch capped below what is staged takes the first one only
    half, fresh = st.launch([ts[3]], 2)
    assert (half, fresh) == (1, 2)
    check(arena, req, 1, [ts[3]])
    st.restage()
    half, fresh = st.launch([more], 3)
    assert half == 0
    check(arena, req, 0, [more])


def test_a_request_the_stager_never_saw_is_written_at_launch(arena: Arena) -> None:
    req = Requests()
    st = stager(arena, req)
    before = req.new(2)  # admitted before this worker's stager existed (a new worker)
    t = req.new(1)
    st.add(t)
    half, fresh = st.launch([before, t], 3)
    assert (half, fresh) == (0, 0)
    check(arena, req, 0, [before, t])
    assert st.rows_at_launch == 3


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
        half, fresh = st.launch([*ts, late], 5)
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
        half, fresh = st.launch([b], 1)
        xs = up.batch(half, 1, fresh)
        torch.cuda.synchronize()
        np.testing.assert_array_equal(xs[0].cpu().numpy(), req.rows([b])["x"])
    finally:
        up.close()
