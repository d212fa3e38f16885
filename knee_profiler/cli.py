"""`knee-profiler` (also `python -m knee_profiler.cli`): a thin layer over the library.

Subcommands: profile, show, plot, import-table. Exit status 0 on success, 1 on a profiler
error (message on stderr, no traceback), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from dstack.types import ProfileError, load_profile
from knee_profiler.knee import DEFAULT_EPSILON


def parse_numbers(text: str, kind: type = float) -> list:
    """"1,2,4" -> [1, 2, 4]; "10,20,...,100" -> 10..100 step 10 (the step from the two
    numbers before the ellipsis)."""
    parts = [t.strip() for t in text.split(",") if t.strip()]
    out: list[float] = []
    i = 0
    while i < len(parts):
        if parts[i] in ("...", ".."):
            if len(out) < 2 or i + 1 >= len(parts):
                raise argparse.ArgumentTypeError(f"{text!r}: '...' needs two numbers before "
                                                 "it and one after")
            step, end = out[-1] - out[-2], float(parts[i + 1])
            if step <= 0 or end < out[-1]:
                raise argparse.ArgumentTypeError(f"{text!r}: '...' needs an increasing range")
            while out[-1] + step <= end + 1e-9:
                out.append(round(out[-1] + step, 9))
            if abs(out[-1] - end) > 1e-9:
                raise argparse.ArgumentTypeError(f"{text!r}: {end:g} is not on the step")
            i += 2
            continue
        try:
            out.append(float(parts[i]))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: {parts[i]!r} is not a number") from None
        i += 1
    if not out:
        raise argparse.ArgumentTypeError("empty list")
    if kind is int:
        if any(v != int(v) for v in out):
            raise argparse.ArgumentTypeError(f"{text!r}: whole numbers expected")
        return [int(v) for v in out]
    return out


def _ints(text: str) -> list[int]:
    return parse_numbers(text, int)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="knee-profiler",
        description="Measure latency over batch size x slice %, find each model's knee.",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)

    pr = sub.add_parser("profile", help="sweep models over batch sizes x slice percentages")
    pr.add_argument("models", nargs="+", metavar="MODEL")
    pr.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    pr.add_argument("--mechanism", default=None,
                    help="slice mechanism (default: cpu-affinity on cpu, mps on cuda)")
    pr.add_argument("--batch-sizes", type=_ints, default=[1, 2, 4, 8])
    pr.add_argument("--percentages", type=parse_numbers, default=None,
                    help="e.g. 10,20,...,100 (default: 10..100 step 10)")
    pr.add_argument("--repeats", type=int, default=20)
    pr.add_argument("--warmup", type=int, default=5)
    pr.add_argument("--epsilon", type=float, default=DEFAULT_EPSILON)
    pr.add_argument("--out", type=Path, required=True, help="directory for <model>.json")
    pr.add_argument("--force", action="store_true", help="re-measure cells already in the file")
    pr.add_argument("--start-mps", action="store_true",
                    help="cuda: run a private MPS control daemon for the sweep")
    pr.add_argument("--seed", type=int, default=0)
    pr.add_argument("--no-progress", action="store_true")

    sh = sub.add_parser("show", help="table of p50 per batch x %% and the knees")
    sh.add_argument("files", nargs="+", type=Path, metavar="FILE")
    sh.add_argument("--epsilon", type=float, default=None, help="recompute knees at this eps")

    pl = sub.add_parser("plot", help="latency vs %% per batch (knee marked), throughput at knee")
    pl.add_argument("files", nargs="+", type=Path, metavar="FILE")
    pl.add_argument("-o", "--output", type=Path, default=Path("knee.png"))
    pl.add_argument("--epsilon", type=float, default=None)

    it = sub.add_parser("import-table", help="published latency table -> one profile per model")
    it.add_argument("table", type=Path, metavar="JSON")
    it.add_argument("--out", type=Path, required=True)
    it.add_argument("--epsilon", type=float, default=DEFAULT_EPSILON)
    return ap


def _cmd_profile(a: argparse.Namespace) -> int:
    from knee_profiler.sweep import SweepConfig, sweep

    pcts = a.percentages or [float(p) for p in range(10, 101, 10)]
    if a.device == "cpu":
        import os

        load, ncores = os.getloadavg()[0], len(os.sched_getaffinity(0))
        if load > 0.25 * ncores:
            print(f"knee-profiler: warning: load average {load:.2f} on {ncores} cores: other "
                  "work shares the cores, larger slices will look slower than they are "
                  "(the load is recorded in the profile)", file=sys.stderr)
    cfg = SweepConfig(
        models=tuple(a.models), device=a.device, batch_sizes=tuple(a.batch_sizes),
        percentages=tuple(pcts), out_dir=a.out, warmup=a.warmup, repeats=a.repeats,
        epsilon=a.epsilon, force=a.force, mechanism=a.mechanism, start_mps=a.start_mps,
        seed=a.seed,
    )
    rep = sweep(cfg, progress=not a.no_progress)
    print(f"measured {rep.measured_cells} cells in {rep.children} processes, "
          f"kept {rep.kept_cells} from existing files")
    for f in rep.failed:
        print(f"FAILED {f}", file=sys.stderr)
    for path in rep.paths.values():
        if path.exists():
            print(f"wrote {path}")
    return 1 if rep.failed else 0


def _cmd_show(a: argparse.Namespace) -> int:
    from knee_profiler.report import format_table

    for i, f in enumerate(a.files):
        if i:
            print()
        print(format_table(load_profile(f), a.epsilon))
    return 0


def _cmd_plot(a: argparse.Namespace) -> int:
    from knee_profiler.plot import plot_profiles

    out = plot_profiles([load_profile(f) for f in a.files], a.output, a.epsilon)
    print(f"wrote {out}")
    return 0


def _cmd_import(a: argparse.Namespace) -> int:
    from knee_profiler.table import import_table

    for p in import_table(a.table, a.out, epsilon=a.epsilon):
        print(f"wrote {p}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    from knee_profiler.mps import MpsError
    from knee_profiler.slices import SliceError
    from knee_profiler.sweep import ProfilerError
    from knee_profiler.table import TableError

    cmds = {"profile": _cmd_profile, "show": _cmd_show, "plot": _cmd_plot,
            "import-table": _cmd_import}
    try:
        return cmds[a.cmd](a)
    except (ProfileError, ProfilerError, SliceError, MpsError, TableError, ValueError) as e:
        print(f"knee-profiler: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `knee-profiler show ... | head`
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("knee-profiler: interrupted; measured cells are saved, re-run to resume",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
