"""`bench.bench_bursty`'s pure parts: the arrivals per scale, the targets and the report
(no server; one short simulation)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from bench.bench_bursty import checks, report, schedule, sends, sim_error
from dstack.simulate import WorkloadError

RATES = {"mobilenet_v3_small": 8.0, "resnet18": 2.0}


def test_every_scale_replays_the_same_bursts_with_its_multiple_of_the_requests() -> None:
    one = schedule("bursty:compress=10", RATES, 1.0, 600.0, seed=3)
    two = schedule("bursty:compress=10", RATES, 2.0, 600.0, seed=3)
    again = schedule("bursty:compress=10", RATES, 1.0, 600.0, seed=3)
    np.testing.assert_array_equal(one.times, again.times)  # every policy gets these
    assert one.names == two.names == tuple(RATES)
    for m in RATES:
        assert 1.7 < two.count(m) / one.count(m) < 2.3
        # the same on/off shape: the 10-s windows that are busy at x1 are busy at x2
        c1 = np.bincount((one.times_of(m) // 10).astype(int), minlength=60)
        c2 = np.bincount((two.times_of(m) // 10).astype(int), minlength=60)
        assert np.corrcoef(c1, c2)[0, 1] > 0.8
    assert one.times.max() < 600.0 and np.all(np.diff(one.times) >= 0)
    at = sends(one)
    assert len(at) == one.times.size and at[0] == (one.times[0], one.names[one.models[0]])
    assert [t for t, _ in at] == sorted(t for t, _ in at)


def test_a_point_over_the_request_bound_is_refused_before_any_is_sent() -> None:
    with pytest.raises(WorkloadError, match="over --max-requests 100"):
        schedule("bursty:compress=10", RATES, 2.0, 60.0, seed=1, max_requests=100)


def _side(good: float) -> dict[str, Any]:
    return {"arrived": 100, "within_slo": int(good * 10), "late": 3, "refused": 7,
            "errors": 0, "goodput_rps": good, "replans": 1,
            "models": {"mobilenet_v3_small": {"goodput_rps": good * 0.8},
                       "resnet18": {"goodput_rps": good * 0.2}}}


def _point(policy: str, scale: float, real: float, sim: float) -> dict[str, Any]:
    return {"policy": policy, "scale": scale, "arrived": 100,
            "real": {**_side(real), "profile_correction": None}, "sim": _side(sim)}


def _results(points: list[dict[str, Any]]) -> dict[str, Any]:
    return {"workload": "bursty:compress=10", "duration_s": 10.0, "seed": 1,
            "machine_factor": 2.0, "rates_rps": RATES,
            "slos_ms": {"mobilenet_v3_small": 120.0, "resnet18": 500.0},
            "sim_profiles": "profiles/cpu with latencies x2.00", "points": points}


def test_targets_are_marked_met_or_missed_per_scale_and_source() -> None:
    points = [_point("shared", 1, 10.0, 10.0), _point("spatial", 1, 9.0, 8.0),
              _point("dstack", 1, 10.5, 9.2),
              _point("shared", 2, 12.0, 11.0), _point("dstack", 2, 11.0, 12.0)]
    got = {(c.scale, c.what): c for c in checks(points)}
    assert got[(1, "dstack / shared (real)")].value == pytest.approx(1.05)
    assert got[(1, "dstack / shared (real)")].met is True
    assert got[(1, "dstack / spatial (real)")].met is True  # 10.5 / 9 = 1.17
    assert got[(1, "dstack / shared (sim)")].met is False  # 9.2 / 10
    assert got[(1, "dstack / spatial (sim)")].met is True  # 9.2 / 8 = 1.15
    assert got[(1, "simulator error, spatial")].value == pytest.approx(-1 / 9)
    assert got[(1, "simulator error, spatial")].met is False
    assert got[(1, "simulator error, dstack")].met is False  # -12.4%
    assert got[(1, "simulator error, shared")].met is True
    assert got[(2, "dstack / shared (real)")].met is False  # 11 / 12
    # spatial did not run at x2: not measured, neither met nor missed
    assert got[(2, "dstack / spatial (real)")].value is None
    assert got[(2, "dstack / spatial (real)")].met is None


def test_the_report_shows_each_point_beside_its_simulation_and_the_marks() -> None:
    points = [_point("shared", 1, 10.0, 10.0), _point("spatial", 1, 9.0, 8.0),
              _point("dstack", 1, 10.5, 9.2)]
    points[1]["real"]["profile_correction"] = "profiles: warm-up batches of one item ..."
    text = report(_results(points))
    row = next(line for line in text.splitlines() if line.startswith("| dstack | x1 |"))
    assert "| 10.50 | 9.20 | -12.4% |" in row
    assert "mobilenet_v3_small 8.4/7.4" in row
    assert "simulated with: profiles/cpu with latencies x2.00" in text
    assert "spatial x1: the server's warm-up: profiles: warm-up batches" in text
    marks = [line for line in text.splitlines() if line.startswith("x1 ")]
    assert any("dstack / shared (sim)" in m and m.endswith("MISSED") for m in marks)
    assert any("dstack / spatial (real)" in m and "1.17x" in m and m.endswith("met")
               for m in marks)


def test_a_policy_that_did_not_run_is_said_so_and_has_no_error() -> None:
    p = {"policy": "dstack", "scale": 1, "arrived": 50,
         "real": {"error": "server exited (1)"}, "sim": _side(4.0)}
    assert sim_error(p) is None
    text = report(_results([p]))
    assert "| dstack | x1 | 50 | did not run: server exited (1) |" in text
    assert "simulator error, dstack" in text and "n/a" in text


def test_the_simulator_slows_each_model_by_its_own_factor(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model measured much slower here than its profile is simulated that much slower;
    the other model is simulated as before."""
    from dataclasses import replace

    from bench.bench_bursty import fitted_mix, run_sim
    from bench.fitted import model_factors

    monkeypatch.setenv("DSTACK_MACHINE_FACTOR", "2")
    model_factors.cache_clear()
    mix = fitted_mix("spatial", tmp_path)
    model_factors.cache_clear()
    assert mix.model_factors == {"mobilenet_v3_small": 2.0, "resnet18": 2.0}
    arrivals = schedule("bursty:compress=10", mix.rates_rps, 1.0, 20.0, seed=1)
    even = run_sim("spatial", mix, arrivals, 20.0)["models"]
    slow = run_sim("spatial", replace(mix, model_factors={"mobilenet_v3_small": 2.0,
                                                          "resnet18": 8.0}),
                   arrivals, 20.0)["models"]
    assert slow["resnet18"]["within_slo"] < even["resnet18"]["within_slo"] / 2
    mob = "mobilenet_v3_small"
    assert slow[mob]["within_slo"] >= 0.9 * even[mob]["within_slo"]


