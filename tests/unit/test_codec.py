"""The KServe v2 wire codec, without HTTP: round trips and every malformed case."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dstack.common.errors import BackendError, RequestError
from dstack.common.types import DType, ModelSpec, TensorSpec
from server import codec

IMG = ModelSpec(
    "img",
    (TensorSpec("input", DType.FP32, (-1, 3, 4, 4)),),
    (TensorSpec("output", DType.FP32, (-1, 10)), TensorSpec("label", DType.INT64, (-1,))),
    max_batch_size=8,
)


def spec_for(dt: DType, shape: tuple[int, ...] = (-1, 2, 3)) -> ModelSpec:
    return ModelSpec("m", (TensorSpec("x", dt, shape),), (TensorSpec("y", dt, shape),), 4)


def sample(dt: DType, shape: tuple[int, ...] = (2, 2, 3)) -> np.ndarray:
    rng = np.random.default_rng(7)
    if dt == DType.BOOL:
        return rng.random(shape) > 0.5
    npd = codec.NP_DTYPES[dt]
    if npd.kind == "f":
        return (rng.standard_normal(shape) * 100).astype(npd)
    info = np.iinfo(npd)
    return rng.integers(info.min, info.max, shape, dtype=npd, endpoint=True)


def header(body: dict) -> tuple[bytes, None]:
    return json.dumps(body).encode(), None


def one_input(**fields) -> bytes:
    t = {"name": "input", "datatype": "FP32", "shape": [1, 3, 4, 4], "data": [0.5] * 48}
    t.update(fields)
    return json.dumps({"inputs": [{k: v for k, v in t.items() if v is not None}]}).encode()


def binary_body(
    arr: np.ndarray, *, size: int | None = None, extra: bytes = b""
) -> tuple[bytes, int]:
    raw = arr.tobytes()
    head = json.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "datatype": "FP32",
                    "shape": list(arr.shape),
                    "parameters": {"binary_data_size": len(raw) if size is None else size},
                }
            ]
        }
    ).encode()
    return head + raw + extra, len(head)


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dt", list(DType))
@pytest.mark.parametrize("binary_in", [True, False], ids=["bin-in", "json-in"])
@pytest.mark.parametrize("binary_out", [True, False], ids=["bin-out", "json-out"])
def test_round_trip_every_datatype(dt: DType, binary_in: bool, binary_out: bool) -> None:
    spec = spec_for(dt)
    x = sample(dt)
    body, hlen = codec.encode_request(
        {"x": x}, binary=binary_in, binary_output=binary_out, request_id="r-1"
    )
    assert (hlen is not None) == binary_in
    req = codec.decode_request(body, hlen, spec)
    got = req.inputs["x"]
    assert got.dtype == codec.NP_DTYPES[dt] and got.shape == x.shape
    np.testing.assert_array_equal(got, x)
    assert req.batch_size == 2 and req.id == "r-1" and req.binary_output == binary_out

    out_body, out_hlen = codec.encode_response("m", req, {"y": x}, spec)
    assert (out_hlen is not None) == binary_out
    resp = codec.decode_response(out_body, out_hlen)
    assert resp.model_name == "m" and resp.model_version == "1" and resp.id == "r-1"
    y = resp.outputs["y"]
    assert y.dtype == codec.NP_DTYPES[dt]
    np.testing.assert_array_equal(y, x)


def test_binary_input_is_a_zero_copy_view_of_the_body() -> None:
    x = np.arange(48, dtype=np.float32).reshape(1, 3, 4, 4)
    body, hlen = binary_body(x)
    got = codec.decode_request(body, str(hlen), IMG).inputs["input"]
    assert not got.flags.owndata and not got.flags.writeable
    np.testing.assert_array_equal(got, x)


def test_nested_json_data_of_the_right_shape_is_accepted() -> None:
    x = np.arange(96, dtype=np.float32).reshape(2, 3, 4, 4)
    body = one_input(shape=[2, 3, 4, 4], data=x.tolist())
    np.testing.assert_array_equal(codec.decode_request(body, None, IMG).inputs["input"], x)


def test_mixed_binary_and_json_inputs_in_order() -> None:
    spec = ModelSpec(
        "two",
        (TensorSpec("a", DType.INT32, (-1, 2)), TensorSpec("b", DType.FP16, (-1, 3))),
        (TensorSpec("y", DType.FP32, (-1,)),),
        4,
    )
    a = np.array([[1, 2]], np.int32)
    b = np.array([[0.5, 1.5, -2]], np.float16)
    head = json.dumps(
        {
            "inputs": [
                {"name": "b", "datatype": "FP16", "shape": [1, 3], "data": b.ravel().tolist()},
                {
                    "name": "a",
                    "datatype": "INT32",
                    "shape": [1, 2],
                    "parameters": {"binary_data_size": 8},
                },
            ]
        }
    ).encode()
    for body in (head + a.tobytes(), memoryview(bytearray(head + a.tobytes()))):
        # (a memoryview: a body in a front end's shared memory, server.link)
        req = codec.decode_request(body, len(head), spec)
        np.testing.assert_array_equal(req.inputs["a"], a)
        np.testing.assert_array_equal(req.inputs["b"], b)


def test_requested_outputs_choose_which_and_how() -> None:
    x = np.zeros((2, 3, 4, 4), np.float32)
    body, hlen = codec.encode_request({"input": x}, outputs=["label"], binary_output=False)
    req = codec.decode_request(body, hlen, IMG)
    assert req.outputs == (codec.RequestedOutput("label", False),)
    outs = {"output": np.ones((2, 10), np.float32), "label": np.array([3, 4])}
    out_body, out_hlen = codec.encode_response("img", req, outs, IMG)
    assert out_hlen is None
    doc = json.loads(out_body)
    assert [o["name"] for o in doc["outputs"]] == ["label"]
    assert doc["outputs"][0] == {"name": "label", "datatype": "INT64", "shape": [2], "data": [3, 4]}


def test_per_output_binary_flag_overrides_the_request_default() -> None:
    head = {
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 3, 4, 4], "data": [0] * 48}],
        "outputs": [
            {"name": "output", "parameters": {"binary_data": True}},
            {"name": "label"},
        ],
        "parameters": {"binary_data_output": False},
    }
    req = codec.decode_request(json.dumps(head).encode(), None, IMG)
    outs = {"output": np.full((1, 10), 2.5, np.float32), "label": np.array([7])}
    body, hlen = codec.encode_response("img", req, outs, IMG)
    assert hlen is not None
    doc = json.loads(body[:hlen])
    assert doc["outputs"][0]["parameters"] == {"binary_data_size": 40}
    assert doc["outputs"][1]["data"] == [7]
    resp = codec.decode_response(body, hlen)
    np.testing.assert_array_equal(resp.outputs["output"], outs["output"])
    np.testing.assert_array_equal(resp.outputs["label"], [7])


def test_backend_returning_a_wrong_output_is_a_server_error() -> None:
    req = codec.decode_request(one_input(), None, IMG)
    with pytest.raises(BackendError, match="no output 'label'"):
        codec.encode_response("img", req, {"output": np.zeros((1, 10), np.float32)}, IMG)
    with pytest.raises(BackendError, match="shape"):
        bad = {"output": np.zeros((3, 10), np.float32), "label": np.zeros(3, np.int64)}
        codec.encode_response("img", req, bad, IMG)


# --------------------------------------------------------------------------- malformed


def test_int_range_and_kind_are_checked_in_json() -> None:
    spec = spec_for(DType.UINT8, (-1, 2))
    body = json.dumps(
        {"inputs": [{"name": "x", "datatype": "UINT8", "shape": [1, 2], "data": [1, 300]}]}
    )
    with pytest.raises(RequestError, match=r"outside the UINT8 range \[0, 255\]"):
        codec.decode_request(body.encode(), None, spec)
    body = body.replace("300", "1.5")
    with pytest.raises(RequestError, match="UINT8 needs integers"):
        codec.decode_request(body.encode(), None, spec)
    spec = spec_for(DType.BOOL, (-1, 2))
    body = json.dumps(
        {"inputs": [{"name": "x", "datatype": "BOOL", "shape": [1, 2], "data": [1, 0]}]}
    )
    with pytest.raises(RequestError, match="BOOL needs true/false"):
        codec.decode_request(body.encode(), None, spec)


MALFORMED: list[tuple[str, bytes, int | str | None, str]] = [
    ("malformed JSON", b'{"inputs": [', None, "malformed JSON"),
    ("not an object", b"[1, 2]", None, "must be a JSON object"),
    ("missing inputs", b'{"outputs": []}', None, "no 'inputs'"),
    ("empty inputs", b'{"inputs": []}', None, "non-empty list"),
    ("input not object", b'{"inputs": [3]}', None, r"inputs\[0\] must be an object"),
    ("nameless input", b'{"inputs": [{"datatype": "FP32"}]}', None, r"inputs\[0\] has no 'name'"),
    ("unknown input", one_input(name="pixels"), None, "unknown input 'pixels'.*'input'"),
    ("bad datatype", one_input(datatype="FP8"), None, "datatype 'FP8' is not supported"),
    ("BYTES refused", one_input(datatype="BYTES"), None, "datatype 'BYTES' is not supported"),
    ("wrong datatype", one_input(datatype="FP64"), None, "has datatype FP64.*expects FP32"),
    ("shape not list", one_input(shape="1x3"), None, "'shape' must be a list"),
    ("negative dim", one_input(shape=[1, -3, 4, 4]), None, "non-negative integers"),
    ("wrong rank", one_input(shape=[3, 4, 4]), None, "has 3 dimensions.*expects 4"),
    ("batch over max", one_input(shape=[9, 3, 4, 4]), None, "batch dimension 9 is outside 1..8"),
    ("batch zero", one_input(shape=[0, 3, 4, 4], data=[]), None, "batch dimension 0"),
    ("wrong dim", one_input(shape=[1, 3, 5, 4]), None, r"dimension 2 is 5, expected 4"),
    ("data too short", one_input(data=[0.5] * 47), None, "has 47 values but shape.*needs 48"),
    ("data not list", one_input(data="abc"), None, "'data' must be a list"),
    ("data strings", one_input(data=["a"] * 48), None, "FP32 needs numbers"),
    ("ragged nested", one_input(data=[[1, 2], [3]]), None, "ragged"),
    (
        "nested wrong shape",
        one_input(data=np.zeros((1, 3, 2, 8)).tolist()),
        None,
        r"nested 'data' lists have shape \[1,3,2,8\], expected \[1,3,4,4\]",
    ),
    ("no data", one_input(data=None), None, "neither 'data' nor binary_data_size"),
    (
        "header len not int",
        one_input(),
        "abc",
        "Inference-Header-Content-Length must be an integer",
    ),
    ("header len beyond", one_input(), 10**6, "Inference-Header-Content-Length 1000000 is beyond"),
    (
        "binary without header",
        one_input(data=None, parameters={"binary_data_size": 192}),
        None,
        "no Inference-Header-Content-Length header",
    ),
    (
        "shared memory",
        one_input(parameters={"shared_memory_region": "r"}),
        None,
        "has both shared_memory_region and data",
    ),
    (
        "shared memory off",
        one_input(data=None, parameters={"shared_memory_region": "r",
                                         "shared_memory_byte_size": 192}),
        None,
        "shared-memory tensors are not enabled on this server",
    ),
]


@pytest.mark.parametrize(
    ("body", "hlen", "message"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED]
)
def test_malformed_request_names_the_problem(body: bytes, hlen, message: str) -> None:
    with pytest.raises(RequestError, match=message):
        codec.decode_request(body, hlen, IMG)


def test_binary_size_mismatches_name_the_problem() -> None:
    x = np.zeros((1, 3, 4, 4), np.float32)
    body, hlen = binary_body(x, size=100)
    with pytest.raises(RequestError, match="binary_data_size 100 does not match shape.*192 bytes"):
        codec.decode_request(body, hlen, IMG)
    body, hlen = binary_body(x)
    with pytest.raises(RequestError, match="runs past the end of the body"):
        codec.decode_request(body[:-4], hlen, IMG)
    body, hlen = binary_body(x, extra=b"junk")
    with pytest.raises(RequestError, match="4 bytes after the header.*no binary_data_size"):
        codec.decode_request(body, hlen, IMG)
    body, hlen = binary_body(x)
    with pytest.raises(RequestError, match="malformed JSON"):
        codec.decode_request(body, hlen - 1, IMG)  # header cut short
    with pytest.raises(RequestError, match="non-negative integer"):
        codec.decode_request(*binary_body(x, size=-1), IMG)


def test_both_data_and_binary_is_refused() -> None:
    body = one_input(parameters={"binary_data_size": 192})
    with pytest.raises(RequestError, match="both 'data' and binary_data_size"):
        codec.decode_request(body, len(body), IMG)


def test_missing_duplicate_and_inconsistent_inputs() -> None:
    spec = ModelSpec(
        "two",
        (TensorSpec("a", DType.FP32, (-1, 2)), TensorSpec("b", DType.FP32, (-1, 2))),
        (TensorSpec("y", DType.FP32, (-1,)),),
        4,
    )

    def t(name: str, n: int = 1) -> dict:
        return {"name": name, "datatype": "FP32", "shape": [n, 2], "data": [0.0] * 2 * n}

    cases = [
        ([t("a")], "missing input 'b'"),
        ([t("a"), t("a")], "input 'a' appears twice"),
        ([t("a", 1), t("b", 2)], "input 'b' has batch dimension 2, other inputs have 1"),
    ]
    for inputs, message in cases:
        with pytest.raises(RequestError, match=message):
            codec.decode_request(json.dumps({"inputs": inputs}).encode(), None, spec)


def test_bad_outputs_and_parameters_name_the_problem() -> None:
    base = json.loads(one_input())
    cases = [
        ({"outputs": [{"name": "logits"}]}, "unknown output 'logits'"),
        ({"outputs": "output"}, "'outputs' must be a list"),
        ({"outputs": [{"name": "output", "parameters": {"binary_data": "yes"}}]}, "binary_data"),
        (
            {"outputs": [{"name": "output", "parameters": {"classification": 3}}]},
            "classification is not supported",
        ),
        ({"parameters": {"binary_data_output": "yes"}}, "binary_data_output must be true or false"),
        ({"parameters": [1]}, "'parameters' must be an object"),
        ({"id": 5}, "'id' must be a string"),
    ]
    for extra, message in cases:
        with pytest.raises(RequestError, match=message):
            codec.decode_request(json.dumps({**base, **extra}).encode(), None, IMG)


def test_unsupported_numpy_dtype_is_refused_by_the_client_encoder() -> None:
    with pytest.raises(RequestError, match="no KServe datatype"):
        codec.encode_request({"x": np.array(["a", "b"])})


def test_malformed_response_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="malformed infer response"):
        codec.decode_response(b'{"outputs": [{"name": "y"}]}')
    head = b'{"outputs": [{"name": "y", "datatype": "FP32", "shape": [2], '
    head += b'"parameters": {"binary_data_size": 8}}]}'
    with pytest.raises(ValueError, match="runs past the end"):
        codec.decode_response(head + b"1234", len(head))


# --------------------------------------------------------------------------- big JSON data


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flat `data` arrays parsed in pieces of about 32 bytes (many pieces per tensor)."""
    from server import json_tensors

    monkeypatch.setattr(json_tensors, "CHUNK_BYTES", 32)


