"""`knee-profiler` (also `python -m knee_profiler.cli`): a thin layer over the library.

Subcommands: profile, show, plot, import-table, trace (CUDA kernel tables), analytic.
Exit status 0 on success, 1 on a profiler error (message on stderr, no traceback), 2 on bad
arguments.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from dstack.common.types import ProfileError, load_profile
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
    pr.add_argument("--timing", choices=("graph", "eager"), default="graph",
                    help="cuda: time CUDA-graph replays (default; eager when capture fails) "
                    "or eager forwards")
    pr.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default="fp32")
    pr.add_argument("--min-time", type=float, default=0.2, metavar="S",
                    help="graph timing: take more replays until they span S seconds")
    pr.add_argument("--max-repeats", type=int, default=200)
    pr.add_argument("--no-progress", action="store_true")

    sh = sub.add_parser("show", help="table of p50 per batch x %% and the knees")
    sh.add_argument("files", nargs="+", type=Path, metavar="FILE")
    sh.add_argument("--epsilon", type=float, default=None, help="recompute knees at this eps")

    pl = sub.add_parser("plot", help="latency vs %% per batch (knee marked), throughput at knee")
    pl.add_argument("files", nargs="+", type=Path, metavar="FILE")
    pl.add_argument("-o", "--output", type=Path, default=Path("knee.png"))
    pl.add_argument("--epsilon", type=float, default=None)

    tr = sub.add_parser("trace", help="cuda: kernel tables (grid, block, registers, smem, "
                        "duration) of one forward at 100%%, for `analytic`")
    tr.add_argument("models", nargs="+", metavar="MODEL")
    tr.add_argument("--batch-sizes", type=_ints, default=[1, 2, 4, 8, 16, 32, 64])
    tr.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default="fp32")
    tr.add_argument("--out", type=Path, required=True, help="directory for <model>.json")

    an = sub.add_parser("analytic", help="predict latency vs %% and the knee from a kernel "
                        "table (no sweep); compare with a measured profile if there is one")
    an.add_argument("models", nargs="+", metavar="MODEL")
    an.add_argument("--traces", type=Path, required=True, help="directory of kernel tables")
    an.add_argument("--batch-sizes", type=_ints, default=None, help="default: all traced")
    an.add_argument("--percentages", type=parse_numbers, default=None)
    an.add_argument("--epsilon", type=float, default=DEFAULT_EPSILON)
    an.add_argument("--profiles", type=Path, default=None,
                    help="directory of measured profiles: use their %%->SM map and compare")
    an.add_argument("--curves", action="store_true", help="print the predicted curves too")

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
        seed=a.seed, timing=a.timing, dtype=a.dtype, min_time_s=a.min_time,
        max_repeats=a.max_repeats,
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


def _cmd_trace(a: argparse.Namespace) -> int:
    from knee_profiler.analytic import capture

    cmd = "knee-profiler " + " ".join(sys.argv[1:]) if sys.argv else ""
    for p in capture(a.models, a.batch_sizes, a.out, dtype=a.dtype, command=cmd):
        print(f"wrote {p}")
    return 0


def _cmd_analytic(a: argparse.Namespace) -> int:
    from knee_profiler.analytic import estimate, load_table, units_from_profile

    pcts = a.percentages or [float(p) for p in range(10, 101, 10)]
    for i, name in enumerate(a.models):
        table = load_table(a.traces / f"{name}.json")
        measured = None
        if a.profiles is not None and (a.profiles / f"{name}.json").exists():
            measured = load_profile(a.profiles / f"{name}.json")
        sms_for = units_from_profile(measured) if measured else None
        if i:
            print()
        print(f"{name} on {table.device_name} ({table.limits.sms} SMs): analytic knee at "
              f"eps={a.epsilon:g}" + (" vs measured" if measured else ""))
        print(f"{'batch':>6} {'kernels':>8} {'pred@100':>9} {'meas@100':>9} "
              f"{'pred knee%':>10} {'meas knee%':>10}")
        for b in a.batch_sizes or sorted(table.batches):
            if b not in table.batches:
                print(f"{b:>6} (not traced)")
                continue
            est = estimate(table.batches[b], table.limits, pcts, b,
                           gap_ms=table.gap_ms(b), epsilon=a.epsilon, sms_for=sms_for)
            mk, m100 = "-", "-"
            if measured is not None and b in measured.batch_sizes:
                from knee_profiler.knee import knee as _knee
                from knee_profiler.report import curves

                c = curves(measured)[b]
                mk, m100 = f"{_knee(c, a.epsilon):g}", f"{c[100.0]:.3f}"
            print(f"{b:>6} {est.kernels:>8} {est.curve[100.0]:>9.3f} {m100:>9} "
                  f"{est.knee:>10g} {mk:>10}")
            if a.curves:
                print("       pred ms: " + " ".join(f"{p:g}%={v:.3f}"
                                                    for p, v in est.curve.items()))
    return 0


def _cmd_import(a: argparse.Namespace) -> int:
    from knee_profiler.table import import_table

    for p in import_table(a.table, a.out, epsilon=a.epsilon):
        print(f"wrote {p}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    from knee_profiler.analytic import KernelTableError
    from knee_profiler.mps import MpsError
    from knee_profiler.slices import SliceError
    from knee_profiler.sweep import ProfilerError
    from knee_profiler.table import TableError

    cmds = {"profile": _cmd_profile, "show": _cmd_show, "plot": _cmd_plot,
            "import-table": _cmd_import, "trace": _cmd_trace, "analytic": _cmd_analytic}
    try:
        return cmds[a.cmd](a)
    except (ProfileError, ProfilerError, SliceError, MpsError, TableError, KernelTableError,
            ValueError) as e:
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
