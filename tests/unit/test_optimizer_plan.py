"""`dstack plan` on the reference V100 table, and the pure schedule check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dstack.cli import main
from dstack.common.types import Cell, DeviceInfo, Plan, Profile, Schedule, Slot
from optimizer import pack, validate_schedule

TABLE = Path("/work/shared/data/gpu_latency_vs_mps_percentage.json")
REPO_PROFILES = Path(__file__).resolve().parents[2] / "profiles" / "reference-v100"


def reference_profiles() -> dict[str, Profile]:
    d = json.loads(TABLE.read_text())
    out = {}
    for name, rows in d["latency_ms"].items():
        cells = tuple(
            Cell(int(b), float(p), lat, lat)
            for b, lats in rows.items()
            for p, lat in zip(d["percentages"], lats, strict=True)
        )
        out[name] = Profile(
            name,
            DeviceInfo("reference", "V100", 80, "SMs"),
            "table",
            tuple(int(b) for b in d["batch_sizes"]),
            tuple(float(p) for p in d["percentages"]),
            cells,
        )
    return out


@pytest.fixture(scope="module")
def v100() -> dict[str, Profile]:
    return reference_profiles()


def test_validate_schedule_reports_overlap_overflow_and_missing() -> None:
    bad = Schedule(
        10.0,
        (
            Slot("a", 0.0, 6.0, 60.0),
            Slot("b", 2.0, 4.0, 50.0),
            Slot("c", 8.0, 4.0, 10.0),
        ),
    )
    problems = validate_schedule(bad, ["a", "b", "c", "d"])
    assert any("sum to 110%" in p for p in problems)
    assert any(p.startswith("c: slot 8.000-12.000 ms leaves") for p in problems)
    assert "d: no slot in the schedule" in problems
    good = Schedule(10.0, (Slot("a", 0.0, 6.0, 60.0), Slot("b", 6.0, 4.0, 100.0)))
    assert validate_schedule(good, ["a", "b"]) == []


def test_validate_schedule_reports_shared_units() -> None:
    s = Schedule(5.0, (Slot("a", 0, 5, 50, (0, 1)), Slot("b", 1, 2, 50, (1, 2))))
    assert any("unit 1 is given to both a and b" in p for p in validate_schedule(s))


def _write_profiles(directory: Path, profiles: dict[str, Profile]) -> Path:
    for p in profiles.values():
        p.save(directory / f"{p.model}.json")
    return directory


def test_cli_plan_prints_table_and_writes_json(tmp_path, v100, capsys) -> None:
    profdir = (
        REPO_PROFILES if REPO_PROFILES.is_dir() else _write_profiles(tmp_path / "profiles", v100)
    )
    cfg = tmp_path / "deploy.yaml"
    cfg.write_text(
        "policy: dstack\n"
        f"profiles: {profdir}\n"
        "models:\n"
        "  - {name: alexnet, slo_ms: 30, rate_rps: 600, max_batch_size: 16}\n"
        "  - {name: resnet50, slo_ms: 60, rate_rps: 300, max_batch_size: 32}\n"
        "  - {name: vgg19, slo_ms: 100, rate_rps: 100, max_batch_size: 32}\n"
    )
    out = tmp_path / "plan.json"
    rc = main(["plan", "--config", str(cfg), "--json", str(out)])
    text = capsys.readouterr().out
    plan = Plan.from_dict(json.loads(out.read_text()))
    assert rc == 0
    assert plan.for_model("alexnet").batch <= 16
    for m in plan.models:
        line = next(ln for ln in text.splitlines() if ln.startswith(m.model))
        assert f"{m.served_rps:.0f} / {m.expected_rps:.0f}" in line
        assert f"{m.latency_ms:.1f} ms" in line
    assert f"cycle {plan.cycle_ms:.2f} ms" in text
    # Three models: every lane was a candidate of the MILP, and CBC proved its plan.
    assert "(optimal, MILP over all 70 lanes)" in text
    saved = json.loads(out.read_text())
    assert saved["proven_optimal"] is True and saved["gap"] == 0.0
    # A lane plan: each model's lane round (b / throughput) plus its batch fits its SLO.
    assert validate_schedule(pack(plan), [m.model for m in plan.models]) == []
    named = {s.model for s in plan.shortfalls}
    for m in plan.models:
        lane_round_ms = 1000.0 * m.batch / m.throughput_rps
        assert lane_round_ms + m.latency_ms <= m.slo_ms + 1e-9 or m.model in named


def test_cli_plan_infeasible_exits_1_and_says_why(tmp_path, v100, capsys) -> None:
    profdir = _write_profiles(tmp_path / "profiles", v100)
    cfg = tmp_path / "deploy.yaml"
    cfg.write_text(
        "models:\n"
        "  - {name: vgg19, slo_ms: 5, rate_rps: 10, max_queue_delay_ms: 1}\n"
        "  - {name: alexnet, slo_ms: 30, rate_rps: 100}\n"
    )
    rc = main(["plan", "--config", str(cfg), "--profiles", str(profdir)])
    text = capsys.readouterr().out
    assert rc == 1
    assert "vgg19 needs 5.4 ms at batch 1 on 100%; its SLO is 5 ms" in text
    assert "alexnet" in text


def test_cli_plan_draws_gantt(tmp_path, v100) -> None:
    profdir = _write_profiles(tmp_path / "profiles", v100)
    cfg = tmp_path / "deploy.yaml"
    cfg.write_text("models:\n  - {name: alexnet, slo_ms: 30, rate_rps: 100}\n")
    png = tmp_path / "g.png"
    assert main(["plan", "--config", str(cfg), "--profiles", str(profdir), "--plot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_plan_stopped_at_the_time_limit_shows_cbcs_gap() -> None:
    from dstack.common.types import SolverStatus
    from dstack.policies.lane_policy import LanePlan
    from optimizer.cli import format_plan
    from optimizer.lanes import SearchStatus

    st = SearchStatus(proven=False, complete=False, gap=0.0312, candidates=1850)
    plan = LanePlan((), 10.0, 100.0, SolverStatus.OPTIMAL, 5.0, (), st.optimal,
                    search=st.describe(), gap=st.gap)
    line = format_plan(plan).splitlines()[-1]
    assert "3.12% below CBC's bound over 1850 candidate lanes" in line
    assert "optimal (" not in line
    done = SearchStatus(proven=True, complete=False, gap=0.0, candidates=1850)
    assert done.describe() == "optimal over 1850 candidate lanes, not over every lane"
    none = SearchStatus(proven=False, complete=False, gap=float("inf"), candidates=1850)
    assert none.describe() == "the greedy plan: CBC found none within the time limit"
