"""How many request bodies a process that reads them reads at once: a limit that adapts.

A process reading request bodies (the server's own, or each front end: `server.frontends`)
reads the bodies it has let through in turns of its event loop, all at once. Where that
loop is what limits the server (a GPU host under overload, whose device is faster than one
Python process), more bodies at once make each take longer, a few of them far longer in a
burst: the requests whose headers were let through on the usual body time are then refused
after their bodies after all (slowly), or answered late. Past that point reading more
bodies at once serves none more.

So the number of bodies being read (requests let through at their header and not back,
`Runtime.refuse_early(hold=True)` to `Runtime.release`) is limited, and the limit follows
the bodies' times as TCP's congestion window follows losses (additive increase,
multiplicative decrease): each body slower than `SLOW_TIMES` its model's usual time (plus
`SLOW_PLUS_S`) cuts it by `CUT`; each other body adds one over the limit (one a limit's
worth of bodies), between `FLOOR` and the configured ceiling (`server.max_body_reads`). A
model's usual time is the least it has taken, which follows slower times by `USUAL_RISE`
of the difference per body (a client network slower since). Where bodies come as fast
with many at once (the device or the network is the bottleneck, not the reader), nothing
slows them and the limit stays at its ceiling. A request over the limit is refused at its
header (429 `work_ahead`), its body unread, by `Runtime.refuse_early`, unless the server
keeps up with its model (`RefusedShare.refusing` is false for the model's header checks)
and the model's SLO is `SLO_TIMES` what its slow bodies take now: reading one
body more at once cannot cost such a request its deadline, and refusing it would only
turn a load the server keeps up with into refusals (a model of 1 s SLO with 8 clients
sending 600 KB bodies back to back on two cores had 68% of its requests refused so).

Measured in docs/decisions.md."""

from __future__ import annotations

#: The fewest bodies each reader is let read at once.
FLOOR = 2
#: What a slow body leaves of the limit.
CUT = 0.9
#: A body is slow when it takes more than SLOW_TIMES its model's usual time + SLOW_PLUS_S.
SLOW_TIMES = 1.5
SLOW_PLUS_S = 0.0005
#: How far a model's usual time moves toward a slower body's time, per body.
USUAL_RISE = 0.001
#: A request is held to the limit while its model's SLO is less than this many times the
#: model's slow bodies' time (the least of the slowest tenth of its recent bodies): on the
#: two-core stand-in for a GPU host (SLOs of 20 and 50 ms, 600 KB bodies taking 1-15 ms
#: under overload) every request stays held to it.
SLO_TIMES = 50
#: ... or while its model's header checks are being refused (`RefusedShare.refusing`: this
#: share or more of its recent decisions were refusals, a running mean, each decision
#: weighing DECISIONS_WEIGHT: about the last 20). In the issue's CPU layout at 4x, a 250 ms
#: model let past the limit took the cores of the 60 ms model that shares them.
REFUSING_SHARE = 0.25
DECISIONS_WEIGHT = 0.05
#: A body still being read this long after its header counts no more toward the limit: a
#: slow or stalled upload waits on its client, not on the reader (and cannot keep others
#: out for longer than this).
COUNTS_S = 0.05
#: A request let through and never said to be back (a bug) is forgotten after this long.
KEPT_S = 600.0


class RefusedShare:
    """The share of refusals among recent decisions (the read limit's, per model; a front
    end's bound on a decision, `server.frontends.DecisionBound`)."""

    __slots__ = ("share",)

    def __init__(self) -> None:
        self.share = 0.0

    def decided(self, refused: bool) -> None:
        self.share += DECISIONS_WEIGHT * (refused - self.share)

    @property
    def refusing(self) -> bool:
        return self.share >= REFUSING_SHARE


class ReadLimit:
    """The limit of bodies read at once, all `readers` together (each reads its share)."""

    def __init__(self, ceiling: int, readers: int = 1) -> None:
        self.ceiling = ceiling
        self.floor = min(FLOOR, ceiling)
        self.readers = readers
        self.each = float(ceiling)  # per reader
        self._usual: dict[str, float] = {}
        self._refused: dict[str, RefusedShare] = {}  # of each model's header checks

    @property
    def limit(self) -> int:
        return int(self.each) * self.readers

    def observe(self, model: str, seconds: float) -> None:
        """A request for `model` had its whole body `seconds` after its first byte."""
        usual = self._usual.get(model)
        if usual is None or seconds < usual:
            usual = seconds
        else:
            usual += (seconds - usual) * USUAL_RISE
        self._usual[model] = usual
        if seconds > SLOW_TIMES * usual + SLOW_PLUS_S:
            self.each = max(float(self.floor), self.each * CUT)
        else:
            self.each = min(float(self.ceiling), self.each + 1.0 / self.each)

    def decided(self, model: str, refused: bool) -> None:
        """A header check of a request for `model` refused it, or let it through."""
        share = self._refused.get(model)
        if share is None:
            share = self._refused[model] = RefusedShare()
        share.decided(refused)

    def holds(self, model: str, slo_s: float, slow_body_s: float) -> bool:
        """Whether a request for `model` (of SLO `slo_s`, whose slow bodies take
        `slow_body_s`) is held to the limit."""
        share = self._refused.get(model)
        return (share is not None and share.refusing) or slo_s < SLO_TIMES * slow_body_s
