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


def measure(req: MeasureRequest, out: TextIO) -> int:
    """Enter the slice, load the model, time every batch size; 0 on success."""
    def send(msg: CellResult | ChildDone | ChildError) -> None:
        out.write(encode(msg) + "\n")
        out.flush()

    try:
        slice_info = enter_slice(req.mechanism, req.slice_args)
        import torch

        import models

        torch.manual_seed(req.seed)
        device = "cuda" if req.device == "cuda" else "cpu"
        model = models.load_model(req.model).to(device)
        shape = models.spec(req.model).inputs[0].shape
        weights_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
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
    else:
        slice_units = len(req.slice_args.get("cores", [])) or None
        name, unit_kind, units_total = cpu_name(), "cores", 0
    for b in req.batch_sizes:
        try:
            t = time_batch(model, shape, b, device, req.warmup, req.repeats, req.seed)
        except Exception as e:  # e.g. out of memory at a big batch: report, go on
            if device == "cuda":
                torch.cuda.empty_cache()
            send(CellResult(batch=b, error=f"{type(e).__name__}: {str(e)[:500]}"))
            continue
        send(CellResult(b, t.p50_ms, t.p95_ms, t.mean_ms, t.memory_mb, t.samples,
                        units=slice_units))
    send(ChildDone(name, units_total, unit_kind, slice_info, weights_mb, torch.__version__))
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
