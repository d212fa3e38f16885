"""The `dstack mig-advise` subcommand: its flags (imported by every `dstack` command, so
nothing heavy at import) and the thin command over `dstack.mig_advice`."""

from __future__ import annotations

import argparse
from collections.abc import Callable

GPUS = ("a100-40gb", "a100-80gb", "h100-80gb")


def add_mig_parser(sub: argparse._SubParsersAction,
                   func: Callable[[argparse.Namespace], int]) -> None:
    mg = sub.add_parser(
        "mig-advise", help="pick a MIG layout and each model's instance and batch from the "
        "MPS knee profiles (docs/mig.md)")
    mg.add_argument("--config", required=True, help="deployment YAML (models, SLOs, rate_rps)")
    mg.add_argument("--profiles", default=None,
                    help="profile directory (default: the config's `profiles:`)")
    # Not `choices=`: an unknown name is a one-line error (exit 2) like every other.
    mg.add_argument("--gpu", required=True, help=" | ".join(GPUS))
    mg.add_argument("--json", action="store_true", help="print the advice as JSON")
    mg.add_argument("--all-profiles", action="store_true",
                    help="also the 1g profiles with two memory slices (1g.10gb on A100-40GB, "
                    "1g.20gb on A100-80GB and H100)")
    mg.add_argument("--max-share", type=int, default=None,
                    help="at most this many models time-share one instance (default 3; 1: "
                    "one model per instance)")
    mg.add_argument("--context-mb", type=float, default=None,
                    help="memory per process beyond the profile's peak (default 512)")
    mg.set_defaults(func=func)


def mig_advise_command(args: argparse.Namespace) -> int:
    """Exit 0 with advice, 1 when some model fits no instance (the others still advised),
    2 for a bad config, GPU name or profile (raised as ConfigError / ProfileError)."""
    import json

    from dstack.common.config import ConfigError
    from dstack.mig_advice import format_report, mig_report, report_dict
    from dstack.policies.planning import load_for_planning
    from optimizer.mig import CONTEXT_MB, MAX_SHARE

    if args.gpu not in GPUS:
        raise ConfigError(f"unknown --gpu {args.gpu!r} (known: {', '.join(GPUS)})")
    share = MAX_SHARE if args.max_share is None else args.max_share
    if share < 1:
        raise ConfigError(f"--max-share must be at least 1 (got {share})")
    cfg, profiles = load_for_planning(args.config, args.profiles)
    report = mig_report(cfg, profiles, args.gpu, extra=args.all_profiles, max_share=share,
                        context_mb=CONTEXT_MB if args.context_mb is None else args.context_mb)
    if args.json:
        print(json.dumps(report_dict(report), indent=1))
    else:
        print(format_report(report))
    return 1 if report.choice.unfit else 0
