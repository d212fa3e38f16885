"""Where a process's time went, from a py-spy profile: `python -m bench.profile_summary
FILE [--top 20]`.

FILE is what `py-spy record --format raw` writes (one line per distinct stack: its frames
from the outermost, `;`-separated, then how many samples it had), as
`bench/bench_gpu_session.sh` takes of the deciding process (`PROFILE=LABEL`). Printed: the
samples, then the functions that ran themselves most (self: the innermost frame) and the
ones that were on the stack most (inclusive: counted once per sample however deep they
recur), each with its share of the samples. Line numbers are dropped, so that a function
is one row whichever of its lines was sampled.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

_LINE = re.compile(r":\d+\)$")


def _function(frame: str) -> str:
    """'name (file.py:123)' -> 'name (file.py)'."""
    return _LINE.sub(")", frame.strip())


def summarize(lines: list[str]) -> tuple[int, Counter[str], Counter[str]]:
    """(samples, self samples by function, inclusive samples by function) of a raw
    profile's lines; a line that is not 'stack count' is skipped."""
    total, own, inclusive = 0, Counter[str](), Counter[str]()
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [_function(f) for f in stack.split(";") if f.strip()]
        if not frames:
            continue
        total += n
        own[frames[-1]] += n
        for f in set(frames):
            inclusive[f] += n
    return total, own, inclusive


def report(lines: list[str], top: int = 20) -> str:
    total, own, inclusive = summarize(lines)
    if not total:
        return "no samples"
    out = [f"{total} samples"]
    for title, counts in (("self", own), ("inclusive", inclusive)):
        out.append(f"top {top} by {title} time:")
        out += [f"  {100 * n / total:5.1f}%  {n:6d}  {f}" for f, n in counts.most_common(top)]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file", type=Path)
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args(argv)
    try:
        lines = args.file.read_text(errors="replace").splitlines()
    except OSError as e:
        print(f"cannot read {args.file}: {e.strerror}", file=sys.stderr)
        return 2
    print(report(lines, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
