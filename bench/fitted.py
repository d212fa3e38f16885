"""Configs fitted to the machine they run on (`fitted_config`; docs/machines.md).

`machine_factor`: how much slower this machine runs a config's models than its CPU
profiles say: the median over the models of `model_factors` (one item on one core, in a
fresh process, warm-up excluded), at least 1; `DSTACK_MACHINE_FACTOR` sets it instead.
The fitted config has every `slo_ms` and `max_queue_delay_ms` times that factor, every
`rate_rps` divided.
`python -m bench.fitted CONFIG` prints the factor and the fitted config.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import yaml

REPEATS, WARMUP = 7, 3  # timed forwards of one item per model, after WARMUP untimed ones

_MEASURE = """
import json, os, sys, time
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
import torch
torch.set_num_threads(1)
import models
warmup, repeats = int(sys.argv[1]), int(sys.argv[2])
batches = [int(b) for b in sys.argv[3].split(",")]
out = {}
for name in sys.argv[4:]:
    m = models.load_model(name)
    out[name] = {}
    for b in batches:
        x = torch.rand((b, *models.spec(name).inputs[0].shape[1:]))
        times = []
        with torch.inference_mode():
            for i in range(warmup + repeats):
                t0 = time.perf_counter()
                m(x)
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
        times.sort()
        out[name][b] = 1000 * times[len(times) // 2]
print(json.dumps(out))
"""


def one_core_ms(zoo_names: tuple[str, ...], batches: tuple[int, ...] = (1,)
                ) -> dict[str, dict[int, float]]:
    """The median time (ms) of a batch of each size through each model, on one core with
    one thread, in a fresh process."""
    root = Path(__file__).resolve().parents[1]
    got = subprocess.run([sys.executable, "-c", _MEASURE, str(WARMUP), str(REPEATS),
                          ",".join(map(str, batches)),
                          *zoo_names], cwd=root, capture_output=True, text=True, timeout=900,
                         check=False)
    if got.returncode != 0:
        raise RuntimeError(f"measuring {', '.join(zoo_names)} failed: {got.stderr[-2000:]}")
    raw = json.loads(got.stdout.strip().splitlines()[-1])
    return {m: {int(b): float(ms) for b, ms in v.items()} for m, v in raw.items()}


def one_core_capacity(model_slos: dict[str, float], max_batch: int = 8) -> dict[str, float]:
    """Items per second each model serves within its SLO (ms) on one core, in-process:
    the best b / L(b) over batch sizes up to `max_batch` whose L(b) is at most half the
    SLO (a request may wait for the batch before its own)."""
    batches = tuple(b for b in (1, 2, 4, 8, 16, 32) if b <= max_batch)
    times = one_core_ms(tuple(model_slos), batches)
    return {m: max((1000 * b / ms for b, ms in times[m].items() if ms <= slo / 2),
                   default=0.0) for m, slo in model_slos.items()}


def profile_one_core_ms(profiles_dir: Path, model: str) -> float | None:
    """The profile's p50 (ms) of one item on one core (its smallest slice), if it has one."""
    path = profiles_dir / f"{model}.json"
    if not path.is_file():
        return None
    prof = json.loads(path.read_text())
    cells = [c for c in prof["cells"] if c["batch"] == 1 and c.get("units", 1) == 1]
    return min(c["p50_ms"] for c in cells) if cells else None


@cache
def model_factors(profiles_dir: Path, zoo_names: tuple[str, ...]) -> dict[str, float]:
    """How many times slower this machine runs each model (one item, one core) than
    `profiles_dir` says; `DSTACK_MACHINE_FACTOR` gives every model that factor instead."""
    given = os.environ.get("DSTACK_MACHINE_FACTOR")
    if given:
        return dict.fromkeys(zoo_names, float(given))
    measured = {m: v[1] for m, v in one_core_ms(zoo_names).items()}
    return {m: measured[m] / ref for m in zoo_names
            if (ref := profile_one_core_ms(profiles_dir, m)) is not None}


def machine_factor(profiles_dir: Path, zoo_names: tuple[str, ...]) -> float:
    """The median of the models' factors (at least 1): one factor keeps the mix's balance
    of SLOs and rates as written."""
    ratios = list(model_factors(profiles_dir, zoo_names).values())
    return max(1.0, statistics.median(ratios)) if ratios else 1.0


def fit(raw: dict[str, Any], factor: float) -> dict[str, Any]:
    """A config's mapping with its SLOs and queue delays times `factor`, rates divided."""
    out = dict(raw)
    models = []
    for m in raw["models"]:
        m = dict(m)
        for key in ("slo_ms", "max_queue_delay_ms"):
            if key in m:
                m[key] = round(float(m[key]) * factor, 3)
        if "rate_rps" in m:
            m["rate_rps"] = round(float(m["rate_rps"]) / factor, 3)
        models.append(m)
    out["models"] = models
    return out


def fitted_config(config: Path, out_dir: Path) -> tuple[Path, float]:
    """`config` fitted to this machine, written into `out_dir` (paths made absolute), and
    the factor; a config without CPU profiles as it is, factor 1."""
    raw = yaml.safe_load(config.read_text())
    profiles = raw.get("profiles")
    if raw.get("device", "cpu") != "cpu" or not profiles or profiles == "auto":
        return config, 1.0
    profiles_dir = (config.parent / profiles).resolve()
    raw["profiles"] = str(profiles_dir)
    zoo = tuple(sorted({m.get("zoo_name") or m["name"] for m in raw["models"]}))
    factor = machine_factor(profiles_dir, zoo)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{config.stem}-fitted.yaml"
    path.write_text(f"# {config.name} fitted to this machine: x{factor:.2f} (bench/fitted.py)\n"
                    + yaml.safe_dump(fit(raw, factor), sort_keys=False))
    return path, factor


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.fitted", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", type=Path)
    ap.add_argument("--out", type=Path, default=Path("out/fitted"))
    args = ap.parse_args(argv)
    path, factor = fitted_config(args.config, args.out)
    print(f"machine factor {factor:.2f}: {path}")
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
