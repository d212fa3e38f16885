"""A CUDA worker's forward as graph replays (dstack/runtime/graphs.py), on a real GPU
(skipped without CUDA): the same outputs as eager at every batch size, padded ones
included, whatever ran before; a forward that cannot be captured runs eager."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import models
from dstack.runtime.graphs import GraphedForward, graphed_or_eager

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]


def test_replays_answer_as_eager_at_every_size_padded_ones_too() -> None:
    torch.manual_seed(0)
    model = models.load_model("resnet18").cuda().eval()
    fwd = GraphedForward(model, [torch.zeros(40, 3, 64, 64, device="cuda")], 40)
    assert fwd.sizes == [*range(1, 33), 40]
    gen = torch.Generator(device="cuda").manual_seed(1)
    # 35 pads to 40 and 3 runs right after it: rows 3..39 of the size-3 graph's static
    # inputs are untouched, rows 3.. of the size-40 one hold the batch of 35's leftovers
    for n in (40, 35, 3, 1, 32, 17):
        x = torch.randn(n, 3, 64, 64, device="cuda", generator=gen)
        with torch.inference_mode():
            (got,) = fwd(x)
            want = model(x)
        assert got.shape == (n, 1000)
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


class HostSync(nn.Module):
    """A forward that reads a value back to the host: not capturable."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if float(x.sum()) > 0 else x


def test_a_forward_that_cannot_be_captured_runs_eager_and_says_so(
        caplog: pytest.LogCaptureFixture) -> None:
    model = HostSync()
    with caplog.at_level(logging.WARNING, "dstack.runtime.graphs"):
        fwd = graphed_or_eager(model, [torch.ones(4, 3, device="cuda")], 4, "hostsync")
    assert fwd is model
    assert "model hostsync runs eager" in caplog.text
    x = torch.ones(2, 3, device="cuda")
    torch.testing.assert_close(fwd(x), x * 2)  # the device still works after the failed capture
