"""Decode time of a 1x3x224x224 FP32 infer request, binary and JSON paths.

Prints the median of many runs against the issue's targets (binary < 2 ms, JSON < 30 ms),
and the stdlib `json.loads` of the same JSON body as the baseline orjson replaced.
Run: `.venv/bin/python bench/bench_codec.py [--repeats N]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np

from dstack.common.types import DType, ModelSpec, TensorSpec
from server import codec

SHAPE = (1, 3, 224, 224)
SPEC = ModelSpec(
    "bench",
    (TensorSpec("input", DType.FP32, (-1, 3, 224, 224)),),
    (TensorSpec("output", DType.FP32, (-1, 1000)),),
    max_batch_size=64,
)


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()

    x = np.random.default_rng(0).random(SHAPE, dtype=np.float32)
    bin_body, bin_hlen = codec.encode_request({"input": x}, binary=True)
    json_body, json_hlen = codec.encode_request({"input": x}, binary=False)
    # tritonclient writes each float32 through Python's float repr: 17 digits, not 9.
    triton_body = json.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "datatype": "FP32",
                    "shape": list(SHAPE),
                    "data": x.ravel().tolist(),
                }
            ]
        }
    ).encode()
    out = {"output": np.random.default_rng(1).random((1, 1000), dtype=np.float32)}
    req = codec.decode_request(bin_body, bin_hlen, SPEC)
    json_req = codec.InferRequest(None, req.inputs, (), False, 1)

    rows = [
        (
            "decode binary",
            len(bin_body),
            2.0,
            median_ms(lambda: codec.decode_request(bin_body, bin_hlen, SPEC), args.repeats),
        ),
        (
            "decode JSON",
            len(json_body),
            30.0,
            median_ms(lambda: codec.decode_request(json_body, json_hlen, SPEC), args.repeats),
        ),
        (
            "decode JSON, tritonclient-style",
            len(triton_body),
            30.0,
            median_ms(lambda: codec.decode_request(triton_body, None, SPEC), args.repeats),
        ),
        (
            "baseline: stdlib json.loads + np.asarray",
            len(triton_body),
            None,
            median_ms(
                lambda: np.asarray(json.loads(triton_body)["inputs"][0]["data"], np.float32),
                args.repeats,
            ),
        ),
        (
            "encode request binary",
            len(bin_body),
            None,
            median_ms(lambda: codec.encode_request({"input": x}), args.repeats),
        ),
        (
            "encode request JSON",
            len(json_body),
            None,
            median_ms(lambda: codec.encode_request({"input": x}, binary=False), args.repeats),
        ),
        (
            "encode response 1x1000 binary",
            None,
            None,
            median_ms(lambda: codec.encode_response("bench", req, out, SPEC), args.repeats),
        ),
        (
            "encode response 1x1000 JSON",
            None,
            None,
            median_ms(lambda: codec.encode_response("bench", json_req, out, SPEC), args.repeats),
        ),
    ]
    print(f"1x3x224x224 FP32, median of {args.repeats} runs")
    for name, size, target, ms in rows:
        size_s = f"{size / 1e6:6.2f} MB" if size else " " * 9
        verdict = ""
        if target is not None:
            verdict = f"target < {target:g} ms: {'ok' if ms < target else 'MISSED'}"
        print(f"  {name:42s} {size_s} {ms:8.3f} ms  {verdict}")


if __name__ == "__main__":
    main()
