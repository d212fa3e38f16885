"""KServe v2 / Triton gRPC wire codec: pure functions over the messages of Triton's
`grpc_service.proto`, no sockets.

`parse_request` turns a `ModelInferRequest` into the `server.codec.RequestHead` the HTTP
path makes of a body, validated by the same functions (`codec.check_input`,
`check_size`, `check_complete`, `parse_outputs`), so that both protocols take and refuse
the same requests with the same messages. `raw_input_contents` become read-only numpy
views of the message's bytes (no copy); typed `contents` are checked and converted by
`codec.decode_data`, as JSON `data` is. `encode_response` answers every output in
`raw_output_contents`, as Triton does.

The messages are the ones tritonclient ships, generated from Triton's proto
(`tritonclient.grpc.service_pb2`): the same wire format as Triton's server.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from dstack.common.errors import RequestError
from dstack.common.types import DType, ModelSpec
from server import codec

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


def _no_shm(params: Mapping[str, object], where: str) -> None:
    if any(p in params for p in SHM_PARAMS):
        raise RequestError(f"{where}: shared-memory tensors are not supported yet")


def parse_request(msg: pb.ModelInferRequest, spec: ModelSpec) -> codec.RequestHead:
    """Validate `msg` against `spec`: the request head the infer path takes
    (`server.api.ServingApi.run`). Raises RequestError naming what is wrong."""
    if "classification" in msg.parameters:
        raise RequestError("classification is not supported")
    _no_shm(msg.parameters, "request")
    if not msg.inputs:
        raise RequestError("request has no inputs")
    raw = msg.raw_input_contents
    if raw and len(raw) != len(msg.inputs):
        raise RequestError(f"raw_input_contents has {len(raw)} entries for "
                           f"{len(msg.inputs)} inputs: give one per input, in their order")
    specs = {t.name: t for t in spec.inputs}
    names: list[str] = []
    binary: dict[str, np.ndarray] = {}
    values = []
    batch: int | None = None
    for i, t in enumerate(msg.inputs):
        name, dt, shape = codec.check_input(spec, specs, i, t.name, t.datatype, list(t.shape),
                                            names, batch)
        where = f"input {name!r}"
        batch = shape[0]
        _no_shm(t.parameters, where)
        given = [f.name for f, _ in t.contents.ListFields()]
        if raw:
            if given:
                raise RequestError(f"{where} has both contents.{given[0]} and "
                                   f"raw_input_contents[{i}]: give one")
            buf = raw[i]  # once: each access of a bytes field makes a new bytes object
            count = codec.check_size(len(buf), dt, shape, where,
                                     f"raw_input_contents[{i}] size")
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
    wanted = []
    for o in msg.outputs:
        _no_shm(o.parameters, f"output {o.name!r}")
        wanted.append({"name": o.name, "parameters": {
            "classification": "classification" in o.parameters}})
    outputs = codec.parse_outputs(wanted, spec)
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
    for name, dt, arr, _ in codec.response_outputs(model_name, request, outputs, spec):
        resp.outputs.add(name=name, datatype=dt.value, shape=arr.shape)
        resp.raw_output_contents.append(
            np.ascontiguousarray(arr, dtype=codec.NP_DTYPES[dt]).tobytes())
    return resp
