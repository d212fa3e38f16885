"""`bench.profile_stalls`: what held a thread, stall by stall, from a py-spy timeline."""

from __future__ import annotations

import json
from pathlib import Path

from bench.profile_stalls import main, report, stalls

FRAMES = ["<module>", "Runner.run", "on_frame", "solve", "score"]
IDLE = [0, 1]  # <module>;Runner.run: the loop waiting
WORK = [0, 1, 2]  # a callback
SOLVE = [0, 1, 2, 3, 4]


def doc(samples: list[list[int]]) -> dict:
    return {"shared": {"frames": [{"name": n} for n in FRAMES]},
            "profiles": [{"name": 'Thread 7 "MainThread"', "samples": samples}]}


def names(stack: list[int]) -> list[str]:
    return [FRAMES[i] for i in stack]


def test_runs_of_work_are_stalls_one_idle_tick_within_them_included() -> None:
    ticks = [IDLE] * 5 + [SOLVE] * 6 + [IDLE] + [SOLVE] * 4 + [IDLE] * 3 + [WORK] * 3 + [IDLE]
    found = stalls([names(s) for s in ticks], min_ticks=8)
    assert [(st.start, len(st.stacks)) for st in found] == [(5, 10)]  # not the run of 3
    assert [(st.start, len(st.stacks)) for st in stalls([names(s) for s in ticks], 3)] == [
        (5, 10), (19, 3)]  # longest first


def test_the_report_names_when_how_long_and_in_what_without_the_loops_own_frames() -> None:
    ticks = [IDLE] * 1000 + [SOLVE] * 12 + [WORK] * 4 + [IDLE] * 10
    out = report(doc(ticks), rate=1000, min_ms=8, top=5)
    head, stall = out.splitlines()
    assert head.startswith('Thread 7 "MainThread": 1026 ticks (1.0 s), work 1.6%, 1 stalls')
    assert "from    1.000 s,   16.0 ms" in stall
    assert "in on_frame 100%, solve 75%, score 75%" in stall  # not <module>, Runner.run
    assert "innermost score 75%, on_frame 25%" in stall


def test_the_command_prints_and_says_when_it_cannot_read(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "profile.speedscope"
    f.write_text(json.dumps(doc([IDLE] * 3 + [SOLVE] * 9)))
    assert main([str(f), "--rate", "1000", "--min-ms", "8"]) == 0
    assert "1 stalls of >= 8 ms" in capsys.readouterr().out
    assert main([str(tmp_path / "missing")]) == 2
    assert "cannot read" in capsys.readouterr().err
