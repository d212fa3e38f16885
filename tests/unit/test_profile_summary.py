"""`bench.profile_summary`: where a py-spy profile's samples went, by function, self and
inclusive, whichever lines of a function were sampled."""

from __future__ import annotations

from pathlib import Path

from bench.profile_summary import main, summarize

RAW = [
    "main (app.py:3);loop (app.py:10);send (link.py:162) 6",
    "main (app.py:3);loop (app.py:11);send (link.py:170) 2",
    "main (app.py:3);loop (app.py:12);loop (app.py:12);decide (core.py:5) 2",
    "not a stack line",
]


def test_samples_are_counted_by_function_self_and_inclusive() -> None:
    total, own, inclusive = summarize(RAW)
    assert total == 10
    assert own == {"send (link.py)": 8, "decide (core.py)": 2}  # two lines of send: one row
    assert inclusive["main (app.py)"] == 10
    assert inclusive["loop (app.py)"] == 10  # once per sample, though it recurs
    assert inclusive["send (link.py)"] == 8


def test_the_command_prints_shares_and_says_when_it_cannot_read(
        tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "profile.raw"
    f.write_text("\n".join(RAW) + "\n")
    assert main([str(f), "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[:3] == ["10 samples", "top 1 by self time:",
                                    "   80.0%       8  send (link.py)"]
    assert main([str(tmp_path / "missing.raw")]) == 2
    assert "cannot read" in capsys.readouterr().err
