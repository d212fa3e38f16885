"""Big JSON tensors without a Python object per number, and without reading them first.

A KServe v2 JSON request is a small header (names, shapes, datatypes) around `data` arrays
that may hold millions of numbers. Parsing the whole body with a JSON library builds one
Python float per number (about 32 bytes each, and 80 ns) before numpy ever sees it; the
server then cannot refuse the request by its batch size (`shape[0]`) without paying that.
Here the body is taken apart in two steps:

1. `split_data`: finds each `"data": [...]` array by its brackets (a few `bytes.find`
   calls, C speed), and returns the body with every such array replaced by a marker
   string, for an ordinary JSON parse of what is left (kilobytes). Anything unusual (a
   quote inside the array, brackets that do not close, a marker that does not come back
   as an input's `data`) returns None, and the caller parses the whole body as before.
2. `decode_flat`: a flat array of numbers (what tritonclient and the KServe clients
   send) is parsed by simdjson in pieces of about `CHUNK_BYTES`, each piece's numbers
   copied straight into the result array (`as_buffer`: C doubles or int64, no Python
   objects). It is a generator that yields between pieces, so that a caller on an event
   loop can let other requests run: one piece holds the GIL for about 0.2 ms (numbers
   of up to 17 digits) to 1.4 ms (50 digits: beyond 19, simdjson takes a slower path).

simdjson is as strict as a JSON parser should be (no NaN, no `01`, no `.5`, no trailing
comma) and refuses a boolean or null where a number is wanted.
"""

from __future__ import annotations

import re
import secrets
import threading
from collections.abc import Generator

import numpy as np
import orjson
import simdjson

#: Bytes of a flat `data` array parsed at once (between two yields). 1 MiB was 0.8 ms
#: for floats of 17 digits but 5.5 ms for floats of 50 (the 60 MB body of
#: bench_chaos), each such step holding the event loop; at 256 KiB the total is the same.
CHUNK_BYTES = 256 << 10

# What a body's `data` arrays are replaced with: a JSON string no client can guess.
_MARKER = "\x00dstack-data-" + secrets.token_hex(8) + "-"
_DATA_KEY = re.compile(rb'"data"\s*:\s*\[')
_local = threading.local()


class DataError(ValueError):
    """The `data` array is not what its datatype and shape need; `why` says how:
    "kind" (a boolean, null or object for a number, a fraction for an integer),
    "count" (`count` values, not the size wanted), "range" (an integer outside the
    datatype's range), "bigint" (an integer beyond 64 bits, which simdjson does not
    convert) or "malformed" (not JSON: the message says where)."""

    def __init__(self, why: str, message: str = "", *, count: int = 0) -> None:
        super().__init__(message or why)
        self.why = why
        self.count = count


def _parser() -> simdjson.Parser:
    # A parser may not parse again while objects of its last document live; one per
    # thread (the codec also runs in load-test clients' threads).
    p = getattr(_local, "parser", None)
    if p is None:
        p = _local.parser = simdjson.Parser()
    return p


def split_data(body: bytes, end: int) -> tuple[bytes, list[tuple[int, int]]] | None:
    """The JSON in `body[:end]` with each `"data": [...]` array replaced by a marker
    string, and the arrays' spans (start of `[`, end after `]`) in order, or None when
    there is no such array or the body cannot be split safely (the caller then parses it
    whole)."""
    if body.find(b'"data"', 0, end) == -1:
        return None  # binary tensors only (or no data at all): nothing to split
    pieces: list[bytes] = []
    spans: list[tuple[int, int]] = []
    pos = 0
    while True:
        m = _DATA_KEY.search(body, pos, end)
        if m is None:
            break
        start = m.end() - 1  # the '['
        stop = _closing_bracket(body, start, end)
        if stop is None or body.find(b'"', start, stop) != -1:
            return None  # strings, objects or an unclosed array: not numbers
        pieces.append(body[pos:start])
        pieces.append(orjson.dumps(f"{_MARKER}{len(spans)}"))  # NUL escaped: valid JSON
        spans.append((start, stop))
        pos = stop
    if not spans:
        return None
    pieces.append(body[pos:end])
    return b"".join(pieces), spans


def _closing_bracket(body: bytes, start: int, end: int) -> int | None:
    """The index after the `]` that closes the `[` at `start` (no strings inside)."""
    depth = 1
    pos = start + 1
    while depth:
        close = body.find(b"]", pos, end)
        if close == -1:
            return None
        if body.find(b"[", pos, close) != -1:  # (memchr: faster than count on flat data)
            depth += body.count(b"[", pos, close)
        depth -= 1
        pos = close + 1
    return pos


def marker_index(value: object) -> int | None:
    """The span number a parsed `data` value stands for, or None (not a marker)."""
    if isinstance(value, str) and value.startswith(_MARKER):
        tail = value[len(_MARKER):]
        if tail.isdigit():
            return int(tail)
    return None


def is_flat(body: bytes, span: tuple[int, int]) -> bool:
    return body.find(b"[", span[0] + 1, span[1]) == -1


def value_count(body: bytes, span: tuple[int, int]) -> int:
    """How many values a flat array has (commas + 1; 0 when it is empty)."""
    start, stop = span
    if not body[start + 1:stop - 1].strip():
        return 0
    return body.count(b",", start, stop) + 1


def decode_flat(body: bytes, span: tuple[int, int], out: np.ndarray, integers: bool
                ) -> Generator[int, None, None]:
    """Parse the flat JSON array at `span` into `out` (1-D, of exactly the size wanted),
    yielding between pieces how many of the span's bytes are parsed. Raises DataError."""
    start, stop = span
    last = stop - 1  # the ']'
    kind = "i" if integers else "d"
    view = memoryview(body)
    filled = 0
    a = start + 1
    pieces = 0
    while True:
        b = last if last - a <= CHUNK_BYTES else body.find(b",", a + CHUNK_BYTES, last)
        if b == -1:
            b = last
        doc = None
        try:
            doc = _parser().parse(b"".join((b"[", view[a:b], b"]")))
            values = np.frombuffer(doc.as_buffer(of_type=kind), np.int64 if integers else
                                   np.float64)
        except TypeError:
            raise DataError("kind") from None
        except ValueError as e:
            if str(e).startswith("NUMBER_OUT_OF_RANGE"):  # an integer beyond int64
                raise DataError("range") from None
            raise DataError("malformed", str(e)) from None
        except RuntimeError as e:  # BIGINT_ERROR: an integer beyond 64 bits
            raise DataError("bigint", str(e)) from None
        finally:
            del doc
        pieces += 1
        n = values.size
        if n == 0 and (pieces > 1 or b != last):
            raise DataError("malformed", "a comma with no value after it")
        if filled + n > out.size:
            more = body.count(b",", b, last) if b != last else 0  # values after this piece
            raise DataError("count", count=filled + n + more)
        if integers and n:
            info = np.iinfo(out.dtype)
            if values.min() < info.min or values.max() > info.max:
                raise DataError("range")
        out[filled:filled + n] = values
        filled += n
        if b == last:
            break
        a = b + 1
        yield a - start
    if filled != out.size:
        raise DataError("count", count=filled)
