"""The sweep's bookkeeping (resume, --force, failures, rounding) with a fake child.

The fake speaks the real child protocol (`knee_profiler.messages`) without torch, so these
tests take well under a second each; the real child is exercised in
tests/integration/test_knee_profile_cpu.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from dstack.common.types import load_profile
from knee_profiler.slices import CpuAffinity, Mps
from knee_profiler.sweep import ProfilerError, SweepConfig, sweep

FAKE_CHILD = r"""
import json, os, random, sys
from knee_profiler.messages import (CellResult, ChildDone, ChildError, MeasureRequest,
                                    encode)
from knee_profiler.slices import cpu_name
req = MeasureRequest.from_json(sys.stdin.read())
with open(os.environ["KNEE_FAKE_LOG"], "a") as f:
    f.write(json.dumps({"model": req.model, "percent": req.percent,
                        "batches": list(req.batch_sizes), "cores": req.slice_args}) + "\n")
if os.environ.get("KNEE_FAKE_ERROR"):
    print(encode(ChildError(os.environ["KNEE_FAKE_ERROR"])), flush=True)
    sys.exit(1)
die_after = int(os.environ.get("KNEE_FAKE_DIE_AFTER", "-1"))
oom = int(os.environ.get("KNEE_FAKE_OOM_BATCH", "0"))
for i, b in enumerate(req.batch_sizes):
    if i == die_after:
        sys.exit(3)
    if b == oom:
        print(encode(CellResult(batch=b, error="OutOfMemoryError: fake")), flush=True)
        continue
    p50 = 100.0 / req.percent * b * (1 + random.random() / 100)  # differs on re-measure
    units = round(132 * req.percent / 100) if req.device == "cuda" else None
    print(encode(CellResult(b, p50, p50 * 1.1, p50, 1.0 * b, req.repeats, units=units)),
          flush=True)
if req.device == "cuda":  # like MPS: a child sees only its slice's SMs
    done = ChildDone("Fake GPU", 132 if req.percent >= 100 else 0, "SMs", {}, 0.5, "none")
else:
    done = ChildDone(cpu_name(), 0, "cores", {"fake": True}, 0.5, "none")
