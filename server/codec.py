"""KServe v2 / Triton HTTP wire codec: pure functions, no HTTP.

Server side: `decode_request` (body bytes -> `InferRequest`, validated against a
`ModelSpec`) and `encode_response` (outputs -> body bytes + header length).
`decode_request` is two steps that the server runs apart: `parse_request` (the header,
validated, binary tensors in place, the batch size known; JSON `data` arrays found but
not parsed) and `decode_data` (a generator that parses the JSON values a piece at a time),
so that a request refused by its batch size costs no parsing of its numbers and a big one
does not hold the event loop.
Client side (load tests, benchmarks): `encode_request` and `decode_response`.

The binary tensor data extension: the body is a JSON header followed by raw tensors;
the header's length is sent in the `Inference-Header-Content-Length` HTTP header, and
every binary tensor carries `parameters.binary_data_size`. Tensors are raw row-major
little-endian bytes (BOOL: one byte per element), in the order the JSON lists them.

Speed: tensors are never walked element by element in Python. Binary tensors are
`np.frombuffer` views of the body (read-only, zero copy). A flat JSON `data` array of
numbers is parsed by simdjson straight into the result array (`server.json_tensors`: no
Python float per number; about 5x faster than orjson + `np.asarray` on a 19 MB body);
nested lists and BOOL data, and bodies the split cannot take apart safely, are parsed by
orjson and turned into an array by `np.asarray`. JSON outputs are serialized by orjson
straight from numpy.

Imports only numpy, orjson, `server.json_tensors` (simdjson), the standard library and
`dstack.common.types` / `dstack.common.errors`, so that load-test clients can use it
without the server.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from dstack.common.errors import BackendError, RequestError
from dstack.common.types import DType, ModelSpec, TensorSpec
from server import json_tensors

if TYPE_CHECKING:  # server.shm imports this module: no import at run time
    from server.shm import OutputTarget, ShmAccess

HEADER_LENGTH = "Inference-Header-Content-Length"
"""HTTP header giving the JSON header's length when binary tensors follow it."""

NP_DTYPES: dict[DType, np.dtype] = {
    DType.BOOL: np.dtype(np.bool_),
    DType.UINT8: np.dtype("u1"),
    DType.INT8: np.dtype("i1"),
    DType.INT16: np.dtype("<i2"),
    DType.INT32: np.dtype("<i4"),
    DType.INT64: np.dtype("<i8"),
    DType.FP16: np.dtype("<f2"),
    DType.FP32: np.dtype("<f4"),
    DType.FP64: np.dtype("<f8"),
}
_DTYPE_OF_KIND = {(v.kind, v.itemsize): k for k, v in NP_DTYPES.items()}
_SUPPORTED = ", ".join(d.value for d in DType)
# Which numpy kinds (of np.asarray over the parsed JSON list) each datatype accepts:
# no silent truncation of floats into ints, no numbers as booleans.
_JSON_KINDS = {DType.BOOL: "b", DType.FP16: "fiu", DType.FP32: "fiu", DType.FP64: "fiu"}
_INT_KINDS = "iu"
_ORJSON_NUMPY = orjson.OPT_SERIALIZE_NUMPY


# --------------------------------------------------------------------------- types


@dataclass(frozen=True, slots=True)
class RequestedOutput:
    """An output named in the request's `outputs`. `binary` is the per-output
    `parameters.binary_data`; None means "use the request's binary_data_output"."""

    name: str
    binary: bool | None = None
    shm: OutputTarget | None = None  # written into a shared-memory region (server.shm)


@dataclass(frozen=True, slots=True)
class InferRequest:
    """A decoded, validated infer request. Every input has leading dimension
    `batch_size`; binary inputs are read-only views of the request body."""

    id: str | None
    inputs: dict[str, np.ndarray]
    outputs: tuple[RequestedOutput, ...]  # empty: every output of the model
    binary_output: bool  # parameters.binary_data_output
    batch_size: int


@dataclass(frozen=True, slots=True)
class InferResponse:
    """A decoded infer response (client side)."""

    model_name: str
    model_version: str | None
    id: str | None
    outputs: dict[str, np.ndarray]


# --------------------------------------------------------------------------- helpers


