"""Asynchronous transfer on a real GPU: does uploading the next batch while the current one
computes (pinned host buffers, a copy stream) save time? ARCHITECTURE.md, Zhang et al.

`python bench/bench_gpu_transfer.py [--model resnet50] [--batch 32] [--batches 60]`

Three loops over the same batches, each output copied back to the host:
- sync: pageable numpy -> `.to("cuda")` -> forward -> `.cpu()` (what the worker does today);
- pinned: the same from a pinned host buffer (non_blocking upload, same stream);
- overlap: two pinned buffers and a copy stream: batch i+1 is staged (host copy into a
  pinned buffer) and uploaded while batch i computes (an event orders compute after its
  upload; another frees the buffers for reuse);
- overlap_pinned_source: the same with the source itself pinned (as if the worker's
  shared-memory arena were registered with cudaHostRegister): no staging copy.
Prints ms per batch for each and the saving of overlap against sync, plus the upload and
compute times alone. fp32, eager forward (as the worker runs it).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

import models


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batches", type=int, default=60)
    a = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = models.load_model(a.model).to(dev)
    shape = (a.batch, *models.spec(a.model).inputs[0].shape[1:])
    rng = np.random.default_rng(0)
    hosts = [rng.standard_normal(shape, dtype=np.float32) for _ in range(4)]
    mb = hosts[0].nbytes / 2**20

    def timed(fn) -> float:  # noqa: ANN001
        fn(5)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(a.batches)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1000 / a.batches

    def sync(n: int) -> None:
        with torch.inference_mode():
            for i in range(n):
                x = torch.from_numpy(hosts[i % 4]).to(dev)
                model(x).cpu()

    pinned = [torch.empty(shape, dtype=torch.float32).pin_memory() for _ in range(2)]

    def pinned_same_stream(n: int) -> None:
        with torch.inference_mode():
            for i in range(n):
                buf = pinned[i % 2]
                buf.numpy()[...] = hosts[i % 4]
                model(buf.to(dev, non_blocking=True)).cpu()

    copy_stream = torch.cuda.Stream()
    compute = torch.cuda.current_stream()

    pinned_hosts = [torch.from_numpy(h).pin_memory() for h in hosts]  # arena itself pinned
    staged = True

    def overlap(n: int) -> None:
        dev_in = [torch.empty(shape, device=dev) for _ in range(2)]
        uploaded = [torch.cuda.Event() for _ in range(2)]
        consumed = [torch.cuda.Event() for _ in range(2)]
        with torch.inference_mode():
            def upload(i: int) -> None:
                k = i % 2
                consumed[k].synchronize()  # buffers k free again (batch i-2 is done)
                if staged:
                    pinned[k].numpy()[...] = hosts[i % 4]  # arena -> pinned: a host copy
                with torch.cuda.stream(copy_stream):
                    copy_stream.wait_event(consumed[k])  # device buffer k no longer read
                    src = pinned[k] if staged else pinned_hosts[i % 4]
                    dev_in[k].copy_(src, non_blocking=True)
                    uploaded[k].record(copy_stream)
            upload(0)
            for i in range(n):
                k = i % 2
                compute.wait_event(uploaded[k])
                y = model(dev_in[k])  # queued: the GPU computes while we stage the next
                consumed[k].record(compute)
                if i + 1 < n:
                    upload(i + 1)
                y.cpu()

    def upload_only(n: int) -> None:
        for i in range(n):
            torch.from_numpy(hosts[i % 4]).to(dev)

    x0 = torch.from_numpy(hosts[0]).to(dev)

    def compute_only(n: int) -> None:
        with torch.inference_mode():
            for _ in range(n):
                model(x0)

    res = {"model": a.model, "batch": a.batch, "input_mb": round(mb, 2),
           "gpu": torch.cuda.get_device_name(0)}
    for name, fn in (("sync", sync), ("pinned", pinned_same_stream), ("overlap", overlap),
                     ("upload_only_pageable", upload_only), ("compute_only", compute_only)):
        res[f"{name}_ms"] = round(min(timed(fn) for _ in range(3)), 3)
    staged = False  # noqa: F841 - read by overlap() through the closure
    res["overlap_pinned_source_ms"] = round(min(timed(overlap) for _ in range(3)), 3)
    res["overlap_saves_ms"] = round(res["sync_ms"] - res["overlap_ms"], 3)
    res["overlap_saves_pct"] = round(100 * res["overlap_saves_ms"] / res["sync_ms"], 1)
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
