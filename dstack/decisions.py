"""What a scheduling policy sees and says: a `QueueView` per model in, a `Decision` of
`Launch`es out (`dstack.policies` has the policies; the dispatcher, `dstack.runtime`, and
the simulator, `dstack.simulate.engine`, drive them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import cython

from dstack.config import PolicyName
from dstack.slices import SliceSpec
from dstack.types import Plan, Schedule

# The objects made on every decision are Cython extension types when compiled (C
# structs: a few times cheaper to make and read than Python dataclasses); frozen
# dataclasses either way.


@cython.dataclasses.dataclass(frozen=True)
@cython.cclass
class QueueView:
    """One model's state as the policy sees it."""

    model: str
    items: cython.int  # items waiting (a request may hold several)
    head_arrival: float | None  # arrival of the oldest waiting request
    head_deadline: float | None
    running: cython.bint  # its worker is running a batch


@cython.dataclasses.dataclass(frozen=True)
@cython.cclass
class Launch:
    model: str
    max_items: cython.int
    reuse: cython.bint = False  # dstack: runs in idle capacity outside its own slot


@cython.dataclasses.dataclass(frozen=True)
@cython.cclass
class Decision:
    launches: tuple = ()  # of Launch
    wake_at: float | None = None  # look again at this time even if nothing happens


@dataclass(frozen=True, slots=True)
class ModelParams:
    """What a policy knows of a served model (times in seconds)."""

    name: str
    max_batch: int
    max_queue_delay_s: float
    slo_s: float


class Policy(Protocol):
    name: PolicyName

    def slices(self) -> dict[str, SliceSpec]:
        """The slice each model's worker is started in."""
        ...

    def decide(self, now: float, queues: Mapping[str, QueueView]) -> Decision: ...

    def on_batch_done(self, model: str, n: int, compute_s: float, now: float) -> None: ...

    def plan(self) -> Plan | None: ...

    def schedule(self) -> Schedule | None: ...
