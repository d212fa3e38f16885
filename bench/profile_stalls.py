"""What held a process's threads, stall by stall, from a py-spy timeline: `python -m
bench.profile_stalls FILE [--rate 1000] [--min-ms 8] [--top 8]`.

FILE is what `py-spy record --idle --format speedscope --rate RATE` writes: per thread, one
stack per tick in the order sampled (idle ticks included, so the n-th sample is n / RATE s
after the thread was first seen). A tick is *idle* when the innermost frame is one a thread
waits in: the event loop's own frame (`Runner.run`: uvloop waiting or in its C code) or a
worker thread's wait for work; any deeper Python frame is work. A *stall* is a run of work
ticks (gaps of one idle tick allowed) at least `--min-ms` long: the loop ran Python that
long without coming back to poll. Printed per thread: its work share, then its longest
stalls, each with when it began, how long it was, and the functions on the stack in most of
its ticks (below the frames every tick shares) and at its innermost frame.
`bench/bench_gpu_session.sh` runs it on the deciding process's profile when
`PROFILE_FORMAT=speedscope`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Innermost frames a thread waits in (not work): the event loop's, a pool thread's.
IDLE = frozenset({"Runner.run", "run_forever", "_worker", "Condition.wait", "Event.wait",
                  "Thread.join", "Queue.get", "select", "BaseSelector.select"})


@dataclass
class Stall:
    start: int  # sample index
    stacks: list[list[str]]  # the work ticks' stacks, outermost frame first

    def describe(self, rate: float, outer: frozenset[str] = frozenset(), top: int = 5) -> str:
        """`outer`: frames the thread is in while idle too (the loop's own), left out."""
        shared = _shared_prefix(self.stacks)
        inclusive: Counter[str] = Counter()
        for s in self.stacks:  # each frame once a stack, ties outermost first (not hash order)
            inclusive.update(f for f in dict.fromkeys(s[shared:]) if f not in outer)
        leaf = Counter(s[-1] for s in self.stacks)
        n = len(self.stacks)
        return (f"from {self.start / rate:8.3f} s, {1000 * n / rate:6.1f} ms: in "
                + ", ".join(f"{f} {100 * c // n}%" for f, c in inclusive.most_common(top))
                + "; innermost "
                + ", ".join(f"{f} {100 * c // n}%" for f, c in leaf.most_common(3)))


def _shared_prefix(stacks: list[list[str]]) -> int:
    k = min(len(s) for s in stacks)
    for i in range(k):
        if any(s[i] != stacks[0][i] for s in stacks):
            return i
    return max(0, k - 1)


def stalls(stacks: list[list[str]], min_ticks: int) -> list[Stall]:
    """Runs of work ticks (one idle tick between two work ticks does not end a run) of at
    least `min_ticks` work ticks, longest first."""
    out: list[Stall] = []
    run: list[list[str]] = []
    start = gap = 0
    for i, s in enumerate(stacks):
        if s and s[-1] not in IDLE:
            if not run:
                start = i
            run.append(s)
            gap = 0
            continue
        gap += 1
        if run and gap > 1:
            if len(run) >= min_ticks:
                out.append(Stall(start, run))
            run = []
    if len(run) >= min_ticks:
        out.append(Stall(start, run))
    return sorted(out, key=lambda st: -len(st.stacks))


def threads(doc: dict[str, Any]) -> list[tuple[str, list[list[str]]]]:
    """(thread name, its stacks in order: frame names, outermost first) per profile."""
    names = [f["name"] for f in doc["shared"]["frames"]]
    return [(p.get("name", "?"), [[names[i] for i in s] for s in p["samples"]])
            for p in doc["profiles"]]


def report(doc: dict[str, Any], rate: float, min_ms: float, top: int) -> str:
    out = []
    for name, stacks in threads(doc):
        if not stacks:
            continue
        work = sum(1 for s in stacks if s and s[-1] not in IDLE)
        outer = frozenset(f for s in stacks if s and s[-1] in IDLE for f in s)
        found = stalls(stacks, max(1, round(min_ms * rate / 1000)))
        out.append(f"{name}: {len(stacks)} ticks ({len(stacks) / rate:.1f} s), work "
                   f"{100 * work / len(stacks):.1f}%, {len(found)} stalls of "
                   f">= {min_ms:g} ms")
        out += [f"  {st.describe(rate, outer)}" for st in found[:top]]
    return "\n".join(out) or "no samples"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file", type=Path)
    p.add_argument("--rate", type=float, default=1000.0, help="py-spy's --rate")
    p.add_argument("--min-ms", type=float, default=8.0)
    p.add_argument("--top", type=int, default=8)
    args = p.parse_args(argv)
    try:
        doc = json.loads(args.file.read_text())
    except (OSError, ValueError) as e:
        print(f"cannot read {args.file}: {e}", file=sys.stderr)
        return 2
    print(report(doc, args.rate, args.min_ms, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