def whole(body: bytes, spec: ModelSpec) -> np.ndarray:
    """What the whole-body parse makes of the request (orjson + numpy): the reference."""
    t = json.loads(body)["inputs"][0]
    return codec._array_from_json(t["data"], DType(t["datatype"]), tuple(t["shape"]), "x")


@pytest.mark.usefixtures("small_pieces")
@pytest.mark.parametrize("dt", [d for d in DType if d != DType.BOOL])
def test_json_data_parsed_in_pieces_is_the_same_tensor(dt: DType) -> None:
    spec = spec_for(dt, (-1, 5, 7))
    x = sample(dt, (4, 5, 7))
    for sep in (",", ", ", " ,\n\t"):  # any JSON whitespace between the numbers
        data = sep.join(json.dumps(v) for v in x.ravel().tolist())
        body = ('{"id": "r", "inputs": [{"name": "x", "datatype": "' + dt.value
                + '", "shape": [4, 5, 7], "data" : [ ' + data + " ] }]}").encode()
        req = codec.decode_request(body, None, spec)
        assert req.batch_size == 4 and req.id == "r"
        got = req.inputs["x"]
        assert got.dtype == codec.NP_DTYPES[dt] and got.shape == (4, 5, 7)
        np.testing.assert_array_equal(got, x)
        np.testing.assert_array_equal(got, whole(body, spec))


