"""dstack.common.heap.keep_heap: a model process stops faulting its activations in every batch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dstack.common.heap import keep_heap

# A 40 MB block, allocated, touched and freed over and over, as a forward pass does with
# its activations: prints the page faults of the last 8 rounds.
_ROUNDS = r"""
import sys
from dstack.common.heap import keep_heap
print(keep_heap())
import numpy as np
def faults():
    return int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[7])
for i in range(10):
    if i == 2:
        f0 = faults()
    a = np.ones(10_000_000, dtype=np.float32)
    del a
print(faults() - f0)
"""


def _run(env: dict[str, str]) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", _ROUNDS], capture_output=True, text=True,
                         env={**os.environ, **env}, check=True, timeout=60)
    applied, faults = out.stdout.split()
    return applied, int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc")
def test_freed_blocks_stay_mapped_for_the_next_round() -> None:
    applied, kept = _run({})
    assert applied == "True"
    assert kept < 100, f"{kept} page faults in 8 rounds of a 40 MB block"
    applied, default = _run({"DSTACK_KEEP_HEAP": "0"})
    assert applied == "False"  # the switch leaves glibc's defaults alone...
    assert default > 10 * max(kept, 1)  # ...which map the block anew every round


def test_elsewhere_it_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    assert keep_heap() is False
