"""Does this torch offer green contexts (SM partitions in one process)? If so, time
resnet50 at a few SM counts in them. `python bench/bench_gpu_green.py`"""

from __future__ import annotations

import json

import torch

import models

out: dict[str, object] = {"torch": torch.__version__,
                          "has_green_contexts": hasattr(torch.cuda, "green_contexts")}
if out["has_green_contexts"]:
    gc = torch.cuda.green_contexts
    out["api"] = [n for n in dir(gc) if not n.startswith("_")]
    G = getattr(gc, "GreenContext", None)
    out["GreenContext_api"] = [n for n in dir(G) if not n.startswith("_")] if G else None
    try:
        model = models.load_model("resnet50").cuda()
        x = torch.randn(8, 3, 224, 224, device="cuda")
        times = {}
        for sms in (16, 32, 66, 132):
            ctx = G.create(num_sms=sms, device_id=0)
            ctx.set_context()
            with torch.inference_mode():
                for _ in range(3):
                    model(x)
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                for _ in range(10):
                    model(x)
                e.record()
                e.synchronize()
            ctx.pop_context()
            times[sms] = round(s.elapsed_time(e) / 10, 3)
        out["resnet50_b8_eager_ms_by_sms"] = times
    except Exception as ex:  # noqa: BLE001 - reported
        out["error"] = f"{type(ex).__name__}: {ex}"[:400]
print(json.dumps(out))
