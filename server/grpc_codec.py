"""KServe v2 / Triton gRPC wire codec: pure functions over the messages of Triton's
`grpc_service.proto`, no sockets.

`parse_request` turns a `ModelInferRequest` into the `server.codec.RequestHead` the HTTP
path makes of a body, validated by the same functions (`codec.check_input`, `check_size`,
`check_complete`, `parse_outputs`), so that both protocols take and refuse the same
requests with the same messages. `raw_input_contents` become read-only numpy views of the
bytes received (no copy: `read_infer_request` cuts them out of the wire bytes before the
rest is parsed, so neither protobuf nor a field access copies them); typed `contents` are
checked and converted by `codec.decode_data`, as JSON `data` is. `encode_response` answers
every output in `raw_output_contents`, as Triton does. A tensor in shared memory
(`server.shm`) has its `shared_memory_*` parameters checked as HTTP's JSON ones are: an
input is a view of its region and has no `raw_input_contents` entry; an output is written
into its region and keeps an empty entry in `raw_output_contents`.

The messages are the ones tritonclient ships, generated from Triton's proto
(`tritonclient.grpc.service_pb2`): the same wire format as Triton's server.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from dstack.common.errors import RequestError
from dstack.common.types import DType, ModelSpec
from server import codec

if TYPE_CHECKING:
    from server.shm import ShmAccess

#: The typed `contents` field that holds each datatype's values (grpc_service.proto's
#: `InferTensorContents`). FP16 has none: it comes in `raw_input_contents` only.
CONTENTS_FIELD: dict[DType, str] = {
    DType.BOOL: "bool_contents",
    DType.UINT8: "uint_contents",
    DType.INT8: "int_contents",
    DType.INT16: "int_contents",
    DType.INT32: "int_contents",
    DType.INT64: "int64_contents",
    DType.FP32: "fp32_contents",
    DType.FP64: "fp64_contents",
}

SHM_PARAMS = ("shared_memory_region", "shared_memory_offset", "shared_memory_byte_size")

#: `ModelInferRequest.raw_input_contents`'s field number (grpc_service.proto).
RAW_INPUT_CONTENTS = 7


@dataclass(frozen=True, slots=True)
class InferMessage:
    """A `ModelInferRequest` as `read_infer_request` read it: `msg`, and its
    `raw_input_contents` as views of the bytes received (`raw`; None: they are in `msg`)."""

    msg: pb.ModelInferRequest
    raw: Sequence[memoryview] | None = None


class _Unusual(Exception):
    """Bytes the field scan leaves to protobuf's own parser (which says what is wrong)."""


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if shift > 63 or i >= len(data):
            raise _Unusual
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


def read_infer_request(data: bytes) -> InferMessage:
    """A `ModelInferRequest` from its wire bytes, its `raw_input_contents` not copied.

    protobuf copies a bytes field twice on the way to numpy: into the message when it
    parses, and into a new `bytes` at each access; for a 600 KB tensor that was a fifth of
    the gRPC path's CPU. Here the message's top-level fields are scanned (a handful), the
    `raw_input_contents` entries kept as views of `data`, and the rest (names, shapes,
    parameters: small) parsed by protobuf. Bytes the scan does not take as plain fields
    (a truncated field, a group, field 7 of another wire type) are parsed by protobuf
    whole, as before: DecodeError for malformed bytes, as `FromString` raises it."""
    parse = pb.ModelInferRequest.FromString
    view = memoryview(data)
    kept: list[tuple[int, int]] = []  # spans of the other fields, adjacent ones merged
    raw: list[memoryview] = []
    i, end = 0, len(data)
    try:
        while i < end:
            start = i
            key, i = _varint(data, i)
            wire, field = key & 7, key >> 3
            if field == 0:
                raise _Unusual
            if wire == 2:
                n, i = _varint(data, i)
                if i + n > end:
                    raise _Unusual
                if field == RAW_INPUT_CONTENTS:
                    raw.append(view[i:i + n])
                    i += n
                    continue
                i += n
            elif field == RAW_INPUT_CONTENTS:
                raise _Unusual
            elif wire == 0:
                _, i = _varint(data, i)
            elif wire in (1, 5):
                i += 8 if wire == 1 else 4
                if i > end:
                    raise _Unusual
            else:  # groups (3, 4) and wire types that do not exist
                raise _Unusual
            if kept and kept[-1][1] == start:
                kept[-1] = (kept[-1][0], i)
            else:
                kept.append((start, i))
    except _Unusual:
        return InferMessage(parse(data))
    if not raw:
        return InferMessage(parse(data))
    rest = (bytes(view[kept[0][0]:kept[0][1]]) if len(kept) == 1
            else b"".join(view[a:b] for a, b in kept))
    return InferMessage(parse(rest), raw)


def shm_params(params: Mapping[str, pb.InferParameter]) -> dict[str, Any] | None:
    """A tensor's shared-memory parameters as plain values (None: it has none), for
    `server.shm.tensor_params` to check as it checks HTTP's JSON ones."""
    if "shared_memory_region" not in params:
        return None
    out: dict[str, Any] = {}
    for k in SHM_PARAMS:
        if k in params:
            p = params[k]
            which = p.WhichOneof("parameter_choice")
            out[k] = None if which is None else getattr(p, which)
    return out


