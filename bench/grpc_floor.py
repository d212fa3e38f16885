"""The floor under any gRPC server written on grpcio in Python: grpcio's asyncio server, on
uvloop as `dstack serve` runs it, whose ModelInfer answers every request at once with the
same response (`--output-bytes` of zeros), reading nothing of it. `bench.bench_protocols
--grpc-floor` measures its CPU per request beside dstack's.

    python -m bench.grpc_floor --port P [--output-bytes 4000]
"""

from __future__ import annotations

import argparse

import grpc
import uvloop
from tritonclient.grpc import service_pb2 as pb


def response(output_bytes: int) -> bytes:
    resp = pb.ModelInferResponse(model_name="image", model_version="1")
    resp.outputs.add(name="output", datatype="FP32", shape=[1, output_bytes // 4])
    resp.raw_output_contents.append(bytes(output_bytes))
    return resp.SerializeToString()


async def serve(port: int, answer: bytes) -> None:
    async def infer(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return answer

    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "inference.GRPCInferenceService",
        {"ModelInfer": grpc.unary_unary_rpc_method_handler(infer)}),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--output-bytes", type=int, default=4000)
    args = p.parse_args(argv)
    uvloop.run(serve(args.port, response(args.output_bytes)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
