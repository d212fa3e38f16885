"""`bench.fitted`: the benchmark mix fitted to the machine it runs on."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from bench import fitted
from bench.bench_closed_loop import NO_SLO_MS, QUEUEING, mix_config
from bench.fitted import fit, fitted_config, model_factors

ROOT = Path(__file__).resolve().parents[2]


def test_a_machine_three_times_slower_gets_slos_three_times_longer_and_a_third_the_rate(
        ) -> None:
    raw = {"policy": "dstack", "models": [
        {"name": "a", "slo_ms": 60, "max_queue_delay_ms": 5, "rate_rps": 20},
        {"name": "b", "slo_ms": 250}]}
    got = fit(raw, 3.0)
    assert got["models"][0] == {"name": "a", "slo_ms": 180.0, "max_queue_delay_ms": 15.0,
                                "rate_rps": pytest.approx(6.667, abs=1e-3)}
    assert got["models"][1] == {"name": "b", "slo_ms": 750.0}
    assert raw["models"][0]["slo_ms"] == 60  # the original is left as it was


def test_the_fitted_bench_mix_serves_as_written_but_scaled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSTACK_MACHINE_FACTOR", "2.5")
    model_factors.cache_clear()
    path, factor = fitted_config(ROOT / "configs/bench-mix-dstack.yaml", tmp_path)
    assert factor == 2.5
    raw = yaml.safe_load(path.read_text())
    assert Path(raw["profiles"]).is_absolute() and Path(raw["profiles"]).is_dir()
    assert {m["name"]: m["slo_ms"] for m in raw["models"]} == {
        "mobilenet_v3_small": 150.0, "resnet18": 625.0}
    # a faster machine keeps the SLOs as written
    monkeypatch.setenv("DSTACK_MACHINE_FACTOR", "0.5")
    model_factors.cache_clear()
    assert fitted_config(ROOT / "configs/bench-mix-dstack.yaml", tmp_path)[1] == 1.0
    model_factors.cache_clear()


def test_each_model_gets_its_own_factor_and_the_mix_their_median(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulator scales each model by its own factor (bench-bursty); the fitted SLOs
    and rates use one, the median, so that the mix keeps its balance."""
    monkeypatch.delenv("DSTACK_MACHINE_FACTOR", raising=False)
    cpu = ROOT / "profiles/cpu"
    ref = {m: fitted.profile_one_core_ms(cpu, m) for m in ("mobilenet_v3_small", "resnet18")}
    monkeypatch.setattr(fitted, "one_core_ms", lambda names, batches=(1,): {
        "mobilenet_v3_small": {1: 2.0 * ref["mobilenet_v3_small"]},
        "resnet18": {1: 3.0 * ref["resnet18"]}})
    model_factors.cache_clear()
    names = ("mobilenet_v3_small", "resnet18")
    assert model_factors(cpu, names) == pytest.approx({"mobilenet_v3_small": 2.0,
                                                        "resnet18": 3.0})
    assert fitted.machine_factor(cpu, names) == pytest.approx(2.5)
    model_factors.cache_clear()


def test_settings_and_the_queueing_reference_change_the_server_not_the_slos_judged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSTACK_MACHINE_FACTOR", "2")
    model_factors.cache_clear()
    config, slos = mix_config("dstack", tmp_path, ["server.hold_refusals=false",
                                                   "profile_margin=null"])
    raw = yaml.safe_load(config.read_text())
    assert raw["server"]["hold_refusals"] is False and raw["profile_margin"] is None
    assert slos == {"mobilenet_v3_small": 120.0, "resnet18": 500.0}
    config, slos = mix_config(QUEUEING, tmp_path)
    raw = yaml.safe_load(config.read_text())
    assert raw["policy"] == "shared"
    assert {m["slo_ms"] for m in raw["models"]} == {NO_SLO_MS}
    assert slos == {"mobilenet_v3_small": 120.0, "resnet18": 500.0}
    model_factors.cache_clear()
