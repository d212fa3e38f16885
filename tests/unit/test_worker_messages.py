"""What a worker and its dispatcher send each other over the worker's pipe comes back as it
was sent (`dstack.runtime.messages.encode` / `decode`): a batch's two messages as
fixed-size structs, the rest pickled."""

from __future__ import annotations

import pytest

from dstack.runtime import messages as m
from dstack.runtime.messages import BatchDone, RunBatch, decode, encode


@pytest.mark.parametrize("msg", [
    RunBatch(1, 1),
    RunBatch(2**40, 32, 1, 7),
    RunBatch(5, 3, 1, 0, (m.DeviceRows(0, 1, bytes(range(64)), 4096, 2 * 602112),)),
    m.ForgetMemory(bytes(64)),
    BatchDone(3, 8, 12345.678901, 0.0021),
    m.BatchFailed(4, "RuntimeError: boom"),
    m.Ready(4242, 1.5, 9.25, 32),
    m.StartFailed("ValueError: no such model\nTraceback ..."),
    m.Stop(),
])
def test_every_message_comes_back_as_it_was_sent(msg: object) -> None:
    assert decode(encode(msg)) == msg  # type: ignore[arg-type]


def test_a_batch_s_messages_are_small_structs_and_times_keep_their_precision() -> None:
    assert len(encode(RunBatch(1, 1))) == len(encode(RunBatch(2**40, 32, 1, 7))) < 40
    done = decode(encode(BatchDone(1, 1, 1.0e6 + 1e-6, 1e-7)))
    assert isinstance(done, BatchDone)
    assert done.start_s == 1.0e6 + 1e-6 and done.compute_s == 1e-7