def datatype_of(arr: np.ndarray) -> DType:
    """The KServe datatype of a numpy array; RequestError for others (BYTES, objects)."""
    dt = _DTYPE_OF_KIND.get((arr.dtype.kind, arr.dtype.itemsize))
    if dt is None:
        raise RequestError(f"numpy dtype {arr.dtype} has no KServe datatype ({_SUPPORTED})")
    return dt


def _parse_datatype(value: object, where: str) -> DType:
    if not isinstance(value, str):
        raise RequestError(f"{where}: 'datatype' must be a string, got {value!r}")
    try:
        return DType(value)
    except ValueError:
        raise RequestError(
            f"{where}: datatype {value!r} is not supported (supported: {_SUPPORTED})"
        ) from None


def _parse_shape(value: object, where: str) -> tuple[int, ...]:
    # `type(d) is int`: JSON true/false parse as bool, which is not a dimension.
    if not isinstance(value, list) or not all(type(d) is int and d >= 0 for d in value):
        raise RequestError(
            f"{where}: 'shape' must be a list of non-negative integers, got {value!r}"
        )
    return tuple(value)


def _parse_header_length(value: int | str | None, body_len: int) -> int | None:
    if value is None:
        return None
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise RequestError(f"{HEADER_LENGTH} must be an integer, got {value!r}") from None
    if n < 0 or n > body_len:
        raise RequestError(f"{HEADER_LENGTH} {n} is beyond the body of {body_len} bytes")
    return n


def _loads(data: bytes | memoryview, what: str) -> dict[str, Any]:
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise RequestError(f"malformed JSON in {what}: {e}") from None
    if not isinstance(obj, dict):
        raise RequestError(f"{what} must be a JSON object, got {type(obj).__name__}")
    return obj


