"""The dashboard's chart builders (server/static/charts.js), run by node: lanes laid out
side by side, names escaped, gaps left where a value is missing. Skipped without node."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

CHARTS = Path(__file__).resolve().parents[2] / "server" / "static" / "charts.js"
NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed")


def run_js(body: str) -> Any:
    """Run `body` with `C` = charts.js's exports; it prints one JSON value."""
    script = f"const C = require({json.dumps(str(CHARTS))});\n{body}"
    out = subprocess.run([str(NODE), "-e", script], capture_output=True, text=True,
                         timeout=30, check=True)
    return json.loads(out.stdout)


def test_lanes_stack_and_turns_in_a_lane_line_up() -> None:
    # Two lanes of 50%: a and b take turns in the first, c has the second to itself.
    sched = {"cycle_ms": 10, "slots": [
        {"model": "a", "start_ms": 0, "duration_ms": 6, "percent": 50},
        {"model": "c", "start_ms": 0, "duration_ms": 10, "percent": 50},
        {"model": "b", "start_ms": 6, "duration_ms": 4, "percent": 50},
    ]}
    placed = run_js(f"console.log(JSON.stringify(C.layoutSlots({json.dumps(sched)})))")
    y = {p["model"]: p["y0"] for p in placed}
    assert y["a"] == y["b"] and abs(y["c"] - y["a"]) == 50


def test_names_from_the_server_are_escaped() -> None:
    evil = '<img src=x onerror="alert(1)">'
    sched = {"cycle_ms": 10, "slots": [
        {"model": evil, "start_ms": 0, "duration_ms": 10, "percent": 100}]}
    out = run_js(
        f"const n = {json.dumps(evil)};"
        f"console.log(JSON.stringify([C.scheduleSvg({json.dumps(sched)}, {{}}),"
        "C.lineSvg([-1, 0], [{label: n, color: '#000', values: [1, 2]}], {windowS: 60}),"
        "C.esc(n)]))"
    )
    for svg in out:
        assert "<img" not in svg
    assert out[2] == "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;"
    assert "<rect" in out[0]  # the bar is there, with its name escaped in the tooltip


def test_a_missing_value_breaks_the_line() -> None:
    d = run_js("console.log(JSON.stringify(C.lineSvg([-3, -2, -1, 0], "
               "[{label: 'm', color: '#000', values: [1, null, 2, 3]}], {windowS: 60})))")
    path = d.split(' d="')[1].split('"')[0]
    assert path.count("M") == 2 and path.count("L") == 1


def test_recent_averages_only_known_values() -> None:
    assert run_js("console.log(JSON.stringify([C.recent([5, null, 1, 3], 3),"
                  " C.recent([null], 3)]))") == [2, None]
