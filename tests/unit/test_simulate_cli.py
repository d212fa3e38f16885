"""`dstack simulate` as a user runs it: the report, the plot, a trace replayed, and bad
flags answered with exit code 2 and the reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from dstack.cli import main
from dstack.simulate import generate, write_trace

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "reference-v100.yaml")


def test_simulate_prints_every_policy_against_the_ideal_bound_and_plots(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "sim.png"
    assert main(["simulate", "--config", CONFIG, "--duration", "2s", "--seed", "3",
                 "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "ideal bound" in out
    table = out.split("| ratio |")[1].split("\n\n")[0]  # the report, not the per-model one
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()[2:]}
    assert set(rows) == {"dstack", "temporal", "shared", "spatial"}
    for policy in rows:
        ratio = float(rows[policy].split("|")[-2])
        assert 0 < ratio <= 1.0  # goodput over the ideal bound: never above it
    assert png.stat().st_size > 10_000


def test_simulate_is_deterministic_for_a_seed(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--config", CONFIG, "--duration", "2s", "--policies", "dstack"]
    outs = []
    for seed in ("1", "1", "2"):
        assert main([*args, "--seed", seed]) == 0
        outs.append(capsys.readouterr().out.split("\nsimulated in")[0])
    assert outs[0] == outs[1] != outs[2]


def test_simulate_replays_a_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.csv"
    write_trace(generate("poisson", {"alexnet": 50.0, "resnet50": 20.0, "vgg19": 5.0}, 1.0, 7),
                trace)
    assert main(["simulate", "--config", CONFIG, "--workload", f"trace:{trace}",
                 "--duration", "1s", "--policies", "spatial"]) == 0
    assert "| spatial |" in capsys.readouterr().out


def test_a_replan_that_moves_workers_waits_for_their_start(
        capsys: pytest.CaptureFixture[str]) -> None:
    """resnet18 at 8x its rate: the plan for that restarts both workers. Free, dstack takes
    it at once; when a worker takes 10 s to start (as on a slow CPU), not within a minute."""
    cpu = str(ROOT / "configs" / "bench-mix-dstack.yaml")
    said = []
    for start in ("0", "10s"):
        assert main(["simulate", "--config", cpu, "--workload", "burst:x8@10s+50s:resnet18",
                     "--duration", "60s", "--policies", "dstack", "--worker-start", start]) == 0
        said.append(capsys.readouterr().out)
    assert "dstack: 1 re-plan (each weighed against a worker start of 0 s" in said[0]
    assert "dstack: 0 re-plans (each weighed against a worker start of 10 s" in said[1]


@pytest.mark.parametrize(("flags", "says"), [
    (["--policies", "dstack,fastest"], "choose from"),
    (["--workload", "poisson-ish"], "unknown workload"),
    (["--duration", "ten minutes"], "duration"),
    (["--worker-start", "soon"], "--worker-start"),
])
def test_simulate_rejects_bad_flags_naming_them(
        flags: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--config", CONFIG, *flags]) == 2
    assert says in capsys.readouterr().err



def test_a_reader_that_leaves_early_gets_no_traceback() -> None:
    """`dstack models | head -1`: the reader closes the pipe; the command stops quietly.
    (`true` reads nothing and exits at once, so every write meets a closed pipe.)"""
    import subprocess
    import sys

    r = subprocess.run(["bash", "-c", f"{sys.executable} -m dstack.cli models | true"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0 and r.stderr == "", r.stderr
