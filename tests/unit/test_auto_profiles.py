"""`profiles: auto`: the cache's naming, resolving (a profile there is used as it is, a
missing one measured), the time limit, the one-line warning for profiles of another
machine, `scaled`, and `dstack plan` / `dstack simulate` refusing to measure.

Measuring uses a fake child that speaks the real child protocol without torch (as
tests/unit/test_knee_sweep.py does); tests/integration/test_auto_profiles_cpu.py runs the
real one. Every test points DSTACK_PROFILE_CACHE at its own directory."""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from dstack.cli import main
from dstack.common.config import ConfigError, load_config, parse_config
from dstack.common.types import Cell, DeviceInfo, Profile, scaled
from dstack.policies import auto_profiles as ap
from dstack.policies.planning import served_profiles

FAKE_CHILD = r"""
import json, os, sys, time
from knee_profiler.messages import CellResult, ChildDone, MeasureRequest, encode
from knee_profiler.slices import cpu_name
req = MeasureRequest.from_json(sys.stdin.read())
with open(os.environ["AUTO_FAKE_LOG"], "a") as f:
    f.write(json.dumps({"models": [m for m, _ in req.work()], "percent": req.percent,
                        "cores": req.slice_args.get("cores"), "warmup": req.warmup,
                        "repeats": req.repeats}) + "\n")
time.sleep(float(os.environ.get("AUTO_FAKE_SLEEP", "0")))
for model, batches in req.work():
    for b in batches:
        p50 = 100.0 / req.percent * b
        print(encode(CellResult(b, p50, p50 * 1.1, p50, 1.0, req.repeats, model=model)),
              flush=True)
print(encode(ChildDone(cpu_name(), 0, "cores", {}, 0.5, "none")), flush=True)
"""


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(ap.CACHE_ENV, str(root))
    return root


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    script = tmp_path / "fake_child.py"
    script.write_text(FAKE_CHILD)
    log = tmp_path / "children.log"
    monkeypatch.setenv("AUTO_FAKE_LOG", str(log))
    return {"cmd": (sys.executable, str(script)), "log": log}


def children(log: Path) -> list[dict]:
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


def config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "deploy.yaml"
    path.write_text(text)
    return path


TWO_CORES = "policy: dstack\ncores: [0, 1]\nmodels:\n  - {name: tiny_cnn, max_batch_size: 4}\n"
ONE_CORE = "policy: dstack\ncores: [0]\nmodels:\n  - {name: tiny_cnn, max_batch_size: 4}\n"


def profile_here(model: str, units: int, batches=(1, 2, 4), device: str | None = None,
                 p50: float = 1.0) -> Profile:
    """A profile as the start-up sweep would leave it on this machine's `units` cores."""
    pcts = [100.0 * k / units for k in range(1, units + 1)]
    cells = tuple(Cell(b, p, p50 * b * 100 / p, p50 * b * 110 / p, p, round(p * units / 100))
                  for b in batches for p in pcts)
    dev = DeviceInfo("cpu", device or ap.cpu_name(), units, "cores")
    return Profile(model, dev, "cpu-affinity", tuple(batches), tuple(pcts), cells,
                   provenance="test")


# --------------------------------------------------------------------------- naming


@pytest.mark.parametrize(("args", "name"), [
    (("cpu", "AMD EPYC", 2), "cpu-amd-epyc-2cores"),
    (("cpu", "Intel(R) Xeon(R) Processor", 1), "cpu-intel-xeon-1core"),
    (("cpu", "AMD EPYC 7B13 64-Core Processor", 64), "cpu-amd-epyc-7b13-64-core-64cores"),
    (("cuda", "NVIDIA H100 80GB HBM3", 0, "mps"), "cuda-nvidia-h100-80gb-hbm3-mps"),
    (("cuda", "NVIDIA H100 80GB HBM3", 0, "mps", "fp16"), "cuda-nvidia-h100-80gb-hbm3-mps-fp16"),
    (("cpu", "AMD EPYC", 2, "cpu-affinity", "fp32"), "cpu-amd-epyc-2cores"),
])
def test_cache_directory_is_named_from_the_device(args: tuple, name: str) -> None:
    assert ap.device_dir_name(*args) == name


