"""Plans on the reference V100 table: messages, packing, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dstack.cli import main
from dstack.common.types import (
    Cell,
    DeviceInfo,
    ModelSLO,
    Plan,
    Priority,
    Profile,
    Schedule,
    Slot,
    SolverStatus,
)
from optimizer import SolveOptions, pack, solve, validate_schedule

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


def _assert_realisable(plan: Plan) -> None:
    assert validate_schedule(pack(plan), [m.model for m in plan.models]) == []
    for m in plan.models:
        assert plan.cycle_ms + m.latency_ms <= m.slo_ms + 1e-9


def test_model_that_cannot_meet_its_slo_is_named_and_others_still_planned(v100) -> None:
    slos = [ModelSLO("vgg19", 25, 50), ModelSLO("alexnet", 40, 500), ModelSLO("resnet50", 60, 200)]
    plan = solve(v100, slos, SolveOptions(percentages=(10,)))
    assert plan.status is SolverStatus.INFEASIBLE
    reasons = {s.model: s.reason for s in plan.shortfalls}
    assert reasons["vgg19"] == "vgg19 needs 30.0 ms at batch 1 on 10%; its SLO is 25 ms"
    assert {m.model for m in plan.models} == {"alexnet", "resnet50"}
    _assert_realisable(plan)


def test_whole_device_message_uses_100_percent(v100) -> None:
    plan = solve(v100, [ModelSLO("vgg19", 5, 10)])
    assert plan.shortfalls[0].reason == "vgg19 needs 5.4 ms at batch 1 on 100%; its SLO is 5 ms"
    assert plan.models == ()


def test_demand_beyond_capacity_is_partial_with_numbers(v100) -> None:
    slos = [ModelSLO("resnet50", 50, 4000), ModelSLO("alexnet", 30, 100, Priority.HIGH)]
    plan = solve(v100, slos)
    assert plan.status is SolverStatus.PARTIAL
    (short,) = plan.shortfalls
    r = plan.for_model("resnet50")
    assert short.reason == f"resnet50: serves {r.served_rps:.0f} rps of 4000 expected"
    assert plan.for_model("alexnet").served_rps == pytest.approx(100)
    _assert_realisable(plan)


def test_light_load_is_served_fully_with_the_least_device(v100) -> None:
    slos = [ModelSLO("alexnet", 50, 100), ModelSLO("resnet50", 80, 100), ModelSLO("vgg19", 100, 50)]
    plan = solve(v100, slos)
    assert plan.status is SolverStatus.OPTIMAL and plan.shortfalls == ()
    for m in plan.models:
        assert m.served_rps == pytest.approx(m.expected_rps)
    _assert_realisable(plan)
    # Least device share among goodput-optimal plans: not everything on 100%.
    assert sum(m.percent for m in plan.models) < 300


def test_unknown_rate_still_gets_a_valid_choice(v100) -> None:
    plan = solve(v100, [ModelSLO("alexnet", 30, 0.0), ModelSLO("resnet50", 60, 100)])
    a = plan.for_model("alexnet")
    assert a.expected_rps == pytest.approx(1000 / 1.4)  # batch-1 capacity on 100%
    _assert_realisable(plan)


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


def _random_models(n: int, seed: int) -> tuple[dict[str, Profile], list[ModelSLO]]:
    import random

    rng = random.Random(seed)
    batches, percents = (1, 2, 4, 8, 16, 32), tuple(float(p) for p in range(10, 101, 10))
    profiles, slos = {}, []
    for i in range(n):
        k0, t, knee = rng.uniform(0.3, 3.0), rng.uniform(0.05, 1.0), rng.uniform(20, 80)
        cells = tuple(
            Cell(b, p, lat, lat)
            for b in batches
            for p in percents
            for lat in [round((k0 + t * b) * max(1.0, knee / p) ** 0.8, 3)]
        )
        dev = DeviceInfo("reference", "t", 80, "SMs")
        profiles[f"m{i}"] = Profile(f"m{i}", dev, "table", batches, percents, cells)
        slos.append(ModelSLO(f"m{i}", round(rng.uniform(4, 12) * (k0 + t) * n / 4, 1), 100.0))
    return profiles, slos


def test_large_instance_uses_the_heuristic_and_says_not_proven() -> None:
    """Too large for the MILP: a valid plan quickly, marked not proven, shown so in the CLI."""
    from optimizer.cli import format_plan

    profiles, slos = _random_models(12, 3)
    plan = solve(profiles, slos)
    assert plan.models and plan.proven_optimal is False
    _assert_realisable(plan)
    assert "not proven optimal" in format_plan(plan)
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))).proven_optimal is False


def test_small_instance_is_proven_and_old_plan_files_still_load(v100) -> None:
    plan = solve(v100, [ModelSLO("alexnet", 40, 300), ModelSLO("resnet50", 60, 200)])
    assert plan.proven_optimal is True
    d = plan.to_dict()
    del d["proven_optimal"]  # written before the field existed
    assert Plan.from_dict(d).proven_optimal is True
