"""What the server asks a runtime before it admits a request (`dstack.runtime.serving`'s
`Runtime` has these methods): whether the model is up or restarting (503), whether the
dispatch core would refuse the request now (429, counted as a refusal, without queuing:
at its header, before its body is read, and before its JSON is parsed), the read limit on
bodies being read at once, how long bodies take to come, and how long a refusal is held
before it is answered."""

from __future__ import annotations

import itertools
import math
from collections import deque
from typing import TYPE_CHECKING

from dstack.common.config import DeployConfig
from dstack.common.errors import DeadlineRefused, DStackError, Overloaded, Unavailable
from dstack.runtime.dispatch import Refusal, RefusalReason
from dstack.runtime.reading import COUNTS_S as READ_COUNTS_S
from dstack.runtime.reading import KEPT_S as READING_KEPT_S
from dstack.runtime.reading import ReadLimit
from dstack.runtime.supervisor import Supervisor

if TYPE_CHECKING:
    from collections.abc import Callable

    from dstack.common.types import ModelSpec
    from dstack.runtime.dispatch import DispatchCore
    from dstack.runtime.replanner import Replanner
    from dstack.runtime.repository import RepoEntry
    from dstack.runtime.serving import WorkerPool

#: A restart that has run past its expected time is assumed to need this share of that
#: time again (admission while restarting, `Runtime.check_admission`).
RESTART_OVERRUN = 0.1
#: The rule a request refused because its model is restarting is refused by (503).
RESTARTING = "restarting"
#: A request not admitted yet still goes through the loop this many times before it is
#: answered, each time behind what the loop has ready then (its queueing, its batch's
#: launch, the batch's end, its answer): the checks before admission count it as ready to
#: queue this many lags from now, after the rest of its body (`Runtime.body_s`). One lag
#: was tried once the body's time was measured: with the load generator on the server's
#: cores, 89.6-93.0% of accepted requests were answered within SLO at 4x, against
#: 95.7-96.0% with three (docs/decisions.md).
LAG_TURNS = 3
#: A model's bodies take the median of its last BODY_READS reads to arrive
#: (`Runtime.observe_body`): with the server and its workers on one core, mobilenet's
#: bodies took 1.3 ms at the median and 174 ms at the 99th percentile, and a running mean
#: moved with that tail (docs/decisions.md, what was tried).
BODY_READS = 31
#: ... which fades with this time constant while no body is read: bodies slow enough to
#: refuse every request at its header are never read again, and without the fading that
#: estimate held: after a window at 8x its capacity, a server refused every request at 1x.
BODY_TAU_S = 0.25

#: The refusals that are held (`Runtime.hold_s`): those for the work ahead of a model. A
#: request refused `expired` has waited already; the others do not pass with time.
HELD_RULES = frozenset({RefusalReason.WORK_AHEAD, RefusalReason.QUEUE_FULL})


def refusal_error(reason: RefusalReason, message: str, stands_s: float = 0.0,
                  hold_s: float = 0.0) -> DStackError:
    """The 429 a refusal is answered with; `reason` names the rule (in the JSON body);
    `stands_s`, how long it stands for the model's next requests (`Refusal.stands_s`);
    `hold_s`, how long the server waits before it answers (`Runtime.hold_s`)."""
    err: DStackError = (Overloaded(message) if reason is RefusalReason.QUEUE_FULL
                        else DeadlineRefused(message))
    err.rule = reason.value
    err.stands_s = stands_s
    err.hold_s = hold_s
    return err


