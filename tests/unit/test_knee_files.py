"""Profile files: the loader's refusals, import-table, `show` and `plot` on the committed
reference profiles."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dstack.common.types import PROFILE_SCHEMA, ProfileError, load_profile, load_profiles
from knee_profiler.cli import main
from knee_profiler.knee import knee
from knee_profiler.table import TableError, import_table, profiles_from_table

REPO = Path(__file__).resolve().parents[2]
REF = REPO / "profiles" / "reference-v100"
TABLE = REF / "source" / "gpu_latency_vs_mps_percentage.json"


def ref_files() -> list[Path]:
    return sorted(REF.glob("*.json"))


def test_reference_profiles_are_committed_and_load() -> None:
    profs = load_profiles(REF)
    assert sorted(profs) == ["alexnet", "resnet50", "vgg19"]
    rn = profs["resnet50"]
    assert rn.device.kind == "reference" and rn.device.name == "V100 (presumed, ~80 SMs)"
    assert rn.mechanism == "table" and "GSLICE" in rn.provenance
    assert rn.latency_ms(32, 100.0) == 33.7 and rn.latency_ms(1, 10.0) == 11.5
    assert rn.knee[1] == 40.0  # 5.9 ms <= 1.1 x 5.5 ms; 30% is 6.9 ms


def test_import_table_reproduces_the_committed_profiles(tmp_path: Path) -> None:
    written = import_table(TABLE, tmp_path)
    assert [p.name for p in written] == ["alexnet.json", "resnet50.json", "vgg19.json"]
    for p in written:
        assert json.loads(p.read_text()) == json.loads((REF / p.name).read_text())


def test_import_table_knees_follow_the_definition() -> None:
    table = json.loads(TABLE.read_text())
    for prof in profiles_from_table(table):
        for b in prof.batch_sizes:
            row = table["latency_ms"][prof.model][str(b)]
            curve = dict(zip(table["percentages"], row, strict=True))
            assert prof.knee[b] == knee(curve, 0.10)
            assert prof.cell(b, 100.0).p95_ms == prof.cell(b, 100.0).p50_ms


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda t: t.pop("percentages"), "percentages"),
        (lambda t: t["latency_ms"]["vgg19"]["8"].pop(), "vgg19 batch 8"),
        (lambda t: t["latency_ms"]["alexnet"]["1"].__setitem__(0, -1.0), "latency"),
        (lambda t: t.__setitem__("unit", "s"), "expected 'ms'"),
    ],
)
def test_bad_tables_are_refused(mutate, match: str) -> None:
    table = json.loads(TABLE.read_text())
    mutate(table)
    with pytest.raises(TableError, match=match):
        profiles_from_table(table)


# --------------------------------------------------------------------------- loader


@pytest.fixture
def good(tmp_path: Path) -> Path:
    dest = tmp_path / "resnet50.json"
    shutil.copy(REF / "resnet50.json", dest)
    return dest


def test_loader_rejects_truncated_file(good: Path) -> None:
    text = good.read_text()
    good.write_text(text[: len(text) // 2])
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(good)


def test_loader_rejects_other_schema_version(good: Path) -> None:
    d = json.loads(good.read_text())
    d["schema"] = "dstack.profile/0"
    good.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match=r"dstack.profile/0.*re-run knee-profiler"):
        load_profile(good)
    del d["schema"]
    good.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match=PROFILE_SCHEMA):
        load_profile(good)


def test_loader_rejects_missing_cells(good: Path) -> None:
    d = json.loads(good.read_text())
    d["cells"] = [c for c in d["cells"] if not (c["batch"] == 16 and c["percent"] == 30.0)]
    good.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match="missing cells: batch 16 at 30%"):
        load_profile(good)


def test_loader_rejects_p95_below_p50(good: Path) -> None:
    d = json.loads(good.read_text())
    d["cells"][0]["p95_ms"] = d["cells"][0]["p50_ms"] / 2
    good.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match="p95"):
        load_profile(good)


def test_cli_reports_bad_file_without_traceback(good: Path, capsys) -> None:
    good.write_text("{")
    assert main(["show", str(good)]) == 1
    err = capsys.readouterr().err
    assert "not valid JSON" in err and "Traceback" not in err


# --------------------------------------------------------------------------- show, plot


def test_show_on_reference_profiles(capsys) -> None:
    assert main(["show", *map(str, ref_files())]) == 0
    out = capsys.readouterr().out
    assert out.count("V100 (presumed, ~80 SMs)") == 3
    lines = out.splitlines()
    head = next(i for i, ln in enumerate(lines) if "resnet50" in ln)
    table = [ln for ln in lines[head:] if ln.split() and ln.split()[0] == "1"][0].split()
    assert table[1:3] == ["11.500", "7.500"] and table[11] == "40"  # batch 1: knee 40%


def test_show_recomputes_knee_at_another_epsilon(capsys) -> None:
    assert main(["show", str(REF / "resnet50.json"), "--epsilon", "0.5"]) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines()]
    b32 = next(r for r in rows if r and r[0] == "32")
    assert b32[11] == "60"  # 45.7 <= 1.5 x 33.7 = 50.55; 50% is 51.2


def test_plot_on_reference_profiles(tmp_path: Path) -> None:
    out = tmp_path / "sub" / "knee.png"
    assert main(["plot", *map(str, ref_files()), "-o", str(out)]) == 0
    data = out.read_bytes()
    assert len(data) > 10_000 and data[:8] == b"\x89PNG\r\n\x1a\n"
