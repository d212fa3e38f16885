"""The gRPC codec (`server.grpc_codec`) and status mapping, without a socket: the same
validation as HTTP's codec, Triton's messages in and out."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb

from dstack.cli import build_parser
from dstack.common.config import ConfigError, parse_config
from dstack.common.errors import (
    BackendError,
    DeadlineRefused,
    ModelNotFound,
    Overloaded,
    PayloadTooLarge,
    RequestError,
    Unavailable,
)
from dstack.common.types import DType, ModelSpec, TensorSpec
from server import codec, grpc_codec
from server.grpc_server import status_code, trailing_metadata

SPEC = ModelSpec(
    "m",
    (TensorSpec("a", DType.FP32, (-1, 2)), TensorSpec("b", DType.INT8, (-1,)),
     TensorSpec("h", DType.FP16, (-1,))),
    (TensorSpec("y", DType.FP32, (-1, 2)), TensorSpec("z", DType.INT64, (-1,))),
    max_batch_size=4,
)


def _request(n: int = 2) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="m", id="r1")
    for name, dt, shape, arr in (
            ("a", "FP32", [n, 2], np.arange(2 * n, dtype=np.float32)),
            ("b", "INT8", [n], np.arange(n, dtype=np.int8)),
            ("h", "FP16", [n], np.ones(n, np.float16))):
        req.inputs.add(name=name, datatype=dt, shape=shape)
        req.raw_input_contents.append(arr.tobytes())
    return req


def _decode(req: pb.ModelInferRequest) -> codec.InferRequest:
    head = grpc_codec.parse_request(req, SPEC)
    steps = codec.decode_data(head)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


def test_raw_inputs_are_views_of_the_message_and_outputs_go_back_raw() -> None:
    req = _decode(_request())
    assert req.id == "r1" and req.batch_size == 2
    np.testing.assert_array_equal(req.inputs["a"], [[0, 1], [2, 3]])
    assert req.inputs["b"].dtype == np.int8 and not req.inputs["a"].flags.writeable
    outputs = {"y": req.inputs["a"] * 2, "z": np.array([7, 8])}
    resp = grpc_codec.encode_response("m", req, outputs, SPEC, "1")
    assert resp.id == "r1" and [o.name for o in resp.outputs] == ["y", "z"]
    assert list(resp.outputs[1].shape) == [2] and resp.outputs[1].datatype == "INT64"
    np.testing.assert_array_equal(np.frombuffer(resp.raw_output_contents[1], "<i8"), [7, 8])
    with pytest.raises(BackendError, match="returned no output 'z'"):
        grpc_codec.encode_response("m", req, {"y": outputs["y"]}, SPEC, "1")


def test_wire_bytes_read_as_protobuf_reads_them_tensors_not_copied() -> None:
    req = _request()
    req.parameters["priority"].int64_param = 2
    req.outputs.add(name="y")
    data = req.SerializeToString()
    read = grpc_codec.read_infer_request(data)
    assert read.raw is not None and not read.msg.raw_input_contents
    assert [bytes(r) for r in read.raw] == list(req.raw_input_contents)
    del req.raw_input_contents[:]
    assert read.msg == req
    head = grpc_codec.parse_request(read.msg, SPEC, None, read.raw)
    a = head.binary_inputs["a"]
    assert np.shares_memory(a, np.frombuffer(data, np.uint8)) and not a.flags.writeable
    np.testing.assert_array_equal(a, [[0, 1], [2, 3]])
    # fields in any order, raw contents between the others: protobuf's answer all the same
    parts = [pb.ModelInferRequest(raw_input_contents=[b"\x01" * 8]).SerializeToString(),
             pb.ModelInferRequest(model_name="m", id="x").SerializeToString(),
             pb.ModelInferRequest(raw_input_contents=[b"", b"\x02"]).SerializeToString()]
    read = grpc_codec.read_infer_request(b"".join(parts))
    assert read.msg.model_name == "m" and read.msg.id == "x"
    assert [bytes(r) for r in read.raw or ()] == [b"\x01" * 8, b"", b"\x02"]
    # without raw contents: the message as protobuf parsed it
    plain = grpc_codec.read_infer_request(pb.ModelInferRequest(model_name="m").SerializeToString())
    assert plain.raw is None and plain.msg.model_name == "m"
    odd = b"\x38\x01"  # raw_input_contents as a varint: an unknown field to protobuf
    assert grpc_codec.read_infer_request(odd).msg == pb.ModelInferRequest.FromString(odd)


@pytest.mark.parametrize("data", [
    _request().SerializeToString()[:-3],  # a raw tensor cut short
    b"\x3a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",  # a length past 64 bits
    b"\x0b",  # a group never closed
    b"\x00",  # field number 0
])
def test_malformed_wire_bytes_fail_as_protobuf_fails(data: bytes) -> None:
    with pytest.raises(DecodeError):
        pb.ModelInferRequest.FromString(data)
    with pytest.raises(DecodeError):
        grpc_codec.read_infer_request(data)


def test_typed_contents_are_checked_as_json_data_is() -> None:
    req = _request(1)
    del req.raw_input_contents[:]
    req.inputs[0].contents.fp32_contents.extend([1.5, 2.5])
    req.inputs[1].contents.int_contents.extend([300])
    with pytest.raises(RequestError, match="datatype FP16 has no typed contents"):
        _decode(req)
    del req.inputs[2]
    req.inputs[1].ClearField("contents")
    req.inputs[1].contents.int_contents.extend([300])
    spec = ModelSpec("m", SPEC.inputs[:2], SPEC.outputs, max_batch_size=4)
    with pytest.raises(RequestError, match="outside the INT8 range"):  # HTTP's own check
        list(codec.decode_data(grpc_codec.parse_request(req, spec)))
    req.inputs[1].contents.int_contents[0] = -3
    head = grpc_codec.parse_request(req, spec)
    steps = codec.decode_data(head)
    with pytest.raises(StopIteration) as done:
        next(steps)
    got = done.value.value
    np.testing.assert_array_equal(got.inputs["a"], [[1.5, 2.5]])
    assert got.inputs["b"].dtype == np.int8 and got.inputs["b"][0] == -3


@pytest.mark.parametrize("change, words", [
    (lambda r: r.inputs[0].shape.__setitem__(1, 3), "dimension 1 is 3, expected 2"),
    (lambda r: setattr(r.inputs[1], "datatype", "INT16"), "datatype INT16, model m expects"),
    (lambda r: setattr(r.inputs[1], "name", "c"), "unknown input 'c'"),
    (lambda r: r.inputs[0].shape.__setitem__(0, 5), "batch dimension 5 is outside 1..4"),
    (lambda r: r.inputs[1].shape.__setitem__(0, 1), "batch dimension 1, other inputs have 2"),
    (lambda r: r.raw_input_contents.__setitem__(0, b"1234"),
     "raw_input_contents[0] size 4 does not match shape [2,2] of FP32 (16 bytes)"),
    (lambda r: r.raw_input_contents.pop(), "raw_input_contents has 2 entries for 3 inputs"),
    (lambda r: r.inputs.pop(), "raw_input_contents has 3 entries for 2 inputs"),
    (lambda r: r.inputs[0].contents.fp32_contents.append(1.0),
     "has both contents.fp32_contents and raw_input_contents[0]"),
    (lambda r: r.outputs.add(name="w"), "unknown output 'w'"),
    (lambda r: (r.inputs[0].parameters["shared_memory_region"].MergeFrom(
        pb.InferParameter(string_param="region")), r.raw_input_contents.pop(0)),
     "input 'a': shared-memory tensors are not enabled on this server"),
    (lambda r: r.inputs[0].parameters["shared_memory_region"].MergeFrom(
        pb.InferParameter(string_param="region")),
     "raw_input_contents has 3 entries for 2 inputs not in shared memory"),
])
def test_bad_requests_name_what_is_wrong(change, words) -> None:  # noqa: ANN001
    req = _request()
    change(req)
    with pytest.raises(RequestError) as e:
        grpc_codec.parse_request(req, SPEC)
    assert words in e.value.message


def test_missing_input_and_no_inputs() -> None:
    req = _request()
    del req.inputs[2]
    del req.raw_input_contents[2]
    with pytest.raises(RequestError, match="missing input 'h' of model m"):
        grpc_codec.parse_request(req, SPEC)
    with pytest.raises(RequestError, match="no inputs"):
        grpc_codec.parse_request(pb.ModelInferRequest(model_name="m"), SPEC)


def test_status_codes_as_triton_maps_them() -> None:
    refused = Overloaded("queue full")
    refused.rule, refused.retry_after_s = "queue_full", 0.2
    assert status_code(refused) == grpc.StatusCode.UNAVAILABLE
    assert trailing_metadata(refused) == (("dstack-reason", "queue_full"), ("retry-after", "1"))
    assert status_code(DeadlineRefused("late")) == grpc.StatusCode.UNAVAILABLE
    assert status_code(Unavailable("not ready")) == grpc.StatusCode.UNAVAILABLE
    assert status_code(RequestError("bad")) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_code(ModelNotFound("nope")) == grpc.StatusCode.NOT_FOUND
    assert status_code(PayloadTooLarge("big")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_code(BackendError("died")) == grpc.StatusCode.INTERNAL
    assert trailing_metadata(BackendError("died")) == ()


def test_grpc_port_config_and_flag() -> None:
    models = [{"name": "tiny_cnn"}]
    assert parse_config({"models": models}).server.grpc_port == 8001
    assert parse_config({"server": {"grpc_port": 0}, "models": models}).server.grpc_port == 0
    with pytest.raises(ConfigError, match="server.grpc_port"):
        parse_config({"server": {"grpc_port": 70000}, "models": models})
    args = build_parser().parse_args(["serve", "--config", "x.yaml", "--grpc-port", "9001"])
    assert args.grpc_port == 9001
    assert build_parser().parse_args(["serve", "--config", "x.yaml"]).grpc_port is None