def test_cache_root_is_the_variable_else_the_users_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ap.CACHE_ENV, str(tmp_path / "c"))
    assert ap.cache_root() == tmp_path / "c"
    monkeypatch.delenv(ap.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ap.cache_root() == tmp_path / "xdg" / "dstack-serve" / "profiles"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert ap.cache_root() == tmp_path / "home" / ".cache" / "dstack-serve" / "profiles"


def test_the_cores_the_workers_get_name_the_cpu_device(cache: Path, tmp_path: Path) -> None:
    cfg = load_config(config(tmp_path, ONE_CORE))
    assert ap.cache_dir(cfg) == cache / f"cpu-{ap.slug(ap.cpu_name())}-1core"


def test_the_suite_never_touches_the_users_cache() -> None:
    # tests/conftest.py points the variable at a directory of the session's own
    assert ap.CACHE_ENV in os.environ
    assert not ap.cache_root().is_relative_to(Path.home() / ".cache")


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(("text", "profiles"), [
    ("policy: dstack\n", "auto"),
    ("policy: spatial\n", "auto"),
    ("policy: dstack\nprofiles: null\n", "auto"),
    ("policy: shared\n", None),
    ("policy: temporal\nprofiles: auto\n", "auto"),
])
def test_profiled_policies_without_profiles_mean_auto(text: str, profiles: str | None,
                                                     tmp_path: Path) -> None:
    cfg = load_config(config(tmp_path, text + "models:\n  - name: tiny_cnn\n"))
    assert cfg.profiles == profiles
    assert ap.wants_auto(cfg) is (profiles == "auto")


def test_a_directory_named_auto_is_written_as_a_path(tmp_path: Path) -> None:
    cfg = load_config(config(tmp_path, "policy: dstack\nprofiles: ./auto\n"
                                       "models:\n  - name: tiny_cnn\n"))
    assert cfg.profiles == (tmp_path / "auto").resolve()


def test_sweep_grid_is_bounded() -> None:
    assert ap.core_counts(2) == [1, 2]
    many = ap.core_counts(64)
    assert many[0] == 1 and many[-1] == 64 and len(many) <= ap.AUTO_MAX_CPU_SLICES + 1
    here = ap.ThisDevice("cpu", "X", "cpu-affinity", (0, 1))
    assert ap.grid_for(here, 8) == ap.Grid((1, 2, 4, 8), (50.0, 100.0))
    assert ap.grid_for(here, 3).batch_sizes == (1, 2)
    assert ap.grid_for(here, 1).batch_sizes == (1,)
    cfg = parse_config({"policy": "dstack", "models": [
        {"name": "a", "zoo_name": "tiny_cnn", "max_batch_size": 2},
        {"name": "b", "zoo_name": "tiny_cnn", "max_batch_size": 4}]})
    assert ap.grids(cfg, here) == {"tiny_cnn": ap.Grid((1, 2, 4), (50.0, 100.0))}


# --------------------------------------------------------------------------- resolving


def test_a_profile_in_the_cache_is_used_without_measuring(cache: Path, fake: dict,
                                                         tmp_path: Path) -> None:
    cfg = load_config(config(tmp_path, TWO_CORES))
    profile_here("tiny_cnn", 2).save(ap.cache_dir(cfg) / "tiny_cnn.json")
    directory, got = ap.resolve(cfg, child=fake["cmd"])
    assert directory == ap.cache_dir(cfg)
    assert got["tiny_cnn"].provenance == "test"
    assert children(fake["log"]) == []
    assert served_profiles(cfg)["tiny_cnn"].provenance == "test"


def test_a_missing_profile_is_measured_once_and_kept(
        cache: Path, fake: dict, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = load_config(config(tmp_path, TWO_CORES))
    caplog.set_level(logging.INFO, logger="dstack.profiles")
    directory, got = ap.resolve(cfg, child=fake["cmd"])
    prof = got["tiny_cnn"]
    assert prof.batch_sizes == (1, 2, 4) and prof.percentages == (50.0, 100.0)
    assert prof.device.name == ap.cpu_name() and prof.device.units == 2
    assert (directory / "tiny_cnn.json").exists()
    runs = children(fake["log"])  # one process per slice, the whole device first
    assert [(r["percent"], r["cores"]) for r in runs] == [(100.0, [0, 1]), (50.0, [0])]
    assert {(r["warmup"], r["repeats"]) for r in runs} == {(ap.AUTO_WARMUP, ap.AUTO_REPEATS)}
    dev = directory.name
    lines = [r.getMessage() for r in caplog.records if r.name == "dstack.profiles"]
    assert lines[0] == (f"profiling tiny_cnn on {dev}: slice 1/2 (2 of 2 cores), "
                        "batch sizes 1,2,4 ...")
    assert lines[1].startswith(f"profiling tiny_cnn on {dev}: slice 2/2 (1 of 2 cores)")
    ap.resolve(cfg, child=fake["cmd"])  # the next start
    assert len(children(fake["log"])) == 2


def test_an_interrupted_profile_is_completed_not_remeasured(cache: Path, fake: dict,
                                                            tmp_path: Path) -> None:
    cfg = load_config(config(tmp_path, TWO_CORES))
    whole = profile_here("tiny_cnn", 2)
    cells = tuple(c for c in whole.cells if c.percent == 100.0)
    part = Profile("tiny_cnn", whole.device, whole.mechanism, whole.batch_sizes, (100.0,),
                   cells, provenance="interrupted")
    part.save(ap.cache_dir(cfg) / "tiny_cnn.json")
    _, got = ap.resolve(cfg, child=fake["cmd"])
    assert [r["percent"] for r in children(fake["log"])] == [50.0]
    assert got["tiny_cnn"].percentages == (50.0, 100.0)
    assert got["tiny_cnn"].cell(4, 100.0) == whole.cell(4, 100.0)  # kept


def test_a_batch_that_failed_to_measure_is_not_measured_at_every_start() -> None:
    here = ap.ThisDevice("cpu", ap.cpu_name(), "cpu-affinity", (0, 1))
    grid = ap.grid_for(here, 4)
    prof = profile_here("tiny_cnn", 2, batches=(1, 2))
    assert not ap.covers(prof, grid, here)
    assert ap.covers(replace(prof, measured={"failed": {"4": "OutOfMemoryError"}}), grid, here)
    assert not ap.covers(prof, grid, replace(here, cores=(0,)))


def test_a_profile_of_another_device_in_the_cache_is_measured_afresh(
        cache: Path, fake: dict, tmp_path: Path) -> None:
    cfg = load_config(config(tmp_path, TWO_CORES))
    profile_here("tiny_cnn", 2, device="Some Other CPU").save(
        ap.cache_dir(cfg) / "tiny_cnn.json")
    _, got = ap.resolve(cfg, child=fake["cmd"])
    assert got["tiny_cnn"].device.name == ap.cpu_name()
    assert len(children(fake["log"])) == 2


def test_aliases_are_measured_once_per_zoo_model(cache: Path, fake: dict,
                                                 tmp_path: Path) -> None:
    cfg = load_config(config(tmp_path, "policy: spatial\ncores: [0]\nmodels:\n"
                                       "  - {name: a, zoo_name: tiny_cnn, max_batch_size: 2}\n"
                                       "  - {name: b, zoo_name: tiny_cnn, max_batch_size: 2}\n"))
    _, by_zoo = ap.resolve(cfg, child=fake["cmd"])
    assert set(by_zoo) == {"tiny_cnn"} and len(children(fake["log"])) == 1


def test_measuring_stops_at_the_time_limit_and_says_so(
        cache: Path, fake: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("AUTO_FAKE_SLEEP", "60")
    cfg = load_config(config(tmp_path, ONE_CORE + "profile_time_limit_s: 1\n"))
    with pytest.raises(ConfigError, match=r"time limit \(profile_time_limit_s: 1 s\)") as e:
        ap.resolve(cfg, child=fake["cmd"])
    assert "next start goes on from there" in str(e.value)
    assert "dstack profile --config" in str(e.value)
    assert any("time limit" in r.getMessage() for r in caplog.records
               if r.levelno == logging.ERROR)


def test_a_served_torchscript_model_cannot_be_measured(cache: Path, tmp_path: Path) -> None:
    (tmp_path / "m.pt").write_bytes(b"")
    cfg = load_config(config(tmp_path, "policy: dstack\nmodels:\n  - name: mine\n"
                                       "    torchscript: m.pt\n    input_shape: [3, 8, 8]\n"
                                       "    num_classes: 2\n"))
    with pytest.raises(ConfigError, match="models.mine: profiles: auto measures zoo models"):
        ap.resolve(cfg)


def test_without_measuring_a_missing_profile_names_dstack_profile(cache: Path,
                                                                  tmp_path: Path) -> None:
    path = config(tmp_path, TWO_CORES)
    with pytest.raises(ap.MissingProfiles, match=f"dstack profile --config {path}"):
        ap.resolve(load_config(path), measure=False, config=path)


# --------------------------------------------------------------------------- another device


def test_profiles_of_another_cpu_get_one_warning_line_and_still_serve(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = tmp_path / "profiles"
    for m in ("tiny_cnn", "resnet18"):
        profile_here(m, 2, device="Intel(R) Xeon(R) Processor").save(d / f"{m}.json")
    cfg = load_config(config(tmp_path, f"policy: dstack\nprofiles: {d}\nmodels:\n"
                                       "  - name: tiny_cnn\n  - name: resnet18\n"))
    caplog.set_level(logging.WARNING, logger="dstack.profiles")
    got = served_profiles(cfg)
    assert set(got) == {"tiny_cnn", "resnet18"}
    served_profiles(cfg)  # a re-plan reads them again: no second line
    lines = [r.getMessage() for r in caplog.records if r.name == "dstack.profiles"]
    assert len(lines) == 1
    assert "Intel(R) Xeon(R) Processor (tiny_cnn, resnet18)" in lines[0]
    assert f"this machine is {ap.cpu_name()}" in lines[0]


def test_profiles_of_this_cpu_get_no_warning(tmp_path: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    d = tmp_path / "profiles"
    profile_here("tiny_cnn", 2).save(d / "tiny_cnn.json")
    cfg = load_config(config(tmp_path, f"policy: dstack\nprofiles: {d}\n"
                                       "models:\n  - name: tiny_cnn\n"))
    served_profiles(cfg)
    assert not [r for r in caplog.records if r.name == "dstack.profiles"]


def test_profiles_of_another_device_kind_are_still_an_error(tmp_path: Path) -> None:
    d = tmp_path / "profiles"
    p = profile_here("tiny_cnn", 2)
    Profile(p.model, DeviceInfo("cuda", "NVIDIA H100", 132, "SMs"), "mps", p.batch_sizes,
            p.percentages, p.cells).save(d / "tiny_cnn.json")
    cfg = load_config(config(tmp_path, f"policy: dstack\nprofiles: {d}\n"
                                       "models:\n  - name: tiny_cnn\n"))
    with pytest.raises(ConfigError, match="measured on cuda"):
        served_profiles(cfg)


def test_scaled_multiplies_every_latency_and_says_so() -> None:
    p = replace(profile_here("tiny_cnn", 2), knee={1: 50.0, 2: 100.0})
    s = scaled(p, 3.0)
    for a, b in zip(p.cells, s.cells, strict=True):
        assert b.p50_ms == pytest.approx(3 * a.p50_ms) and b.p95_ms == pytest.approx(3 * a.p95_ms)
        assert (b.batch, b.percent, b.units) == (a.batch, a.percent, a.units)
    assert s.knee == p.knee and s.device == p.device
    assert p.cell(1, 100.0).p50_ms == 1.0  # the original as it was
    assert "scaled x3" in s.provenance and s.provenance.startswith(p.provenance)
    assert scaled(p, 0.5).cell(1, 100.0).p50_ms == pytest.approx(0.5)
    assert scaled(p, 1.0) is p
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale factor"):
            scaled(p, bad)


# --------------------------------------------------------------------------- the commands


def test_plan_and_simulate_refuse_to_measure_and_name_dstack_profile(
        cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = config(tmp_path, TWO_CORES)
    for cmd in (["plan", "--config", str(path)],
                ["simulate", "--config", str(path), "--duration", "1s",
                 "--policies", "dstack"]):
        assert main(cmd) == 2
        err = capsys.readouterr().err
        assert f"run `dstack profile --config {path}`" in err or (
            f"`dstack profile --config {path}`" in err), err
        assert "no complete profile of tiny_cnn" in err
    assert not cache.exists() or not any(cache.rglob("*.json"))


def test_plan_and_simulate_use_this_machines_cache_and_say_where(
        cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = config(tmp_path, TWO_CORES.replace("max_batch_size: 4", "max_batch_size: 4, "
                                              "slo_ms: 100, rate_rps: 50"))
    cfg = load_config(path)
    profile_here("tiny_cnn", 2).save(ap.cache_dir(cfg) / "tiny_cnn.json")
    assert main(["plan", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"profiles: auto -> {ap.cache_dir(cfg)}" in out and "tiny_cnn" in out
    assert main(["simulate", "--config", str(path), "--duration", "1s",
                 "--policies", "dstack"]) == 0
    assert f"profiles: auto -> {ap.cache_dir(cfg)}" in capsys.readouterr().out
    # a fleet of such machines too
    assert main(["simulate", "--config", str(path), "--duration", "1s", "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert f"profiles: auto -> {ap.cache_dir(cfg)}" in out and "dstack" in out


def test_dstack_profile_measures_into_the_cache_and_prints_a_table(
        cache: Path, fake: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("knee_profiler.sweep.child_command", lambda: list(fake["cmd"]))
    path = config(tmp_path, TWO_CORES)
    assert main(["profile", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    directory = ap.cache_dir(load_config(path))
    assert f"profiles of this machine ({directory.name}) in {directory}" in out
    row = next(ln for ln in out.splitlines() if ln.startswith("tiny_cnn"))
    assert row.split()[1:] == ["1.0", "2.0", "4.0"]  # the fake: b ms at 100%
    assert main(["profile", "--config", str(path)]) == 0  # nothing left to measure
    assert len(children(fake["log"])) == 2
    assert main(["profile", "--config", str(path), "--force"]) == 0
    assert len(children(fake["log"])) == 4
