"""The measuring child: `python -m knee_profiler._measure` with a MeasureRequest on stdin.

Runs in a fresh process so that its slice (core set, MPS percentage) is fixed before torch
touches the device. Writes one message per line on stdout (see `messages`); anything the
model or libraries print goes to stderr so it cannot corrupt the protocol.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import TextIO

from knee_profiler.messages import CellResult, ChildDone, ChildError, MeasureRequest, encode
from knee_profiler.slices import cpu_name, enter_slice

DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def measure(req: MeasureRequest, out: TextIO) -> int:
    """Enter the slice, then per model: load it, time every batch size, free it. 0 on
    success. Several models share one child (one CUDA context per slice, not per model)."""
    def send(msg: CellResult | ChildDone | ChildError) -> None:
        out.write(encode(msg) + "\n")
        out.flush()

    try:
        slice_info = enter_slice(req.mechanism, req.slice_args)
        import torch

        import models

        device = "cuda" if req.device == "cuda" else "cpu"
        dtype = getattr(torch, DTYPES[req.dtype])
    except Exception as e:  # the child must always answer, never just die
        send(ChildError(f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"))
        return 1

    from knee_profiler.timing import time_batch

    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        # Under MPS the attribute reports the slice's SMs, not the device's.
        slice_units: int | None = int(props.multi_processor_count)
        name, unit_kind = props.name, "SMs"
        units_total = slice_units if req.percent >= 100 else 0
        slice_info = {**slice_info, "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
                      "tf32_cudnn": torch.backends.cudnn.allow_tf32,
                      "cudnn_benchmark": torch.backends.cudnn.benchmark}
    else:
        slice_units = len(req.slice_args.get("cores", [])) or None
        name, unit_kind, units_total = cpu_name(), "cores", 0
    weights_mb: dict[str, float] = {}
    multi = bool(req.per_model)
    for model_name, batches in req.work():
        try:
            torch.manual_seed(req.seed)
            model = models.load_model(model_name).to(device=device, dtype=dtype)
            shape = models.spec(model_name).inputs[0].shape
            weights_mb[model_name] = (
                sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20)
        except Exception as e:
            if not multi:
                send(ChildError(f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"))
                return 1
            for b in batches:
                send(CellResult(batch=b, error=f"cannot load: {type(e).__name__}: {e}",
                                model=model_name))
            continue
        for b in batches:
            try:
                t = time_batch(model, shape, b, device, req.warmup, req.repeats, req.seed,
                               method=req.timing if device == "cuda" else "eager",
                               dtype=dtype, min_time_s=req.min_time_s,
                               max_repeats=req.max_repeats or None)
            except Exception as e:  # e.g. out of memory at a big batch: report, go on
                if device == "cuda":
                    torch.cuda.empty_cache()
                send(CellResult(batch=b, error=f"{type(e).__name__}: {str(e)[:500]}",
                                model=model_name if multi else ""))
                continue
            send(CellResult(b, t.p50_ms, t.p95_ms, t.mean_ms, t.memory_mb, t.samples,
                            units=slice_units, model=model_name if multi else "",
                            method=t.method))
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    if multi:
        slice_info = {**slice_info, "weights_mb": weights_mb}
    send(ChildDone(name, units_total, unit_kind, slice_info,
                   weights_mb.get(req.model, next(iter(weights_mb.values()), 0.0)),
                   torch.__version__))
    return 0


def main() -> int:
    req = MeasureRequest.from_json(sys.stdin.read())
    # Keep stdout for the protocol: whatever else prints goes to stderr.
    proto = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr
    return measure(req, proto)


if __name__ == "__main__":
    sys.exit(main())
