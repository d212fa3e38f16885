"""A CUDA worker's forward as CUDA graphs, one per batch size (`cuda_graphs`, default on).

Why: eager PyTorch launches every kernel from Python. On the H100 of docs/gpu.md a
forward of mobilenet_v3_large or resnet50 took about 5 ms eager at any batch size from 1
to 32 (the CPU launching ~200 kernels), against 0.66 and 1.19 ms at batch 1 on a 50% MPS
slice replayed as a graph, which is how the knee profiles are timed. Served eager, a batch
took 7-8 ms against the plan's 0.7-1.2, and the plan's batches of one refused most requests
(docs/gpu.md, section 6).

How: the forward is captured once per batch size in `graph_sizes` (every size up to
`DENSE_UP_TO`, then every `STEP`-th, and the largest), largest first, all graphs sharing
one memory pool (as vLLM does: the graphs never run at the same time, and each batch's
outputs are copied out before the next replay). A batch of n is copied into the static
inputs of the smallest captured size >= n and replayed; rows n and beyond hold whatever the
last batch left there, and their outputs are dropped. That is right for models whose rows
do not interact (every inference model of the zoo: eval-mode batch norm, no cross-row
ops); a model that mixes rows must run with `cuda_graphs: false`.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger("dstack.runtime.graphs")

DENSE_UP_TO = 32  # every batch size up to this one gets its own graph
STEP = 8  # beyond it, every STEP-th size (a batch pads up by fewer than STEP rows)


def graph_sizes(max_batch: int) -> list[int]:
    """The batch sizes captured for a model of `max_batch`: all of 1..DENSE_UP_TO, then
    multiples of STEP, and `max_batch` itself."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, not {max_batch}")
    sizes = set(range(1, min(max_batch, DENSE_UP_TO) + 1))
    sizes.update(range(DENSE_UP_TO + STEP, max_batch + 1, STEP))
    sizes.add(max_batch)
    return sorted(sizes)


def padded_size(sizes: Sequence[int], n: int) -> int:
    """The smallest of `sizes` (sorted) that holds a batch of `n`."""
    i = bisect.bisect_left(sizes, n)
    if n < 1 or i == len(sizes):
        raise ValueError(f"a batch of {n} does not fit the captured sizes 1..{sizes[-1]}")
    return sizes[i]


class GraphedForward:
    """`model(*inputs)` for batches of 1..max_batch rows, as CUDA graph replays.

    `example` holds one device tensor per input with `max_batch` rows (their values are
    only used to warm up and capture). Calling it with tensors of n rows returns the
    outputs' first n rows: views of the graph's static outputs, valid until the next call.
    """

    def __init__(self, model: Callable[..., Any], example: Sequence[Any], max_batch: int) -> None:
        import torch

        self.sizes = graph_sizes(max_batch)
        self._graphs: dict[int, tuple[Any, list[Any], tuple[Any, ...]]] = {}
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        with torch.inference_mode():
            for b in reversed(self.sizes):  # largest first: the pool's blocks fit the rest
                static_in = [x[:b].clone() for x in example]
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # cuDNN picks its kernels for this shape here
                    model(*static_in)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = model(*static_in)
                outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
                self._graphs[b] = (graph, static_in, outs)
        torch.cuda.synchronize()

    def __call__(self, *xs: Any) -> tuple[Any, ...]:
        n = int(xs[0].shape[0])
        graph, static_in, outs = self._graphs[padded_size(self.sizes, n)]
        for s, x in zip(static_in, xs, strict=True):
            s[:n].copy_(x)
        graph.replay()
        return tuple(o[:n] for o in outs)


def graphed_or_eager(model: Callable[..., Any], example: Sequence[Any], max_batch: int,
                     name: str) -> Callable[..., Any]:
    """`GraphedForward` of `model`, or `model` itself (logged once, with the reason) when
    it cannot be captured: a forward with data-dependent control flow or a host sync."""
    try:
        return GraphedForward(model, example, max_batch)
    except Exception as e:  # noqa: BLE001 - any capture failure: serve eager, say why
        log.warning("model %s runs eager: its forward could not be captured as a CUDA "
                    "graph (%s: %s); set cuda_graphs: false to skip the attempt",
                    name, type(e).__name__, e)
        return model


__all__ = ["DENSE_UP_TO", "STEP", "GraphedForward", "graph_sizes", "graphed_or_eager",
           "padded_size"]
