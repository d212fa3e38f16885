"""dstack.common.pauses.freeze_startup_objects: after start-up, a full garbage collection
no longer walks the objects of torch, numpy and the server (150 ms here), and still frees
the cycles made later."""

from __future__ import annotations

import json
import subprocess
import sys

# In a fresh process (freezing is for the whole process): the objects a full collection
# walks before and after, and whether a cycle made afterwards is still collected.
_PROCESS = r"""
import gc, json, weakref
import torch, server.app
from dstack.common.pauses import freeze_startup_objects
gc.collect()
before = len(gc.get_objects())
frozen = freeze_startup_objects()
after = len(gc.get_objects())

class Node:
    pass
a, b = Node(), Node()
a.other, b.other = b, a
gone = weakref.ref(a)
del a, b
gc.collect()
print(json.dumps({"before": before, "after": after, "frozen": frozen,
                  "cycle_freed": gone() is None}))
"""


def test_a_full_collection_after_start_up_walks_only_what_came_after() -> None:
    out = subprocess.run([sys.executable, "-c", _PROCESS], capture_output=True, text=True,
                         check=True, timeout=120)
    got = json.loads(out.stdout)
    assert got["before"] > 100_000  # torch and the server: what a full collection walked
    assert got["frozen"] >= got["before"] - 1_000
    assert got["after"] < 1_000
    assert got["cycle_freed"]