print(encode(done), flush=True)
"""


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    script = tmp_path / "fake_child.py"
    script.write_text(FAKE_CHILD)
    log = tmp_path / "children.log"
    monkeypatch.setenv("KNEE_FAKE_LOG", str(log))
    return {"cmd": (sys.executable, str(script)), "log": log, "out": tmp_path / "prof"}


def children(log: Path) -> list[dict]:
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


def run(fake: dict, *, force: bool = False, batches=(1, 2), pcts=(50.0, 100.0),
        models=("m",), cores=(0, 1)):
    cfg = SweepConfig(models=tuple(models), device="cpu", batch_sizes=tuple(batches),
                      percentages=tuple(pcts), out_dir=fake["out"], warmup=0, repeats=3,
                      force=force)
    return sweep(cfg, progress=False, mechanism=CpuAffinity(cores=cores), child=fake["cmd"])


def test_one_child_per_slice_and_complete_file(fake: dict) -> None:
    rep = run(fake)
    assert rep.children == 2 and rep.measured_cells == 4 and rep.kept_cells == 0
    assert sorted(c["percent"] for c in children(fake["log"])) == [50.0, 100.0]
    p = load_profile(fake["out"] / "m.json")
    assert p.percentages == (50.0, 100.0) and p.batch_sizes == (1, 2)
    assert p.measured["complete"] is True
    assert p.knee == {1: 100.0, 2: 100.0}  # the fake scales perfectly: 2x slower at 50%
    assert p.memory_mb == {1: 1.0, 2: 2.0}
    assert {(c.batch, c.percent): c.units for c in p.cells}[(1, 50.0)] == 1


def test_second_run_without_force_measures_nothing(fake: dict) -> None:
    run(fake)
    before = load_profile(fake["out"] / "m.json")
    rep = run(fake)
    assert rep.children == 0 and rep.measured_cells == 0 and rep.kept_cells == 4
    assert len(children(fake["log"])) == 2
    after = load_profile(fake["out"] / "m.json")
    assert after.cells == before.cells  # the fake's latencies differ on every measurement


def test_force_measures_everything_again(fake: dict) -> None:
    run(fake)
    before = load_profile(fake["out"] / "m.json")
    rep = run(fake, force=True)
    assert rep.children == 2 and rep.measured_cells == 4
    after = load_profile(fake["out"] / "m.json")
    assert [c.p50_ms for c in after.cells] != [c.p50_ms for c in before.cells]


def test_resume_measures_only_missing_cells(fake: dict) -> None:
    run(fake)
    path = fake["out"] / "m.json"
    d = json.loads(path.read_text())
    d["cells"] = [c for c in d["cells"] if not (c["batch"] == 2 and c["percent"] == 50.0)]
    d["percentages"] = [100.0]
    path.write_text(json.dumps(d))
    kept = {(c["batch"], c["percent"]): c["p50_ms"] for c in d["cells"]}
    rep = run(fake)
    assert rep.measured_cells == 1 and rep.kept_cells == 3
    assert children(fake["log"])[-1]["batches"] == [2]
    assert children(fake["log"])[-1]["percent"] == 50.0
    p = load_profile(path)
    assert p.percentages == (50.0, 100.0)
    for c in p.cells:
        if (c.batch, c.percent) in kept:
            assert c.p50_ms == kept[(c.batch, c.percent)]


def test_interrupted_sweep_keeps_measured_cells_and_resumes(
    fake: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KNEE_FAKE_DIE_AFTER", "1")  # the first child dies after one batch
    with pytest.raises(ProfilerError, match="exited with 3"):
        run(fake)
    partial = load_profile(fake["out"] / "m.json")  # loadable, marked incomplete
    assert partial.measured["complete"] is False
    assert [(c.batch, c.percent) for c in partial.cells] == [(1, 100.0)]
    monkeypatch.delenv("KNEE_FAKE_DIE_AFTER")
    rep = run(fake)
    assert rep.kept_cells == 1 and rep.measured_cells == 3
    assert load_profile(fake["out"] / "m.json").measured["complete"] is True


def test_child_error_is_reported_with_its_message(
    fake: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KNEE_FAKE_ERROR", "MPS is not really active")
    with pytest.raises(ProfilerError, match="MPS is not really active"):
        run(fake)


def test_failed_batch_is_left_out_of_the_grid_and_recorded(
    fake: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KNEE_FAKE_OOM_BATCH", "2")
    rep = run(fake)
    assert len(rep.failed) == 2 and "OutOfMemoryError" in rep.failed[0]
    p = load_profile(fake["out"] / "m.json")
    assert p.batch_sizes == (1,) and p.percentages == (50.0, 100.0)
    assert "2" in p.measured["failed"] and p.measured["complete"] is False


def test_rounded_percentages_measured_once_and_mapped(fake: dict) -> None:
    rep = run(fake, pcts=(10.0, 20.0, 50.0, 60.0, 100.0), cores=(0, 1, 2, 3))
    seen = sorted(c["percent"] for c in children(fake["log"]))
    assert seen == [25.0, 50.0, 75.0, 100.0] and rep.children == 4
    assert [c["cores"]["cores"] for c in children(fake["log"])][0] == [0, 1, 2, 3]
    p = load_profile(fake["out"] / "m.json")
    assert p.measured["percent_map"] == {"10": 25.0, "20": 25.0, "50": 50.0, "60": 75.0,
                                         "100": 100.0}
    by = {(c.batch, c.percent): c for c in p.cells}
    assert by[(1, 25.0)].requested_percent == 20.0 and by[(1, 25.0)].units == 1
    assert by[(1, 50.0)].requested_percent == 50.0 and by[(1, 75.0)].units == 3


def test_existing_file_for_another_device_is_refused(fake: dict) -> None:
    run(fake)
    with pytest.raises(ProfilerError, match="--force"):
        run(fake, cores=(0, 1, 2, 3))


def test_new_batch_size_extends_the_grid(fake: dict) -> None:
    run(fake)
    rep = run(fake, batches=(1, 2, 4))
    assert rep.kept_cells == 4 and rep.measured_cells == 2
    assert load_profile(fake["out"] / "m.json").batch_sizes == (1, 2, 4)


def test_epsilon_change_recomputes_knees_without_measuring(fake: dict) -> None:
    run(fake)
    cfg = SweepConfig(models=("m",), device="cpu", batch_sizes=(1, 2),
                      percentages=(50.0, 100.0), out_dir=fake["out"], epsilon=1.5)
    rep = sweep(cfg, progress=False, mechanism=CpuAffinity(cores=(0, 1)), child=fake["cmd"])
    assert rep.children == 0
    assert load_profile(fake["out"] / "m.json").knee == {1: 50.0, 2: 50.0}


class FakeMps(Mps):
    """MPS's percent mapping without a daemon (the fake child stands in for the GPU)."""

    def open(self) -> None:
        pass


def run_cuda(fake: dict, pcts: tuple[float, ...]):
    cfg = SweepConfig(models=("g",), device="cuda", batch_sizes=(1, 8),
                      percentages=pcts, out_dir=fake["out"], warmup=0, repeats=3)
    return sweep(cfg, progress=False, mechanism=FakeMps(), child=fake["cmd"])


def test_cuda_device_size_comes_from_the_full_slice(fake: dict) -> None:
    rep = run_cuda(fake, (50.0, 100.0))
    assert rep.children == 2
    p = load_profile(fake["out"] / "g.json")
    assert (p.device.name, p.device.units, p.device.unit_kind) == ("Fake GPU", 132, "SMs")
    assert p.cell(8, 50.0).units == 66 and p.cell(8, 100.0).units == 132
    assert p.mechanism == "mps"


def test_cuda_without_100_percent_probes_the_device_once(fake: dict) -> None:
    rep = run_cuda(fake, (25.0, 50.0))
    log = children(fake["log"])
    assert rep.children == 2 and len(log) == 3  # the probe measures nothing
    assert log[0]["percent"] == 100.0 and log[0]["batches"] == []
    assert load_profile(fake["out"] / "g.json").device.units == 132
    rep = run_cuda(fake, (25.0, 50.0, 75.0))  # resume: the file knows the device
    assert rep.children == 1 and len(children(fake["log"])) == 4
