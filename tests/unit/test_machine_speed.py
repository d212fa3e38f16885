"""`python -m bench.machine_speed`: each core's speed, second by second."""

from __future__ import annotations

import os
import re

import pytest

from bench.machine_speed import main


def test_it_reports_each_cores_speed_in_each_second(capsys: pytest.CaptureFixture[str]) -> None:
    core = min(os.sched_getaffinity(0))
    assert main(["--seconds", "2", "--cores", str(core)]) == 0
    out = capsys.readouterr().out
    per_second = re.search(rf"^core {core}: ms per piece, each second: ([\d. ]+)$", out, re.M)
    assert per_second is not None, out
    times = [float(x) for x in per_second.group(1).split()]
    assert len(times) == 2 and all(t > 0 for t in times)
    assert re.search(rf"^core {core}: fastest [\d.]+ ms, slowest [\d.]+ ms \([\d.]+x\); "
                     r"\d+ of 2 seconds over 1.5x the fastest$", out, re.M), out


def test_a_core_it_may_not_use_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    bad = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(SystemExit) as exit_info:
        main(["--seconds", "1", "--cores", str(bad)])
    assert exit_info.value.code == 2
    assert f"--cores {bad}: this process may use cores" in capsys.readouterr().err