@pytest.mark.usefixtures("small_pieces")
def test_json_numbers_of_every_form_parse_as_the_stdlib_does() -> None:
    values = [0, -0.0, 1, -17, 3.25, 1e-7, -2.5E+3, 6.02e23, 123456789, 1e-320, 10**30]
    spec = spec_for(DType.FP64, (-1, len(values)))
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP64", "shape": [1, len(values)],
                                   "data": values}]}).encode()
    got = codec.decode_request(body, None, spec).inputs["x"]
    # As Python reads them (10**30 too, which np.asarray over the parsed list refused).
    np.testing.assert_array_equal(got, np.array([[float(v) for v in values]]))


def test_header_is_known_before_the_numbers_are_parsed() -> None:
    spec = spec_for(DType.FP32, (-1, 3))
    # Not numbers at all: parse_request does not read them; decode_data refuses them.
    body = b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 3], '
    body += b'"data": [1, 2, x, 4, 5, 6]}]}'
    head = codec.parse_request(body, None, spec)
    assert head.batch_size == 2
    with pytest.raises(RequestError, match="input 'x': malformed JSON in 'data'"):
        list(codec.decode_data(head))


def test_data_not_split_safely_is_parsed_whole() -> None:
    """A body the split cannot take apart safely decodes as a whole-body parse would."""
    spec = spec_for(DType.FP32, (-1, 3))
    t = {"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1.5, 2, 3]}
    cases = [
        {"inputs": [t], "parameters": {"data": [9, 9]}},  # a `data` key that is no input's
        {"inputs": [{**t, "parameters": {"note": '"data": [7, 8, 9]'}}]},  # inside a string
        {"id": '"data":[', "inputs": [t]},
        {"inputs": [{**t, "data": [[1.5, 2, 3]]}]},  # nested
    ]
    for doc in cases:
        got = codec.decode_request(json.dumps(doc).encode(), None, spec).inputs["x"]
        np.testing.assert_array_equal(got, np.array([[1.5, 2, 3]], np.float32))


BAD_DATA: list[tuple[str, str, str, str]] = [
    # (name, datatype, data as sent, message)
    ("too few", "FP32", "1, 2, 3, 4, 5", "'data' has 5 values but shape \\[2,3\\] needs 6"),
    ("too many", "FP32", ", ".join(["1.5"] * 9), "'data' has 9 values but shape.*needs 6"),
    ("far too few", "FP32", "1", "'data' has 1 values but shape.*needs 6"),
    ("empty", "FP32", "", "'data' has 0 values"),
    ("trailing comma", "FP32", "1, 2, 3, 4, 5, 6,", "malformed JSON in 'data'"),
    ("double comma", "FP32", "1, 2, 3,, 4, 5, 6", "malformed JSON in 'data'"),
    ("NaN", "FP32", "1, 2, 3, 4, 5, NaN", "malformed JSON in 'data'"),
    ("leading zero", "FP32", "1, 2, 3, 4, 5, 06", "malformed JSON in 'data'"),
    ("bare fraction", "FP32", "1, 2, 3, 4, 5, .5", "malformed JSON in 'data'"),
    ("unclosed", "FP32", "1, 2, 3, 4, 5, 6} ", "malformed JSON"),
    ("boolean", "FP32", "1, 2, 3, 4, 5, true", "FP32 needs numbers"),
    ("null", "FP64", "null, 2, 3, 4, 5, 6", "FP64 needs numbers"),
    ("object", "FP32", "{}, 2, 3, 4, 5, 6", "FP32 needs numbers"),
    ("fraction in ints", "INT32", "1, 2, 3, 4, 5, 6.5", "INT32 needs integers"),
    ("exponent in ints", "INT64", "1, 2, 3, 4, 5, 1e3", "INT64 needs integers"),
    ("int8 range", "INT8", "1, 2, 3, 4, 5, 128", r"outside the INT8 range \[-128, 127\]"),
    ("uint8 range", "UINT8", "-1, 2, 3, 4, 5, 6", r"outside the UINT8 range \[0, 255\]"),
    ("int64 range", "INT64", "1, 2, 3, 4, 5, 9223372036854775808", "outside the INT64 range"),
    ("beyond 64 bits", "INT64", "1, 2, 3, 4, 5, " + "9" * 30, "outside the INT64 range"),
]


@pytest.mark.usefixtures("small_pieces")
@pytest.mark.parametrize(("dt", "data", "message"), [b[1:] for b in BAD_DATA],
                         ids=[b[0] for b in BAD_DATA])
def test_bad_json_data_names_the_problem(dt: str, data: str, message: str) -> None:
    spec = spec_for(DType(dt), (-1, 3))
    body = ('{"inputs": [{"name": "x", "datatype": "' + dt
            + '", "shape": [2, 3], "data": [' + data + "]}]}").encode()
    with pytest.raises(RequestError, match=message):
        codec.decode_request(body, None, spec)


def test_a_huge_shape_claim_is_refused_without_allocating_it() -> None:
    spec = spec_for(DType.FP32, (-1, -1))
    body = b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 100000000000], ' \
           b'"data": [1, 2, 3]}]}'
    with pytest.raises(RequestError, match="'data' has 3 values but shape.*needs 100000000000"):
        codec.decode_request(body, None, spec)