def test_the_simulated_replans_cost_what_the_servers_workers_took_to_start(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server weighs a re-plan against its workers' start; the simulator is given the
    same time, read from the server's log (a free switch made it re-plan for bursts)."""
    import bench.bench_bursty as bb
    from bench.fitted import model_factors

    log = ("... worker mobilenet_v3_small ready in 5.5 s (pid 1, slice 50% [0])\n"
           "... worker resnet18 ready in 9.5 s (pid 2, slice 50% [1])\n"
           "... worker mobilenet_v3_small#g1 ready in 5.4 s (pid 3, slice 50% [1])\n")
    assert bb.worker_start_s(log) == 5.5
    assert bb.worker_start_s("no workers") is None
    monkeypatch.setenv("DSTACK_MACHINE_FACTOR", "2")
    model_factors.cache_clear()
    mix = bb.fitted_mix("dstack", tmp_path)
    model_factors.cache_clear()
    seen: list[float] = []
    real_simulate = bb.simulate

    def simulate(*args: Any, start_s: float = 0.0, **kw: Any) -> Any:
        seen.append(start_s)
        return real_simulate(*args, start_s=start_s, **kw)

    monkeypatch.setattr(bb, "simulate", simulate)
    arrivals = schedule("bursty:compress=10", mix.rates_rps, 1.0, 5.0, seed=1)
    assert "goodput_rps" in bb.run_sim("dstack", mix, arrivals, 5.0, start_s=5.5)
    assert seen == [5.5]
