"""Per-model summary of a Locust run, cross-checked against the server's own counters.

    python -m loadtests.summary scrape --host URL --out before.prom
    python -m loadtests.summary report --csv-prefix out/loadtest/locust \\
        --outcomes out/loadtest/outcomes.json --before before.prom --after after.prom \\
        --duration 30s --out out/loadtest/summary.json

Inputs: Locust's CSV (`--csv`: `_stats.csv` for p50/p99 per model, `_failures.csv`),
the locustfile's exact outcome tally (`--outcomes-json`; Locust writes its CSV every
second and misses the last one, so counts come from the tally when there is one), and two
scrapes of the server's `/metrics` around the run.

Per model: requests; ok (answered within the SLO), SLO misses (answered late), refused
(429/503), other errors; goodput = ok / duration (rps within the SLO); SLO attainment =
ok / requests (refusals count as misses); p50 / p99 latency (Locust's, all requests); and
the cross-check: the server's success + failure delta over the run must equal the
requests Locust sent, and its refusals the ones Locust saw.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


def parse_metrics(text: str) -> Samples:
    """name -> {sorted label items: value}. Counter samples keep their family name (the
    parser would call them `<name>_total`; Triton's and ours have no suffix)."""
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            name = fam.name if s.name == fam.name + "_total" else s.name
            out.setdefault(name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def scrape(host: str) -> str:
    with urllib.request.urlopen(host.rstrip("/") + "/metrics", timeout=10) as r:
        return r.read().decode()


def per_model(samples: Samples, name: str, **match: str) -> dict[str, float]:
    """Sum of a metric's samples per model, over samples whose labels match `match`."""
    out: dict[str, float] = {}
    for labels, v in samples.get(name, {}).items():
        d = dict(labels)
        if all(d.get(k) == val for k, val in match.items()) and "model" in d:
            out[d["model"]] = out.get(d["model"], 0.0) + v
    return out


def parse_duration(text: str) -> float:
    """Locust's run-time syntax: 30, 30s, 2m, 1h30m."""
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", text)
    if not parts or "".join(a + b for a, b in parts) != text:
        raise ValueError(f"bad duration {text!r} (use e.g. 30s, 2m, 1h30m)")
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)


def read_locust_csv(prefix: str) -> tuple[dict[str, dict[str, str]], dict[str, dict[str, int]]]:
    """(stats rows by name, failures: name -> outcome -> count) from Locust's CSV."""
    with open(prefix + "_stats.csv", newline="") as f:
        stats = {r["Name"]: r for r in csv.DictReader(f) if r["Name"] != "Aggregated"}
    fails: dict[str, dict[str, int]] = {}
    path = Path(prefix + "_failures.csv")
    if path.exists():
        with path.open(newline="") as f:
            for r in csv.DictReader(f):
                err = r["Error"]
                kind = (
                    "slo_miss" if "SLO miss" in err else "refused" if "refused" in err else "error"
                )
                d = fails.setdefault(r["Name"], {})
                d[kind] = d.get(kind, 0) + int(r["Occurrences"])
    return stats, fails


def _num(x: str | None) -> float | None:
    try:
        return float(x) if x not in (None, "", "N/A") else None
    except ValueError:
        return None


def summarize(
    prefix: str,
    duration_s: float,
    outcomes: dict[str, Any] | None,
    before: Samples | None,
    after: Samples | None,
) -> dict[str, Any]:
    stats, fails = read_locust_csv(prefix)
    tally = (outcomes or {}).get("outcomes", {})
    slos = (outcomes or {}).get("slo_ms", {})
    models = sorted(set(stats) | set(tally))
    delta: dict[str, dict[str, float]] = {}
    if before is not None and after is not None:
        for key, name, match in (
            ("success", "nv_inference_request_success", {}),
            ("failure", "nv_inference_request_failure", {}),
            ("refused", "dstack_request_refused", {}),
            ("slo_met", "dstack_request_slo_met", {}),
        ):
            a, b = per_model(after, name, **match), per_model(before, name, **match)
            delta[key] = {m: a.get(m, 0.0) - b.get(m, 0.0) for m in set(a) | set(b)}
        for reason in ("rejected", "slo_refused", "unavailable"):
            a = per_model(after, "nv_inference_request_failure", reason=reason)
            b = per_model(before, "nv_inference_request_failure", reason=reason)
            delta[f"failure_{reason}"] = {m: a.get(m, 0.0) - b.get(m, 0.0) for m in a}
        models = sorted(set(models) | set(delta["success"]))
    rows: dict[str, Any] = {}
    for m in models:
        row = stats.get(m, {})
        if m in tally:
            t = tally[m]
            source = "outcomes"
        else:
            f = fails.get(m, {})
            n = int(_num(row.get("Request Count")) or 0)
            failed = int(_num(row.get("Failure Count")) or 0)
            t = {
                "ok": n - failed,
                "slo_miss": f.get("slo_miss", 0),
                "refused": f.get("refused", 0),
                "error": f.get("error", 0),
            }
            source = "csv"
        requests = sum(t.values())
        r: dict[str, Any] = {
            "slo_ms": slos.get(m),
            "requests": requests,
            "ok": t["ok"],
            "slo_miss": t["slo_miss"],
            "refused": t["refused"],
            "error": t["error"],
            "counts_add_up": t["ok"] + t["slo_miss"] + t["refused"] + t["error"] == requests,
            "goodput_rps": t["ok"] / duration_s if duration_s > 0 else 0.0,
            "offered_rps": requests / duration_s if duration_s > 0 else 0.0,
            "slo_attainment": t["ok"] / requests if requests else None,
            "p50_ms": _num(row.get("50%")),
            "p99_ms": _num(row.get("99%")),
            "counts_from": source,
        }
        if delta:
            served = delta["success"].get(m, 0.0)
            failed_srv = delta["failure"].get(m, 0.0)
            server_refused = sum(
                delta[f"failure_{x}"].get(m, 0.0)
                for x in ("rejected", "slo_refused", "unavailable")
            )
            r["server"] = {
                "success": served,
                "failure": failed_srv,
                "refused": server_refused,
                "slo_met": delta["slo_met"].get(m, 0.0),
                "requests_match": served + failed_srv == requests,
                "refused_match": server_refused == t["refused"],
                "answered_match": served == t["ok"] + t["slo_miss"],
            }
        rows[m] = r
    return {"duration_s": duration_s, "models": rows}


def table(summary: dict[str, Any]) -> str:
    head = (
        f"{'model':22s} {'SLO ms':>7s} {'reqs':>6s} {'ok':>6s} {'late':>5s} {'refused':>7s} "
        f"{'goodput':>8s} {'attain':>7s} {'p50 ms':>7s} {'p99 ms':>7s} {'server':>8s}"
    )
    lines = [head, "-" * len(head)]
    for m, r in summary["models"].items():
        srv = r.get("server")
        check = "-" if srv is None else ("match" if srv["requests_match"] else "MISMATCH")
        att = "-" if r["slo_attainment"] is None else f"{100 * r['slo_attainment']:.1f}%"
        lines.append(
            f"{m:22s} {r['slo_ms'] or 0:7g} {r['requests']:6d} {r['ok']:6d} {r['slo_miss']:5d} "
            f"{r['refused']:7d} {r['goodput_rps']:8.2f} {att:>7s} {r['p50_ms'] or 0:7g} "
            f"{r['p99_ms'] or 0:7g} {check:>8s}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="loadtests.summary",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("scrape", help="save the server's /metrics to a file")
    s.add_argument("--host", required=True)
    s.add_argument("--out", required=True)
    r = sub.add_parser("report", help="summary JSON + table from Locust's output")
    r.add_argument("--csv-prefix", required=True)
    r.add_argument("--duration", required=True, help="the run time (30s, 2m)")
    r.add_argument("--outcomes", default=None, help="the locustfile's --outcomes-json")
    r.add_argument("--before", default=None, help="/metrics scraped before the run")
    r.add_argument("--after", default=None, help="/metrics scraped after the run")
    r.add_argument("--out", required=True, help="summary JSON path")
    args = ap.parse_args(argv)
    if args.cmd == "scrape":
        Path(args.out).write_text(scrape(args.host))
        return 0
    outcomes = None
    if args.outcomes and Path(args.outcomes).exists():
        outcomes = json.loads(Path(args.outcomes).read_text())
    before = parse_metrics(Path(args.before).read_text()) if args.before else None
    after = parse_metrics(Path(args.after).read_text()) if args.after else None
    summary = summarize(args.csv_prefix, parse_duration(args.duration), outcomes, before, after)
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(table(summary))
    print(f"summary: {args.out}")
    mismatched = [
        m
        for m, r in summary["models"].items()
        if "server" in r and not r["server"]["requests_match"]
    ]
    if mismatched:
        print(
            f"request counts differ from the server's for: {', '.join(mismatched)}", file=sys.stderr
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
