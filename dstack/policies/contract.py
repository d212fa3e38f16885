"""What a scheduling policy sees and says: a `QueueView` per model in, a `Decision` of
`Launch`es out (`dstack.policies.baselines` has the policies; the dispatcher,
`dstack.runtime.serving`, and the simulator, `dstack.simulate.engine`, drive them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol

import cython

from dstack.common.config import Batching, PolicyName
from dstack.common.slices import SliceSpec
from dstack.common.types import Plan, Schedule
from dstack.policies.latency import LinearLatency

# The objects made on every decision are Cython extension types when compiled (C
# structs: a few times cheaper to make and read than Python dataclasses); frozen
# dataclasses either way.


class Precedence(IntEnum):
    """Which work of a lane mate goes before a batch of a model (`Policy.lane_mates`)."""

    RUNNING = 0  # only its running batch (it waits while the model has work)
    DUE_EARLIER = 1  # its requests due before the model's (earliest deadline first)
    ALL = 2  # all of it, arriving work too (the model waits while it has any)


@cython.dataclasses.dataclass(frozen=True)
@cython.cclass
class QueueView:
    """One model's state as the policy sees it."""

    model: str
    items: cython.int  # items waiting (a request may hold several)
    head_arrival: float | None  # arrival of the oldest waiting request
    head_deadline: float | None
    running: cython.bint  # its worker is running a batch
    # Items admitted to its queue since serving began (a count that only grows): a policy
    # measures the arrival rate from it (`dstack.policies.rate_batching`).
    arrived: cython.longlong = 0


@cython.dataclasses.dataclass(frozen=True)
@cython.cclass
class Launch:
    model: str
    max_items: cython.int
    reuse: cython.bint = False  # dstack: runs in idle capacity outside its own slot
    # The worker that runs it, when not the model's own: a guest worker of the model on
    # another lane's slice (`dstack.policies.lane_policy`), taking from the model's queue.
    on: object = None  # str | None


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
    batching: Batching = Batching.WINDOW  # shared / spatial: the window or b* (rate)


class Policy(Protocol):
    """What the dispatch core (`dstack.runtime.dispatch`), the runtime, the simulator and
    the metrics use of a policy; nothing else of it is reached into. A policy is pure: it
    never reads a clock, sleeps or does I/O; `now` is passed in."""

    name: PolicyName
    #: Whether models may run batches at the same time (False: one batch on the device at
    #: a time). CPU workers whose cores overlap then wait for work asleep, not spinning.
    concurrent: bool

    def slices(self) -> dict[str, SliceSpec]:
        """The slice each model's worker is started in."""
        ...

    def decide(self, now: float, queues: Mapping[str, QueueView]) -> Decision:
        """Which models start a batch now (at most how many items each) and when to look
        again at the latest. Called after every arrival to an idle model, every batch
        end and every wake-up; a model whose view says `running` cannot start one."""
        ...

    def on_batch_done(self, model: str, n: int, compute_s: float, now: float) -> None:
        """A batch of `n` items of `model` ended at `now` after `compute_s`."""
        ...

    def use_estimates(self, estimates: Mapping[str, LinearLatency]) -> None:
        """Latency estimates in: the core owns them and refines them after every batch;
        the policy may read them in `decide` (a model may have none)."""
        ...

    def reanchor(self, now: float) -> None:
        """Serving (or a new plan) starts at `now`: a cyclic policy starts its cycle here."""
        ...

    def batch_cap(self, model: str) -> int:
        """Batch size out: the most items the policy would launch for `model` at once now
        (the core's work-ahead estimate and the metrics read it)."""
        ...

    def lane_mates(self, model: str) -> tuple[tuple[str, Precedence], ...]:
        """The models that run one batch at a time with `model` on its slice (a lane's
        other models), each with which of its work goes before a batch of `model`: the
        core's admission counts it as work ahead."""
        ...

    def unserved(self) -> Mapping[str, str]:
        """Models this policy will never launch, each with the reason (their requests are
        refused at admission as `unplanned`)."""
        ...

    def plan(self) -> Plan | None: ...

    def schedule(self) -> Schedule | None: ...
