"""dstack.common.heap: a model process stops faulting its activations in every batch
(`keep_heap`), and the server its request bodies (`steady_heap`)."""

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


# Four 600 KB bodies at once (a request's body and the buffers it is read into), freed
# together, round after round, as the server's process does: prints the page faults of
# the last 8 rounds.
_BODIES = r"""
import sys
from server.memory import steady_server_heap
print(steady_server_heap() if sys.argv[1] == "steady" else False)
def faults():
    return int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[7])
for i in range(10):
    if i == 2:
        f0 = faults()
    bodies = [b"x" * 602_112 for _ in range(4)]
    del bodies
print(faults() - f0)
"""


def _bodies(mode: str) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "DSTACK_KEEP_HEAP"}
    out = subprocess.run([sys.executable, "-c", _BODIES, mode], capture_output=True,
                         text=True, env=env, check=True, timeout=60)
    applied, faults = out.stdout.split()
    return applied, int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc")
def test_the_server_heap_keeps_request_bodies_pages_mapped() -> None:
    applied, steady = _bodies("steady")
    assert applied == "True"
    assert steady < 50, f"{steady} page faults in 8 rounds of four 600 KB bodies"
    # glibc's adaptive thresholds: the heap's top (1.2 MB past the first body) is given
    # back after each round and faulted in again in the next (4,448 faults here)
    _, adaptive = _bodies("adaptive")
    assert adaptive > 10 * max(steady, 1)
