"""Slice mechanisms (percent -> slice mapping, MPS daemon checks with a fake control tool),
the child protocol and the CLI's number lists."""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path

import pytest

from knee_profiler.cli import parse_numbers
from knee_profiler.messages import (
    CellResult,
    ChildDone,
    ChildError,
    MeasureRequest,
    decode,
    encode,
)
from knee_profiler.mps import MpsError
from knee_profiler.slices import CpuAffinity, Mps, SliceError, make_mechanism


def test_cpu_percent_rounds_up_to_whole_cores() -> None:
    two = CpuAffinity(cores=(0, 1)).plan([10, 20, 30, 40, 50, 60, 70, 80, 90, 100])
    assert [(s.percent, s.units) for s in two] == [(50.0, 1), (100.0, 2)]
    assert two[0].requested == (10.0, 20.0, 30.0, 40.0, 50.0)
    six = CpuAffinity(cores=(2, 3, 4, 5, 6, 7)).plan([10, 50, 51, 100])
    assert [(round(s.percent, 3), s.units) for s in six] == [
        (16.667, 1), (50.0, 3), (66.667, 4), (100.0, 6)
    ]
    mech = CpuAffinity(cores=(2, 3, 4, 5, 6, 7))
    assert mech.slice_args(six[1]) == {"cores": [2, 3, 4]}  # the first k usable cores
    assert mech.child_env(six[1])["OMP_NUM_THREADS"] == "3"


@pytest.mark.parametrize("bad", [0, -5, 100.5])
def test_percent_out_of_range_is_refused(bad: float) -> None:
    with pytest.raises(SliceError, match="slice percent"):
        CpuAffinity(cores=(0, 1)).plan([bad])
    with pytest.raises(SliceError, match="slice percent"):
        Mps().plan([bad])


def test_mps_percent_is_whole_and_unitless() -> None:
    slices = Mps().plan([12.5, 13, 50, 100])
    assert [(s.percent, s.requested, s.units) for s in slices] == [
        (13.0, (12.5, 13.0), None), (50.0, (50.0,), None), (100.0, (100.0,), None)
    ]


def test_make_mechanism_checks_name_and_device() -> None:
    assert make_mechanism("cpu").name == "cpu-affinity"
    assert make_mechanism("cuda", start_daemon=True).name == "mps"
    with pytest.raises(SliceError, match="known: cpu-affinity, mps"):
        make_mechanism("cuda", "green-context")
    with pytest.raises(SliceError, match="for device 'cuda'"):
        make_mechanism("cpu", "mps")


FAKE_CONTROL = """#!/bin/sh
# A stand-in for nvidia-cuda-mps-control: "-d" starts a daemon (a file in the pipe dir).
pipe="${CUDA_MPS_PIPE_DIRECTORY:-/nonexistent-knee-test}"
if [ "$1" = "-d" ]; then touch "$pipe/control"; exit 0; fi
read cmd
[ -e "$pipe/control" ] || { echo "Cannot find MPS control daemon process" >&2; exit 1; }
case "$cmd" in
  get_server_list) exit 0 ;;
  quit) rm -f "$pipe/control"; echo quit >> "$FAKE_MPS_LOG"; exit 0 ;;
esac
"""


@pytest.fixture
def fake_env(tmp_path: Path) -> dict[str, str]:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    tool = bindir / "nvidia-cuda-mps-control"
    tool.write_text(FAKE_CONTROL)
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
    env["PATH"] = f"{bindir}{os.pathsep}/usr/bin:/bin"
    env["FAKE_MPS_LOG"] = str(tmp_path / "mps.log")
    return env


def test_mps_refuses_clearly_when_no_daemon_answers(fake_env: dict[str, str]) -> None:
    with pytest.raises(SliceError, match="no MPS control daemon answers.*--start-mps"):
        Mps(base_env=fake_env).open()


def test_mps_refuses_when_the_tool_is_missing(tmp_path: Path) -> None:
    env = {"PATH": str(tmp_path)}
    with pytest.raises(SliceError, match="no MPS control daemon answers"):
        Mps(base_env=env).open()
    with pytest.raises(MpsError, match="not found on PATH"):
        Mps(start_daemon=True, base_env=env).open()


def test_start_mps_runs_a_private_daemon_and_stops_it(
    fake_env: dict[str, str], tmp_path: Path
) -> None:
    mech = Mps(start_daemon=True, base_env=fake_env)
    mech.open()
    (s,) = mech.plan([30])
    env = mech.child_env(s)
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    pipe = Path(env["CUDA_MPS_PIPE_DIRECTORY"])
    assert (pipe / "control").exists() and "CUDA_MPS_LOG_DIRECTORY" in env
    mech.close()
    assert (tmp_path / "mps.log").read_text() == "quit\n"
    assert not pipe.exists()


def test_existing_daemon_is_used_and_not_stopped(
    fake_env: dict[str, str], tmp_path: Path
) -> None:
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    (pipe / "control").touch()
    mech = Mps(base_env={**fake_env, "CUDA_MPS_PIPE_DIRECTORY": str(pipe)})
    mech.open()
    assert mech.child_env(mech.plan([50])[0])["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe)
    mech.close()
    assert (pipe / "control").exists() and not (tmp_path / "mps.log").exists()


def test_messages_round_trip() -> None:
    req = MeasureRequest("m", "cpu", "cpu-affinity", 50.0, 1, (1, 2), 2, 5, 0, {"cores": [0]})
    assert MeasureRequest.from_json(req.to_json()) == req
    for msg in (CellResult(2, 1.0, 1.5, 1.1, 3.0, 5), CellResult(4, error="OOM"),
                ChildDone("cpu", 2, "cores", {"cores": [0]}, 0.1, "2.x"), ChildError("bad")):
        assert decode(encode(msg)) == msg
    with pytest.raises(ValueError, match="not a child message"):
        decode("Warning: something printed on stdout")


def test_parse_numbers() -> None:
    assert parse_numbers("10,20,...,100") == [10.0 * k for k in range(1, 11)]
    assert parse_numbers("1,2,4", int) == [1, 2, 4]
    assert parse_numbers("5, 50 ,100") == [5.0, 50.0, 100.0]
    assert parse_numbers("25,50,...,100,") == [25.0, 50.0, 75.0, 100.0]
    for bad in ("", "1,...", "10,20,...,95", "a,b", "20,10,...,100"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_numbers(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="whole"):
        parse_numbers("1.5", int)


def test_profiler_imports_only_what_a_bare_gpu_machine_has() -> None:
    """The profiler runs with torch, numpy, tqdm (matplotlib for plot) and nothing of the
    server stack: importing every module must not pull in pydantic, fastapi, pulp, yaml."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import knee_profiler.cli, knee_profiler.sweep, knee_profiler._measure, "
        "knee_profiler.table, knee_profiler.report, knee_profiler.timing\n"
        "bad = [m for m in ('pydantic', 'fastapi', 'pulp', 'yaml', 'psutil', 'server', "
        "'optimizer', 'dstack.runtime.serving', 'matplotlib') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ""