def _params(obj: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    p = obj.get("parameters", {})
    if p is None:
        return {}
    if not isinstance(p, dict):
        raise RequestError(f"{where}: 'parameters' must be an object")
    return p


def _fmt(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def _array_from_json(data: object, dt: DType, shape: tuple[int, ...], where: str) -> np.ndarray:
    """Turn a JSON `data` value (flat row-major list, or nested lists of exactly `shape`)
    into an array of `shape` and dtype `dt`, without a Python loop over elements."""
    if not isinstance(data, list):
        raise RequestError(f"{where}: 'data' must be a list, got {type(data).__name__}")
    try:
        raw = np.asarray(data)
    except (ValueError, TypeError):
        raise RequestError(
            f"{where}: nested 'data' lists are ragged (expected shape {_fmt(shape)})"
        ) from None
    count = math.prod(shape)
    if raw.ndim > 1 and raw.shape != shape:
        raise RequestError(
            f"{where}: nested 'data' lists have shape {_fmt(raw.shape)}, "
            f"expected {_fmt(shape)} (or a flat list of {count} values)"
        )
    if raw.size != count:
        raise RequestError(
            f"{where}: 'data' has {raw.size} values but shape {_fmt(shape)} needs {count}"
        )
    if raw.size:
        kinds = _JSON_KINDS.get(dt, _INT_KINDS)
        if raw.dtype.kind not in kinds:
            expect = {"b": "true/false", "fiu": "numbers"}.get(kinds, "integers")
            raise RequestError(f"{where}: datatype {dt.value} needs {expect} in 'data'")
        target = NP_DTYPES[dt]
        if raw.dtype.kind in _INT_KINDS and dt.value.startswith(("INT", "UINT")):
            info = np.iinfo(target)
            if raw.min() < info.min or raw.max() > info.max:
                raise RequestError(
                    f"{where}: 'data' has values outside the {dt.value} range "
                    f"[{info.min}, {info.max}]"
                )
        return raw.astype(target, copy=False).reshape(shape)
    return np.empty(shape, NP_DTYPES[dt])


def _check_shape(shape: tuple[int, ...], ts: TensorSpec, spec: ModelSpec, where: str) -> None:
    if len(shape) != len(ts.shape):
        raise RequestError(
            f"{where}: shape {_fmt(shape)} has {len(shape)} dimensions, "
            f"model {spec.name} expects {len(ts.shape)} ({_fmt(ts.shape)})"
        )
    n = shape[0]
    if n < 1 or n > spec.max_batch_size:
        raise RequestError(
            f"{where}: batch dimension {n} is outside 1..{spec.max_batch_size} "
            f"(max_batch_size of model {spec.name})"
        )
    for i, (got, want) in enumerate(zip(shape[1:], ts.shape[1:], strict=True), start=1):
        if want != -1 and got != want:
            raise RequestError(
                f"{where}: shape {_fmt(shape)} does not match model {spec.name}'s "
                f"{_fmt(ts.shape)} (dimension {i} is {got}, expected {want})"
            )


def check_input(spec: ModelSpec, specs: Mapping[str, TensorSpec], index: int, name: object,
                datatype: object, shape: object, names: Sequence[str],
                batch: int | None) -> tuple[str, DType, tuple[int, ...]]:
    """Validate the `index`-th input of a request (HTTP's JSON or gRPC's message) against
    the model: a known name not given before (`names`), its datatype, its shape and batch
    dimension (`batch`: the other inputs', None for the first). `specs`: `spec.inputs` by
    name. Returns the name, datatype and shape; raises RequestError naming what is wrong."""
    if not isinstance(name, str):
        raise RequestError(f"inputs[{index}] has no 'name'")
    where = f"input {name!r}"
    ts = specs.get(name)
    if ts is None:
        known = ", ".join(repr(n) for n in specs)
        raise RequestError(f"unknown input {name!r}; model {spec.name} has inputs {known}")
    if name in names:
        raise RequestError(f"{where} appears twice")
    dt = _parse_datatype(datatype, where)
    if dt != ts.datatype:
        raise RequestError(
            f"{where} has datatype {dt.value}, model {spec.name} expects {ts.datatype.value}"
        )
    dims = _parse_shape(shape, where)
    _check_shape(dims, ts, spec, where)
    if batch is not None and dims[0] != batch:
        raise RequestError(f"{where} has batch dimension {dims[0]}, other inputs have {batch}")
    return name, dt, dims


def check_size(size: int, dt: DType, shape: tuple[int, ...], where: str, what: str) -> int:
    """The element count of a raw tensor of `shape` and `dt` whose bytes number `size`
    (`what` names where the size came from); RequestError when they do not match."""
    count = math.prod(shape)
    if size != count * NP_DTYPES[dt].itemsize:
        raise RequestError(
            f"{where}: {what} {size} does not match shape {_fmt(shape)} "
            f"of {dt.value} ({count * NP_DTYPES[dt].itemsize} bytes)"
        )
    return count


def check_complete(spec: ModelSpec, names: Sequence[str]) -> None:
    """RequestError naming the first input of the model that `names` leaves out."""
    missing = [t.name for t in spec.inputs if t.name not in names]
    if missing:
        raise RequestError(f"missing input {missing[0]!r} of model {spec.name}")


# --------------------------------------------------------------------------- server side


@dataclass(frozen=True, slots=True)
class _JsonInput:
    """An input whose values are JSON: already parsed (`value`), or still text at
    `span` of the body (a `data` array the header parse skipped)."""

    name: str
    datatype: DType
    shape: tuple[int, ...]
    value: object = None
    span: tuple[int, int] | None = None


def values_input(name: str, dt: DType, shape: tuple[int, ...], values: list[Any]) -> _JsonInput:
    """An input given as a list of values (gRPC's typed `contents`) for a `RequestHead`:
    `decode_data` checks and converts them as it does a JSON `data` array."""
    return _JsonInput(name, dt, shape, value=values)


@dataclass(slots=True)  # not frozen: made once per request, and frozen inits cost more
class RequestHead:
    """An infer request with its header decoded and validated against the model and its
    binary tensors in place; its JSON `data` arrays are found but not parsed yet (see
    `decode_data`). Everything but the values is known: the batch size above all, so
    that a request the server will refuse costs no parsing of its numbers."""

    id: str | None
    outputs: tuple[RequestedOutput, ...]
    binary_output: bool
    batch_size: int
    body: bytes  # the JSON of the request (all of it but its binary tensors, at least)
    names: tuple[str, ...]  # the inputs, in the request's order
    binary_inputs: dict[str, np.ndarray]
    json_inputs: tuple[_JsonInput, ...]

    @property
    def json_bytes(self) -> int:
        """Bytes of JSON `data` arrays still to parse (what `decode_data` counts)."""
        return sum(j.span[1] - j.span[0] for j in self.json_inputs if j.span is not None)


def decode_request(body: bytes | memoryview, header_length: int | str | None,
                   spec: ModelSpec) -> InferRequest:
    """Decode and validate an infer request body against `spec`.

    `header_length` is the `Inference-Header-Content-Length` header (None when absent:
    the whole body is JSON). Raises RequestError naming what is wrong on every
    malformed input; never returns a request the model cannot take. In one go:
    `parse_request`, then every step of `decode_data`.
    """
    head = parse_request(body, header_length, spec)
    if not head.json_inputs:  # binary tensors only: nothing to parse
        return InferRequest(head.id, head.binary_inputs, head.outputs, head.binary_output,
                            head.batch_size)
    steps = decode_data(head)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


def _split_header(body: bytes, end: int) -> tuple[dict[str, Any], list[tuple[int, int]]]:
    """The request header parsed with its big `data` arrays left out (their spans), or,
    when the body cannot be split safely, parsed whole (no spans)."""
    split = json_tensors.split_data(body, end)
    if split is not None:
        reduced, spans = split
        try:
            header = orjson.loads(reduced)
        except orjson.JSONDecodeError:
            header = None
        # Each span must come back exactly once, as some input's `data`; else the split
        # misread the document, and the whole-body parse below says what is wrong.
        inputs = header.get("inputs") if isinstance(header, dict) else None
        if isinstance(inputs, list):
            found = sorted(k for t in inputs if isinstance(t, dict)
                           if (k := json_tensors.marker_index(t.get("data"))) is not None)
            if found == list(range(len(spans))):
                return header, spans  # type: ignore[return-value]
    view = memoryview(body)
    return _loads(view if end == len(body) else view[:end], "request header"), []


def _no_shm(where: str) -> RequestError:
    return RequestError(f"{where}: shared-memory tensors are not enabled on this server "
                        "(server.allow_client_shm / --allow-client-shm)")


def parse_request(body: bytes | memoryview, header_length: int | str | None,
                  spec: ModelSpec, shm: ShmAccess | None = None) -> RequestHead:
    """Decode and validate everything of an infer request but its JSON values.

    `body` may be any bytes-like object (a front end's shared memory: `server.link`): its
    JSON part is then copied into `bytes` (the JSON header of a binary request: small), its
    binary tensors are views of it.

    `shm`: what the request may do with tensors in shared memory (`server.shm.SharedMemory
    .access`; None: refused): an input there is a view of its region, an output is
    written into its region by `encode_response`.

    Raises RequestError naming what is wrong (as `decode_request`); the values' own
    errors (wrong kind, count, range, malformed numbers) come from `decode_data`.
    """
    hlen = _parse_header_length(header_length, len(body))
    end = len(body) if hlen is None else hlen
    text = body if isinstance(body, bytes) else bytes(memoryview(body)[:end])
    header, spans = _split_header(text, end)

    raw_inputs = header.get("inputs")
    if raw_inputs is None:
        raise RequestError("request has no 'inputs'")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise RequestError("'inputs' must be a non-empty list of tensors")
    params = _params(header, "request")
    if "classification" in params or "shared_memory_region" in params:
        raise RequestError("classification and shared-memory parameters are not supported")

    specs = {t.name: t for t in spec.inputs}
    offset = hlen if hlen is not None else len(body)
    names: list[str] = []
    binary_inputs: dict[str, np.ndarray] = {}
    json_inputs: list[_JsonInput] = []
    batch: int | None = None
    for i, t in enumerate(raw_inputs):
        if not isinstance(t, dict):
            raise RequestError(f"inputs[{i}] must be an object")
        name, dt, shape = check_input(spec, specs, i, t.get("name"), t.get("datatype"),
                                      t.get("shape"), names, batch)
        where = f"input {name!r}"
        batch = shape[0]
        tparams = _params(t, where)
        size = tparams.get("binary_data_size")
        if "shared_memory_region" in tparams:
            if size is not None or "data" in t:
                raise RequestError(f"{where} has both shared_memory_region and "
                                   f"{'data' if 'data' in t else 'binary_data_size'}: give one")
            if shm is None:
                raise _no_shm(where)
            binary_inputs[name] = shm.input(tparams, dt, shape, where)
        elif size is not None:
            if "data" in t:
                raise RequestError(f"{where} has both 'data' and binary_data_size")
            if hlen is None:
                raise RequestError(
                    f"{where} has binary_data_size but the request has no {HEADER_LENGTH} header"
                )
            if type(size) is not int or size < 0:
                raise RequestError(f"{where}: binary_data_size must be a non-negative integer")
            count = check_size(size, dt, shape, where, "binary_data_size")
            if offset + size > len(body):
                raise RequestError(
                    f"{where}: binary_data_size {size} runs past the end of the body "
                    f"({len(body) - offset} bytes of binary data left)"
                )
            binary_inputs[name] = np.frombuffer(body, NP_DTYPES[dt], count,
                                                offset).reshape(shape)
            offset += size
        elif "data" in t:
            data = t["data"]
            k = json_tensors.marker_index(data) if spans else None
            json_inputs.append(_JsonInput(name, dt, shape, span=spans[k]) if k is not None
                               else _JsonInput(name, dt, shape, value=data))
        else:
            raise RequestError(f"{where} has neither 'data' nor binary_data_size")
        names.append(name)

    if offset != len(body):
        raise RequestError(
            f"body has {len(body) - offset} bytes after the header and binary tensors "
            "that no binary_data_size accounts for"
        )
    check_complete(spec, names)

    binary_output = params.get("binary_data_output", False)
    if not isinstance(binary_output, bool):
        raise RequestError("parameters.binary_data_output must be true or false")
    outputs = parse_outputs(header.get("outputs"), spec, shm)
    rid = header.get("id")
    if rid is not None and not isinstance(rid, str):
        raise RequestError("'id' must be a string")
    assert batch is not None
    return RequestHead(rid, outputs, binary_output, batch, text, tuple(names), binary_inputs,
                       tuple(json_inputs))


def decode_data(head: RequestHead) -> Generator[int, None, InferRequest]:
    """Parse the JSON values of a parsed request: a generator that yields between
    pieces of big flat `data` arrays (about `json_tensors.CHUNK_BYTES` each) how many of
    `head.json_bytes` are parsed so far, and returns the `InferRequest`. An event loop can
    step it and let other work run in between; `decode_request` runs it to the end.
    Raises RequestError naming what is wrong."""
    arrays = dict(head.binary_inputs)
    before = 0  # bytes of the spans parsed before this one
    for j in head.json_inputs:
        steps = _json_array(head.body, j)
        while True:
            try:
                done = next(steps)
            except StopIteration as e:
                arrays[j.name] = e.value
                break
            yield before + done
        if j.span is not None:
            before += j.span[1] - j.span[0]
    inputs = {n: arrays[n] for n in head.names}
    return InferRequest(head.id, inputs, head.outputs, head.binary_output, head.batch_size)


def _json_span_whole(body: bytes, j: _JsonInput) -> np.ndarray:
    """A `data` array at `j.span` parsed in one piece with orjson, as the whole body was."""
    assert j.span is not None
    try:
        value = orjson.loads(memoryview(body)[j.span[0]:j.span[1]])
    except orjson.JSONDecodeError as e:
        raise RequestError(f"input {j.name!r}: malformed JSON in 'data': {e}") from None
    return _array_from_json(value, j.datatype, j.shape, f"input {j.name!r}")


def _json_array(body: bytes, j: _JsonInput) -> Generator[int, None, np.ndarray]:
    where = f"input {j.name!r}"
    if j.span is None:
        return _array_from_json(j.value, j.datatype, j.shape, where)
    start, stop = j.span
    if j.datatype == DType.BOOL or not json_tensors.is_flat(body, j.span):
        # Nested lists and booleans: parsed as before (numpy checks the nesting).
        return _json_span_whole(body, j)
    count = math.prod(j.shape)
    if 2 * count - 1 > stop - start - 2:  # too short for that many values: allocate nothing
        n = json_tensors.value_count(body, j.span)
        raise RequestError(f"{where}: 'data' has {n} values but shape {_fmt(j.shape)} "
                           f"needs {count}")
    dt = j.datatype
    out = np.empty(count, NP_DTYPES[dt])
    try:
        yield from json_tensors.decode_flat(body, j.span, out, integers=dt not in _JSON_KINDS)
    except json_tensors.DataError as e:
        if e.why == "kind":
            expect = "numbers" if dt in _JSON_KINDS else "integers"
            raise RequestError(f"{where}: datatype {dt.value} needs {expect} in 'data'") from None
        if e.why == "count":
            raise RequestError(f"{where}: 'data' has {e.count} values but shape "
                               f"{_fmt(j.shape)} needs {count}") from None
        if e.why == "bigint" and dt in _JSON_KINDS:  # 10**30 is a fine float: as before
            return _json_span_whole(body, j)
        if e.why in ("range", "bigint"):
            info = np.iinfo(out.dtype)
            raise RequestError(f"{where}: 'data' has values outside the {dt.value} range "
                               f"[{info.min}, {info.max}]") from None
        raise RequestError(f"{where}: malformed JSON in 'data': {e}") from None
    return out.reshape(j.shape)


def parse_outputs(raw: object, spec: ModelSpec,
                  shm: ShmAccess | None = None) -> tuple[RequestedOutput, ...]:
    """The request's `outputs`; one in shared memory has its region checked now (`shm`;
    None: refused), before the request runs."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise RequestError("'outputs' must be a list")
    known = {t.name for t in spec.outputs}
    out: list[RequestedOutput] = []
    for i, o in enumerate(raw):
        if not isinstance(o, dict) or not isinstance(o.get("name"), str):
            raise RequestError(f"outputs[{i}] must be an object with a 'name'")
        name = o["name"]
        if name not in known:
            names = ", ".join(repr(n) for n in known)
            raise RequestError(f"unknown output {name!r}; model {spec.name} has outputs {names}")
        p = _params(o, f"output {name!r}")
        if p.get("classification"):
            raise RequestError(f"output {name!r}: classification is not supported")
        binary = p.get("binary_data")
        if binary is not None and not isinstance(binary, bool):
            raise RequestError(f"output {name!r}: binary_data must be true or false")
        target = None
        if "shared_memory_region" in p:
            if shm is None:
                raise _no_shm(f"output {name!r}")
            target = shm.output(p, f"output {name!r}")
        out.append(RequestedOutput(name, binary, target))
    return tuple(out)


def _tensor_json(name: str, dt: DType, arr: np.ndarray) -> dict[str, Any]:
    return {"name": name, "datatype": dt.value, "shape": list(arr.shape)}


def _json_data(arr: np.ndarray, dt: DType) -> np.ndarray:
    # orjson needs native byte order and C order; FP16 goes out as float32 (exact).
    flat = np.ascontiguousarray(arr, dtype=NP_DTYPES[dt]).reshape(-1)
    return flat.astype(np.float32) if dt == DType.FP16 else flat


def _encode(
    head: dict[str, Any], tensors: list[tuple[dict[str, Any], np.ndarray, DType, bool]]
) -> tuple[bytes, int | None]:
    """Shared by requests and responses: JSON tensors inline, binary ones appended."""
    chunks: list[bytes | memoryview] = []
    for entry, arr, dt, binary in tensors:
        if binary:
            raw = np.ascontiguousarray(arr, dtype=NP_DTYPES[dt])
            entry["parameters"] = {**entry.get("parameters", {}), "binary_data_size": raw.nbytes}
            chunks.append(raw.reshape(-1).view(np.uint8).data)
        else:
            entry["data"] = _json_data(arr, dt)
    header = orjson.dumps(head, option=_ORJSON_NUMPY)
    if not chunks:
        return header, None
    return b"".join([header, *chunks]), len(header)


def response_outputs(
    model_name: str,
    request: InferRequest,
    outputs: Mapping[str, np.ndarray],
    spec: ModelSpec,
) -> list[tuple[str, DType, np.ndarray, bool]]:
    """The outputs to answer `request` with (all of the model's when it named none), in
    order: name, datatype, array, and whether it goes out binary (its own `binary_data`,
    else the request's `binary_data_output`). A backend that returned a wrong output
    raises BackendError (500): the request was fine."""
    specs = {t.name: t for t in spec.outputs}
    wanted = request.outputs or tuple(RequestedOutput(n) for n in specs)
    out = []
    for want in wanted:
        arr = outputs.get(want.name)
        if arr is None:
            raise BackendError(f"model {model_name} returned no output {want.name!r}")
        if arr.ndim == 0 or arr.shape[0] != request.batch_size:
            raise BackendError(
                f"model {model_name} returned output {want.name!r} of shape {_fmt(arr.shape)} "
                f"for a batch of {request.batch_size}"
            )
        binary = request.binary_output if want.binary is None else want.binary
        out.append((want.name, specs[want.name].datatype, arr, binary))
    return out


def encode_response(
    model_name: str,
    request: InferRequest,
    outputs: Mapping[str, np.ndarray],
    spec: ModelSpec,
    *,
    model_version: str = "1",
) -> tuple[bytes, int | None]:
    """Encode the outputs the request asked for (`response_outputs`).

    Returns the body and the value of `Inference-Header-Content-Length` (None when no
    output is binary: the whole body is JSON).
    """
    targets = shm_targets(request)
    entries = []
    tensors = []
    for name, dt, arr, binary in response_outputs(model_name, request, outputs, spec):
        entry = _tensor_json(name, dt, arr)
        entries.append(entry)
        target = targets.get(name)
        if target is not None:  # written into its region: the answer says where
            entry["parameters"] = target.write(name, _raw(arr, dt))
        else:
            tensors.append((entry, arr, dt, binary))
    head: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if request.id is not None:
        head["id"] = request.id
    head["outputs"] = entries
    return _encode(head, tensors)


def shm_targets(request: InferRequest) -> dict[str, OutputTarget]:
    """The request's outputs that go into shared memory, by name."""
    return {o.name: o.shm for o in request.outputs if o.shm is not None}


def _raw(arr: np.ndarray, dt: DType) -> np.ndarray:
    """`arr` as its datatype's raw bytes are laid out (row-major, little-endian)."""
    return np.ascontiguousarray(arr, dtype=NP_DTYPES[dt])


# --------------------------------------------------------------------------- client side


def encode_request(
    inputs: Mapping[str, np.ndarray],
    *,
    binary: bool = True,
    outputs: Sequence[str] | None = None,
    binary_output: bool = True,
    request_id: str | None = None,
) -> tuple[bytes, int | None]:
    """Build an infer request body as tritonclient does.

    Returns the body and the `Inference-Header-Content-Length` value to send (None: send
    no such header). With `outputs`, each named output asks for `binary_output`; without,
    the request-level `binary_data_output` does.
    """
    head: dict[str, Any] = {}
    if request_id is not None:
        head["id"] = request_id
    tensors = []
    for name, arr in inputs.items():
        dt = datatype_of(arr)
        tensors.append((_tensor_json(name, dt, arr), arr, dt, binary))
    head["inputs"] = [t[0] for t in tensors]
    if outputs is not None:
        head["outputs"] = [
            {"name": n, "parameters": {"binary_data": binary_output}} for n in outputs
        ]
    else:
        head["parameters"] = {"binary_data_output": binary_output}
    return _encode(head, tensors)


def decode_response(body: bytes, header_length: int | str | None = None) -> InferResponse:
    """Parse an infer response body (client side). Raises ValueError when malformed."""
    try:
        hlen = _parse_header_length(header_length, len(body))
        view = memoryview(body)
        head = _loads(view if hlen is None else view[:hlen], "response")
        offset = hlen if hlen is not None else len(body)
        outs: dict[str, np.ndarray] = {}
        for o in head["outputs"]:
            dt = _parse_datatype(o["datatype"], f"output {o['name']!r}")
            shape = _parse_shape(o["shape"], f"output {o['name']!r}")
            size = _params(o, "output").get("binary_data_size")
            if size is not None:
                if offset + size > len(body):
                    raise RequestError(f"output {o['name']!r} runs past the end of the body")
                dtype = NP_DTYPES[dt]
                arr = np.frombuffer(body, dtype, size // dtype.itemsize, offset)
                outs[o["name"]] = arr.reshape(shape)
                offset += size
            else:
                outs[o["name"]] = _array_from_json(o["data"], dt, shape, f"output {o['name']!r}")
    except RequestError as e:
        raise ValueError(f"malformed infer response: {e.message}") from None
    except (KeyError, TypeError) as e:
        raise ValueError(f"malformed infer response: missing or bad field {e}") from None
    return InferResponse(
        head.get("model_name", ""), head.get("model_version"), head.get("id"), outs
    )
