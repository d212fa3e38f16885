"""Double buffering, the dispatcher's side: requests' inputs are written into the worker's
arena as they are admitted, into the half the *next* batch will use, while the current
batch computes from the other half (Zhang et al.'s overlapped upload, on shared memory).

A `Stager` per worker keeps the requests admitted to its queue, in queue order, and writes
them one after another into rows 0, 1, ... of the next half until it is full. When that
batch is launched its requests are the queue's first ones, so usually their rows are
already in place and only the rest are written; a head refused while it waited (its rows
are there, the batch's are not where it expects) means the batch's rows are written from
that point on. Then the halves swap: the requests still queued are written into the other
half at once, while the new batch computes.

Invariant: the worker computes at most one batch at a time, and only ever from the half
the last launch named; the next half is never one the worker reads. Batches alternate
halves strictly, which a CUDA worker relies on to copy the next batch's rows early
(`dstack.runtime.upload`). Staging only saves copying at launch: whatever it missed,
`launch` writes, so an error here costs speed, never a wrong row.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np

from dstack.runtime.dispatch import Ticket
from dstack.runtime.shm import HALVES, Arena

log = logging.getLogger("dstack.runtime.staging")

Inputs = dict[str, np.ndarray]


class Stager:
    """The dispatcher's view of one double-buffered worker arena (module docstring).

    `inputs_of(ticket)`: the request's input arrays. `gone(ticket)`: the request was
    answered without running (refused while queued, failed): it will be in no batch."""

    def __init__(self, arena: Arena, inputs_of: Callable[[Ticket], Inputs],
                 gone: Callable[[Ticket], bool]) -> None:
        self.arena = arena
        self.inputs_of = inputs_of
        self.gone = gone
        self.half = 0  # the half the next batch goes into
        self._pending: list[Ticket] = []  # admitted, not launched; in queue order
        self._staged = 0  # how many of `_pending` are in `half`, from row 0
        self._rows = 0  # rows they fill
        self.rows_ahead = 0  # rows written before their batch was launched (for tests)
        self.rows_at_launch = 0  # rows written at launch
        for h in range(HALVES):
            arena.set_staged_rows(h, 0)

    def add(self, ticket: Ticket) -> None:
        """A request was admitted to this worker's queue."""
        self._pending.append(ticket)
        self._guarded(self._stage_more)

    def restage(self) -> None:
        """After a launch: write the requests still queued into the new next half."""
        self._guarded(self._stage_more)

    def launch(self, tickets: Sequence[Ticket], n: int) -> tuple[int, int]:
        """Rows [0, n) of the next half get `tickets`' inputs, in order (only those not
        staged there already are written); the halves swap. Returns the batch's half and
        the first row written now (`RunBatch.fresh_from`)."""
        half = self.half
        k = row = 0
        while (k < len(tickets) and k < self._staged
               and self._pending[k] is tickets[k]):
            row += tickets[k].n
            k += 1
        fresh_from = row
        if k < len(tickets):
            dst = self.arena.inputs(n, half)
            for t in tickets[k:]:
                x = self.inputs_of(t)
                for name, a in dst.items():
                    a[row:row + t.n] = x[name]
                row += t.n
            del dst
            self.rows_at_launch += row - fresh_from
        self.rows_ahead += fresh_from
        # The other half is the next one now: the batch that used it has ended. Its count
        # starts from zero before the worker hears of this batch (a CUDA worker reads it
        # while this batch computes).
        self.half = (half + 1) % HALVES
        self.arena.set_staged_rows(self.half, 0)
        taken = {id(t) for t in tickets}
        self._pending = [t for t in self._pending if id(t) not in taken and not self.gone(t)]
        self._staged = self._rows = 0
        return half, fresh_from

    def _stage_more(self) -> None:
        cap = self.arena.layout.max_batch
        while self._staged < len(self._pending):
            t = self._pending[self._staged]
            if self.gone(t):
                del self._pending[self._staged]  # in no batch: not worth a row
                continue
            if self._rows + t.n > cap:
                return
            x = self.inputs_of(t)
            dst = self.arena.inputs(self._rows + t.n, self.half, self._rows)
            for name, a in dst.items():
                a[...] = x[name]
            del dst
            self._staged += 1
            self._rows += t.n
            self.arena.set_staged_rows(self.half, self._rows)

    def _guarded(self, step: Callable[[], None]) -> None:
        try:
            step()
        except Exception:  # noqa: BLE001 - staging only saves work: launch writes the rest
            log.exception("staging inputs for %s failed; the launch writes them",
                          self.arena.name)
            self._staged = self._rows = 0
            self.arena.set_staged_rows(self.half, 0)


__all__ = ["Stager"]