def parse_request(msg: pb.ModelInferRequest, spec: ModelSpec,
                  shm: ShmAccess | None = None,
                  raw_contents: Sequence[memoryview] | None = None) -> codec.RequestHead:
    """Validate `msg` against `spec`: the request head the infer path takes
    (`server.api.ServingApi.run`). `shm`: what the request may do with tensors in shared
    memory (`server.codec.parse_request`'s). `raw_contents`: its `raw_input_contents`
    where `read_infer_request` cut them out of `msg`. Raises RequestError naming what is
    wrong."""
    # (each field of a protobuf message read once: every read makes a new wrapper)
    request_params = msg.parameters
    if request_params:
        if "classification" in request_params:
            raise RequestError("classification is not supported")
        if any(p in request_params for p in SHM_PARAMS):
            raise RequestError("request: shared-memory parameters belong to its inputs and "
                               "outputs, not to the request")
    inputs = msg.inputs
    if not inputs:
        raise RequestError("request has no inputs")
    raw = msg.raw_input_contents if raw_contents is None else raw_contents
    # raw_input_contents holds one entry per input not in shared memory, in their order
    in_shm = [shm_params(p) if (p := t.parameters) else None for t in inputs]
    wanted = sum(p is None for p in in_shm)
    if raw and len(raw) != wanted:
        raise RequestError(f"raw_input_contents has {len(raw)} entries for "
                           f"{wanted} inputs not in shared memory: give one per input, "
                           "in their order")
    k = 0
    specs = {t.name: t for t in spec.inputs}
    names: list[str] = []
    binary: dict[str, np.ndarray] = {}
    values = []
    batch: int | None = None
    for i, t in enumerate(inputs):
        name, dt, shape = codec.check_input(spec, specs, i, t.name, t.datatype, list(t.shape),
                                            names, batch)
        where = f"input {name!r}"
        batch = shape[0]
        given = [f.name for f, _ in t.contents.ListFields()] if t.HasField("contents") else []
        params = in_shm[i]
        if params is not None:
            if given:
                raise RequestError(f"{where} has both contents.{given[0]} and "
                                   "shared_memory_region: give one")
            if shm is None:
                raise codec._no_shm(where)
            binary[name] = shm.input(params, dt, shape, where)
        elif raw:
            if given:
                raise RequestError(f"{where} has both contents.{given[0]} and "
                                   f"raw_input_contents[{k}]: give one")
            buf = raw[k]  # once: each access of a bytes field makes a new bytes object
            count = codec.check_size(len(buf), dt, shape, where,
                                     f"raw_input_contents[{k}] size")
            k += 1
            binary[name] = np.frombuffer(buf, codec.NP_DTYPES[dt], count).reshape(shape)
        else:
            field = CONTENTS_FIELD.get(dt)
            if field is None:
                raise RequestError(f"{where}: datatype {dt.value} has no typed contents: "
                                   "send it in raw_input_contents")
            if given and given != [field]:
                raise RequestError(f"{where}: datatype {dt.value} takes its values in "
                                   f"contents.{field}, not {', '.join(given)}")
            got = getattr(t.contents, field)
            count = math.prod(shape)
            if len(got) != count:
                raise RequestError(f"{where}: contents.{field} has {len(got)} values but "
                                   f"shape [{','.join(map(str, shape))}] needs {count}")
            values.append(codec.values_input(name, dt, shape, list(got)))
        names.append(name)
    codec.check_complete(spec, names)
    asked = []
    for o in msg.outputs:
        params = o.parameters
        asked.append({"name": o.name, "parameters": {
            "classification": "classification" in params,
            **(shm_params(params) or {})} if params else {"classification": False}})
    outputs = codec.parse_outputs(asked, spec, shm)
    assert batch is not None
    return codec.RequestHead(msg.id or None, outputs, True, batch, b"", tuple(names), binary,
                             tuple(values))


def encode_response(model_name: str, request: codec.InferRequest,
                    outputs: Mapping[str, np.ndarray], spec: ModelSpec,
                    model_version: str) -> pb.ModelInferResponse:
    """The answer to `request`: the outputs it asked for (`codec.response_outputs`: all
    the model's when it named none; BackendError for a wrong one), each in
    `raw_output_contents`, row-major little-endian."""
    resp = pb.ModelInferResponse(model_name=model_name, model_version=model_version,
                                 id=request.id or "")
    targets = codec.shm_targets(request)
    for name, dt, arr, _ in codec.response_outputs(model_name, request, outputs, spec):
        out = resp.outputs.add(name=name, datatype=dt.value, shape=arr.shape)
        data = np.ascontiguousarray(arr, dtype=codec.NP_DTYPES[dt])
        target = targets.get(name)
        if target is None:
            resp.raw_output_contents.append(data.tobytes())
            continue
        # In its region; an empty raw_output_contents entry keeps the others' places, as
        # Triton's server leaves one (tritonclient finds an output's by its index).
        for key, value in target.write(name, data).items():
            if isinstance(value, str):
                out.parameters[key].string_param = value
            else:
                out.parameters[key].int64_param = value
        resp.raw_output_contents.append(b"")
    return resp
