"""The MIG advisor: placement rules and layout counts (optimizer.mig_layouts), the
assignment MILP against brute force (optimizer.mig), and `dstack mig-advise`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dstack.cli import main
from optimizer.lanes import LaneModel
from optimizer.mig import MigModel, advise, alone, brute_force, unfit_reason
from optimizer.mig_layouts import gpu_names, load_gpu, placements, valid_layouts

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "configs" / "mig-h100-example.yaml"
H100_PROFILES = ROOT / "profiles" / "nvidia-h100-80gb-hbm3"

# The MIG User Guide's A100 table of valid combinations, compute slices left to right by
# start (19 rows); the H100 and A100-80GB have the same placements, so the same rows.
GUIDE_ROWS = {
    "7", "4 3", "4 2 1", "4 1 1 1", "3 3", "3 2 1", "3 1 1 1",
    "2 2 3", "2 1 1 3", "1 1 2 3", "1 1 1 1 3",
    "2 2 2 1", "2 1 1 2 1", "1 1 2 2 1", "1 1 1 1 2 1",
    "2 2 1 1 1", "2 1 1 1 1 1", "1 1 2 1 1 1", "1 1 1 1 1 1 1",
}


@pytest.mark.parametrize("key", ["a100-40gb", "a100-80gb", "h100-80gb"])
def test_layouts_are_the_published_combinations(key):
    gpu = load_gpu(key)
    layouts = valid_layouts(gpu)
    assert len(layouts) == gpu.published_layouts == 19
    rows = {" ".join(str(i.profile.compute) for i in lay) for lay in layouts}
    assert rows == GUIDE_ROWS
    # With the 1g profiles of two memory slices ({0,2,4,6}:2) there are more; derived by
    # hand in docs/mig.md (11 left-half fillings x 7 right-half ones + 7g), not published.
    assert len(valid_layouts(gpu, extra=True)) == 78


def test_placement_rules():
    gpu = load_gpu("a100-40gb")
    seqs = {tuple(str(i) for i in lay) for lay in valid_layouts(gpu)}
    assert ("4g.20gb@0", "3g.20gb@4") in seqs  # 4g + 3g: allowed
    assert not any(lay[0].profile.name == "3g.20gb" and len(lay) > 1
                   and lay[1].profile.name == "4g.20gb" for lay in valid_layouts(gpu))
    assert ("3g.20gb@0", "3g.20gb@4") in seqs
    for lay in placements(gpu, extra=True):
        used = [s for i in lay for s in i.slices]
        assert len(used) == len(set(used))  # no memory slice shared
        assert all(i.start in i.profile.starts for i in lay)
        assert sum(i.profile.compute for i in lay) <= gpu.compute_slices
    assert set(gpu_names()) == {"a100-40gb", "a100-80gb", "h100-80gb"}


def linear(base: float, per: float, knee: float):
    """L(b, p) in ms: base + per * b from the knee up, work-conserving below it."""
    return lambda b, p: (base + per * b) * max(1.0, knee / p)


def model(name: str, lat, slo: float, rate: float, mem_mb: float = 0.0,
          batches=(1, 2, 4, 8), weight: float = 1.0) -> MigModel:
    mem = tuple((b, mem_mb * (1 + 0.1 * b)) for b in batches) if mem_mb else ()
    return MigModel(LaneModel(name, slo, rate, weight, tuple(batches), lat), mem)


@st.composite
def cases(draw):
    n = draw(st.integers(2, 3))
    ms = []
    for i in range(n):
        lat = linear(draw(st.floats(0.5, 8.0)), draw(st.floats(0.05, 2.0)),
                     draw(st.sampled_from([20.0, 40.0, 60.0, 100.0])))
        slo = draw(st.floats(1.2, 12.0)) * lat(1, 100.0)
        mem = draw(st.sampled_from([0.0, 2000.0, 9000.0, 16000.0, 30000.0]))
        ms.append(model(f"m{i}", lat, slo, draw(st.floats(5.0, 3000.0)), mem,
                        weight=draw(st.sampled_from([0.25, 1.0, 4.0]))))
    return ms, draw(st.sampled_from(["a100-40gb", "h100-80gb"])), draw(st.integers(1, 3))


@settings(max_examples=25, deadline=None)
@given(cases())
def test_assignment_equals_brute_force(case):
    models, key, share = case
    gpu = load_gpu(key)
    choice = advise(models, gpu, max_share=share)
    assert choice.value == pytest.approx(brute_force(models, gpu, max_share=share),
                                         rel=1e-6, abs=1e-6)
    assert choice.layout in valid_layouts(gpu)
    seen = [m for g in choice.groups if g for m in g.members]
    assert len(seen) == len(set(seen))  # a model on one instance at most
    for inst, g in zip(choice.layout, choice.groups, strict=True):
        if g is not None:
            assert g.profile.name == inst.profile.name
            assert len(g.members) <= share
            assert g.memory_mb <= inst.profile.memory_mb + 1e-6
    assert choice.value == pytest.approx(sum(g.value for g in choice.groups if g))


def test_alone_on_an_instance_a_batch_may_take_half_the_slo():
    # 2 ms + 1 ms per item at any share from 40% (3g = 42.9% -> 40%), SLO 18 ms. A request
    # may arrive just after a batch started, wait it out and then run: batch 4 (6 ms, 2 x 6
    # <= 18) meets the SLO for every request, 1000 * 4 / 6 = 667 rps; batch 8 (10 ms) only
    # for the (18 - 10) / 10 = 80% that arrive early enough, 0.8 * 800 = 640 rps.
    m = model("m", linear(2.0, 1.0, 40.0), 18.0, 5000.0, batches=(1, 2, 4, 8))
    gpu = load_gpu("h100-80gb")
    three = [p.name for p in gpu.profiles if not p.extra].index("3g.40gb")
    g = alone([m], gpu)[0][three]
    assert g is not None and g.eval.caps == (4,)
    assert g.eval.served_rps[0] == pytest.approx(1000 * 4 / 6)
    m8 = model("m", linear(2.0, 1.0, 40.0), 18.0, 5000.0, batches=(8,))
    assert alone([m8], gpu)[0][three].eval.served_rps[0] == pytest.approx(640.0)


def test_memory_limits_the_instances():
    # 15 GB at batch 1: not on 1g.5gb or 2g.10gb of an A100-40GB, on 3g.20gb and up.
    m = model("big", linear(1.0, 0.1, 100.0), 50.0, 100.0, mem_mb=15000.0 / 1.1)
    gpu = load_gpu("a100-40gb")
    kinds = [p.name for p in gpu.profiles if not p.extra]
    fits = {k: g is not None for k, g in zip(kinds, alone([m], gpu)[0], strict=True)}
    assert fits == {"1g.5gb": False, "2g.10gb": False, "3g.20gb": True, "4g.20gb": True,
                    "7g.40gb": True}


def test_a_model_that_fits_no_instance_is_named_with_its_numbers():
    gpu = load_gpu("a100-40gb")
    slow = model("slow", linear(10.0, 1.0, 100.0), 5.0, 100.0)  # 11 ms at batch 1
    huge = model("huge", linear(1.0, 0.1, 100.0), 100.0, 100.0, mem_mb=50000.0)
    ok = model("ok", linear(1.0, 0.1, 100.0), 50.0, 100.0)
    why = unfit_reason(slow, gpu)
    assert why is not None and "11.00 ms on 7g.40gb" in why and "SLO is 5 ms" in why
    why = unfit_reason(huge, gpu)
    assert why is not None and "55512 MB" in why and "7g.40gb, holds 40000 MB" in why
    choice = advise([slow, huge, ok], gpu)
    assert [i for i, _ in choice.unfit] == [0, 1]
    assert 2 in choice.placed() and choice.value == pytest.approx(100.0)


def test_cli_prints_the_layout_and_its_commands(capsys):
    rc = main(["mig-advise", "--config", str(EXAMPLE), "--profiles", str(H100_PROFILES),
               "--gpu", "h100-80gb"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "best layout:" in out
    assert "sudo nvidia-smi -i 0 -mig 1" in out
    assert "sudo nvidia-smi mig -i 0 -cgi " in out and " -C" in out
    assert "MPS lane plan" in out and "no partitioning (temporal)" in out
    rc = main(["mig-advise", "--config", str(EXAMPLE), "--gpu", "h100-80gb", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert rc == 0 and d["valid_layouts"] == 19
    assert d["commands"][2].startswith("sudo nvidia-smi mig -i 0 -cgi ")
    spec = d["commands"][2].split("-cgi ")[1].split(" ")[0]
    assert spec == ",".join(f"{i['profile']}:{i['start']}" for i in d["instances"])
    assert d["baselines"]["mps"]["weighted_goodput_rps"] > 0


@pytest.mark.parametrize("args, says", [
    (["--gpu", "v100"], "unknown --gpu 'v100'"),
    (["--gpu", "h100-80gb", "--profiles", "/nonexistent/profiles"], "no such profile directory"),
])
def test_cli_errors_are_one_line(capsys, args, says):
    rc = main(["mig-advise", "--config", str(EXAMPLE), *args])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and says in err


def test_cli_names_a_model_without_a_profile(tmp_path, capsys):
    cfg = tmp_path / "deploy.yaml"
    cfg.write_text(f"device: cuda\nprofiles: {H100_PROFILES}\nmodels:\n"
                   "  - {name: resnet18, slo_ms: 20, rate_rps: 100}\n")
    rc = main(["mig-advise", "--config", str(cfg), "--gpu", "a100-40gb"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "resnet18" in err
