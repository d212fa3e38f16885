"""The link between a front end and the dispatch process (`server.link`): frames come
out whole and in order however the bytes are cut into reads, small ones many per read and
big payloads straight into their own buffer."""

from __future__ import annotations

import random
from typing import Any

from server.link import READ_BYTES, FrameReader, frame


class _Collect(FrameReader):
    def __init__(self) -> None:
        super().__init__()
        self.frames: list[tuple[dict[str, Any], bytes]] = []

    def on_frame(self, meta: dict[str, Any], payload: bytes | bytearray) -> None:
        self.frames.append((meta, bytes(payload)))


def _feed(reader: FrameReader, data: bytes, cuts: random.Random) -> None:
    """`data` into `reader` as the loop would: each read at most what get_buffer offers."""
    at = 0
    while at < len(data):
        buf = reader.get_buffer(-1)
        n = min(len(buf), len(data) - at, cuts.randint(1, 3 * READ_BYTES))
        buf[:n] = data[at:at + n]
        reader.buffer_updated(n)
        at += n


def test_frames_come_out_whole_and_in_order_however_the_reads_cut_them() -> None:
    rng = random.Random(7)
    sizes = [0, 1, 10, 600_000, 5, READ_BYTES - 20, READ_BYTES, READ_BYTES + 1, 3_000_000, 0, 7]
    sent = [({"k": "b", "i": i, "m": "model" * (i % 3)}, rng.randbytes(n))
            for i, n in enumerate(sizes * 3)]
    data = b"".join(b"".join(frame(meta, payload)) for meta, payload in sent)
    for seed in range(5):
        reader = _Collect()
        _feed(reader, data, random.Random(seed))
        assert reader.frames == sent


def test_many_small_frames_are_parsed_from_one_read() -> None:
    reader = _Collect()
    sent = [({"k": "h", "i": i, "m": "tiny_cnn", "t": 1.5}, b"") for i in range(500)]
    data = b"".join(b"".join(frame(m, p)) for m, p in sent)
    reads = 0
    at = 0
    while at < len(data):
        buf = reader.get_buffer(-1)
        n = min(len(buf), len(data) - at)
        buf[:n] = data[at:at + n]
        reader.buffer_updated(n)
        at += n
        reads += 1
    assert reader.frames == sent
    assert reads <= len(data) // (READ_BYTES // 2) + 1  # not one read per frame