class EarlyAdmission:
    """The checks before admission, as methods of `Runtime` (which has the state they read,
    declared below)."""

    cfg: DeployConfig
    core: DispatchCore | None
    supervisor: WorkerPool
    replanner: Replanner | None
    repo_state: dict[str, RepoEntry]
    loop_lag_s: float
    _clock: Callable[[], float]
    _closing: bool
    _ready: bool
    _restart_refused: dict[str, int]
    _event_refused: dict[str, int]

    def spec(self, model: str) -> ModelSpec:
        raise NotImplementedError

    def workers(self, model: str) -> tuple[str, ...]:
        raise NotImplementedError

    def _init_admission(self, cfg: DeployConfig) -> None:
        # Per model: how long from a request's first byte until its body had been read
        # (`observe_body`): the last BODY_READS of them; their median (which a check before
        # the body counts as still to come), their slowest tenth's least (which the read
        # limit compares with the model's SLO) and when the last was measured.
        self._body_reads: dict[str, deque[float]] = {}
        self._body_s: dict[str, tuple[float, float, float]] = {}
        # How many bodies are read at once, at most (dstack.runtime.reading).
        server = cfg.server
        # (`dstack serve` gives the number of front ends `auto` comes to; anywhere else a
        # runtime's bodies are read by one process)
        readers = server.frontends if isinstance(server.frontends, int) else 1
        self.read_limit = ReadLimit(server.max_body_reads, readers) if (
            server.max_body_reads) else None
        # The bodies being read: when each request let through with a hold was, by the
        # token `refuse_early` gave it (oldest first), until `release`.
        self._reading: dict[int, float] = {}
        self._holds = itertools.count(1)

    def check_admission(self, model: str) -> None:
        """Raise `Unavailable` (503) when a request for `model` arriving now cannot be
        queued: the server or the model is not up. While the model's worker restarts, a
        request is queued (and runs once the worker is back) when its deadline is later
        than the restart's expected end (its worker's last measured start-up time after
        it died) plus one item's estimated run; otherwise it is refused with the rule
        `restarting` and a `retry_after_s` of the time left. Counted here, logged once
        per restart (when it ends). The server calls this before reading the body."""
        self.spec(model)
        if self._closing or not self._ready or self.core is None:
            raise Unavailable("server is not ready")
        if self.repo_state and model in self.repo_state:  # being unloaded
            raise Unavailable(f"model {model} is being unloaded "
                              f"({self.repo_state[model].reason}): it takes no new requests")
        workers = self.workers(model)
        sup = self.supervisor
        for w in workers:  # loops, not any(...): asked several times for every request
            if sup.accepting(w):
                break
        else:
            raise Unavailable(f"model {model} is not ready")
        if not isinstance(sup, Supervisor):
            return
        for w in workers:
            if sup.is_ready(w):
                return
        infos = [i for i in (self.supervisor.restart_info(w) for w in workers)
                 if i.expected_ready() is not None]
        if not infos:  # starting, or a start never measured: queue it as before
            return
        now = self._clock()
        first = min(infos, key=lambda i: i.expected_ready())  # type: ignore[arg-type,return-value]
        expected_s = first.expected_s or 0.0
        ready_at = max(first.expected_ready() or now, now + RESTART_OVERRUN * expected_s)
        est = self.core.estimates.get(workers[0])
        one_s = est.refusal_s(1) if est is not None and est.trusted else 0.0
        slo_s = self.cfg.model(model).slo_ms / 1000
        if now + slo_s >= ready_at + one_s:
            return
        self._restart_refused[model] = self._restart_refused.get(model, 0) + 1
        self._event_refused[model] = self._event_refused.get(model, 0) + 1
        left = ready_at - now
        err = Unavailable(
            f"model {model} is restarting: its worker died {now - (first.died_at or now):.1f} s "
            f"ago and should be ready in about {left:.1f} s (a start takes {expected_s:.1f} s), "
            f"later than this request's deadline (SLO {slo_s * 1000:g} ms); retry after "
            f"{math.ceil(left)} s")
        err.rule = RESTARTING
        err.retry_after_s = left
        err.logged = True  # once per restart, when it ends (`_restart_ended`)
        raise err

    def refuse_early(self, model: str, since_s: float = 0.0, hold: bool = False) -> int | None:
        """Raise what a one-item request for `model`, received `since_s` ago, would be
        refused with now (`check_admission`'s 503s; the dispatch core's 429 when even one
        item would be refused: queue full, unplanned, work ahead, its deadline gone by),
        counted as such a refusal. The server asks this before reading a request's body
        (`server.early`), and again while a big body arrives: under overload a refusal then
        costs no body. Returns when the request may go on (it is admitted, or refused on
        its real size, by `infer`). `hold`: until `release(model, token)`, the request
        counts as queued (`DispatchCore.refuse_early`) and its body as being read (the
        read limit, `dstack.runtime.reading`); the token is returned.

        The request is taken as ready to queue once the rest of its body has come (the
        median of the model's recent `observe_body`s) and the loop has then got to it
        `LAG_TURNS` times: a loop short of CPU reads a 600 KB body in several turns, and
        without the body's time a check at the header let through requests that the
        check after the body refused, each body read for nothing (2,249 of 2,495 at
        2,400 rps, four times a front end's capacity; docs/decisions.md)."""
        self.check_admission(model)
        limit = self.read_limit if hold else None
        if limit is not None:
            self._check_reading(model)
        body_rest_s = max(0.0, self.body_s(model) - since_s)
        try:
            self.check_batch(model, 1, since_s, body_rest_s + LAG_TURNS * self.loop_lag_s,
                             hold=hold)
        except DStackError:
            if limit is not None:
                limit.decided(model, True)
            raise
        if limit is None:
            return None
        limit.decided(model, False)
        token = next(self._holds)
        self._reading[token] = now = self._clock()
        oldest = next(iter(self._reading))
        if self._reading[oldest] < now - READING_KEPT_S:  # never given back (a bug)
            del self._reading[oldest]
        return token

    def _check_reading(self, model: str) -> None:
        """Refuse a request for `model` at its header while as many bodies are being read
        (let through less than `reading.COUNTS_S` ago and not back) as the read limit
        allows, unless the server keeps up with the model and its SLO dwarfs its slow
        bodies' time (`ReadLimit.holds`); counted as the dispatch core's refusals are."""
        core, limit = self.core, self.read_limit
        if core is None or limit is None:
            return
        now = self._clock()
        reading = 0
        for at in reversed(self._reading.values()):
            if at < now - READ_COUNTS_S:
                break
            reading += 1
        if reading < limit.limit or not limit.holds(
                model, self.cfg.model(model).slo_ms / 1000, self.body_s(model, slow=True)):
            return
        core.count_refused(model, RefusalReason.WORK_AHEAD.value, 1)
        if self.replanner is not None:
            self.replanner.record(model, now)
        raise refusal_error(
            RefusalReason.WORK_AHEAD,
            f"model {model}: the server is reading {reading} request bodies already, as "
            f"many as it reads at once now ({limit.limit}: fewer while bodies take longer "
            f"than usual to come, at most server.max_body_reads {limit.ceiling}"
            + (f" per front end, {limit.readers} front ends" if limit.readers > 1 else "")
            + "); retry later")

    def body_s(self, model: str, slow: bool = False) -> float:
        """How long `model`'s bodies take to read, from the first byte: the median of its
        last `observe_body`s (`slow`: the least of their slowest tenth), faded by the time
        since the last (BODY_TAU_S)."""
        got = self._body_s.get(model)
        if got is None:
            return 0.0
        median, slowest_tenth, at = got
        return (slowest_tenth if slow else median) * math.exp(
            -max(0.0, self._clock() - at) / BODY_TAU_S)

    def observe_body(self, model: str, seconds: float) -> None:
        """A request for `model` had its whole body `seconds` after its first byte."""
        if self.read_limit is not None:
            self.read_limit.observe(model, seconds)
        reads = self._body_reads.setdefault(model, deque(maxlen=BODY_READS))
        reads.append(seconds)
        ordered = sorted(reads)
        self._body_s[model] = (ordered[len(ordered) // 2], ordered[len(ordered) * 9 // 10],
                               self._clock())

    def count_refused(self, model: str, rule: str, n: int) -> None:
        """`n` requests for `model` were refused by `rule` where a refusal of
        `refuse_early` stood (`DStackError.stands_s`), without asking: counted as its
        refusals are."""
        if self.core is None:
            return
        self.core.count_refused(model, rule, n)
        if self.replanner is not None:
            now = self._clock()
            for _ in range(n):
                self.replanner.record(model, now)

    def release(self, model: str, token: int | None = None) -> None:
        """A request let through by `refuse_early(model, hold=True)`, which gave it
        `token`, is back."""
        if self.core is not None:
            self.core.release(model)
        if token is not None:
            self._reading.pop(token, None)

    def check_batch(self, model: str, n: int, since_s: float = 0.0,
                    ready_s: float = 0.0, *, hold: bool = False) -> None:
        """Raise the dispatch core's refusal (429) of a request of `n` items for `model`,
        received `since_s` ago and ready to queue `ready_s` from now, counted as `infer`
        counts one, without queuing it; return when it would be admitted (`infer` then
        admits it). The server asks this once it has read a request's header and before
        it parses its JSON numbers (`server.codec`): a batch too big for the SLO or the
        queue, or a body that took its SLO to arrive, costs no parsing; and again after
        the first piece of a big JSON body, with the time the rest will take to parse."""
        core = self.core
        if core is None:
            return  # not ready: `infer` says so
        now = self._clock()
        got = core.refuse_early(model, n, now, since_s,
                                max(ready_s, LAG_TURNS * self.loop_lag_s), hold)
        if got is not None:
            if self.replanner is not None:
                self.replanner.record(model, now)  # demand: counted as `infer` counts it
            raise refusal_error(got.reason, got.message, got.stands_s, self.hold_s(model, got))

    def hold_s(self, model: str, refusal: Refusal) -> float:
        """How long a refusal of `model` for the work ahead of it (`work_ahead`,
        `queue_full`) is held before it is answered: as long as it stands
        (`Refusal.stands_s`: until the work ahead has gone down enough that a request sent
        then could be taken), and at least what one batch of one item of the model takes
        (the state admission reads changes as batches end), at most the model's SLO (an
        answer it would have waited for anyway). A client that sends again the moment it
        is refused is so paced to what the model serves, instead of sending hundreds of
        requests a second that only take the CPU its batches need (`server.hold_refusals`,
        docs/machines.md)."""
        core = self.core
        if (not self.cfg.server.hold_refusals or core is None
                or refusal.reason not in HELD_RULES):
            return 0.0
        return min(max(refusal.stands_s, core.batch_s(model)),
                   self.cfg.model(model).slo_ms / 1000)
