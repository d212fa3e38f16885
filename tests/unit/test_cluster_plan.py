"""dstack.cluster: placement with the `dstack` lane planner as the node scorer, the CLI,
and simulated fleets (on the committed H100 profiles; small instances)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dstack.cli import main
from dstack.cluster.config import parse_cluster
from dstack.cluster.fleet import split_arrivals
from dstack.cluster.planning import ClusterPlanner
from dstack.simulate.workload import generate
from optimizer.placement import better, brute_force, exact, placement_key

ROOT = Path(__file__).resolve().parents[2]
H100 = ROOT / "profiles" / "nvidia-h100-80gb-hbm3"


def cluster(models: list[dict], *, count: int = 2, memory_mb: float = 81559.0,
            resident: tuple[str, ...] = (), extra_nodes: list[dict] | None = None):  # type: ignore[no-untyped-def]
    nodes = [{"name": "h100", "device": "cuda", "profiles": str(H100), "memory_mb": memory_mb,
              "worker_overhead_mb": 500, "count": count, "resident": list(resident)}]
    return parse_cluster({"nodes": nodes + (extra_nodes or []), "models": models})


LIGHT = [
    {"name": "resnet50", "slo_ms": 20, "rate_rps": 2500, "max_batch_size": 64, "max_replicas": 1},
    {"name": "vgg19", "slo_ms": 40, "rate_rps": 1500, "max_batch_size": 64, "max_replicas": 1},
    {"name": "vit_b_16", "slo_ms": 60, "rate_rps": 700, "max_batch_size": 64, "max_replicas": 1},
]


def test_exact_equals_brute_force_with_the_lane_planner() -> None:
    planner = ClusterPlanner(cluster(LIGHT))
    nodes, models = planner.nodes(), planner.demands()
    best, _ = brute_force(nodes, models, planner.score)
    got = exact(nodes, models, planner.score)
    key = placement_key(nodes, models, got, planner.score)
    assert not better(best, key) and not better(key, best)
    # Three heavy models on two devices: the planner needs both.
    assert all(got.copies.values())


def test_memory_is_never_exceeded() -> None:
    # Each H100 worker needs its peak at batch 64 + 500 MB: vgg19 ~4.7 GB, vit ~2.4 GB,
    # resnet50 ~1.5 GB. 5 GB nodes hold vgg19 alone, or the other two together.
    planner = ClusterPlanner(cluster(LIGHT, memory_mb=5000.0))
    for p in (planner.place(), exact(planner.nodes(), planner.demands(), planner.score)):
        mem = {d.name: d.memory_mb["h100"] for d in planner.demands()}
        for node, held in p.copies.items():
            assert sum(c * mem[m] for m, c in held.items()) <= 5000.0, (node, held)
    assert sorted(map(sorted, p.copies.values())) == [["resnet50", "vit_b_16"], ["vgg19"]]


def test_residency_is_kept_when_it_costs_no_goodput() -> None:
    # Two light models, either node serves both: each stays where it is resident.
    models = [{"name": "resnet50", "slo_ms": 20, "rate_rps": 300, "max_batch_size": 64},
              {"name": "mobilenet_v3_large", "slo_ms": 10, "rate_rps": 300,
               "max_batch_size": 64}]
    node_b = {"name": "b", "device": "cuda", "profiles": str(H100), "memory_mb": 81559.0,
              "resident": ["mobilenet_v3_large"]}
    planner = ClusterPlanner(cluster(models, count=1, resident=("resnet50",),
                                     extra_nodes=[node_b]))
    p = planner.place()
    assert p.copies_of("resnet50") == {"h100": 1}
    assert p.copies_of("mobilenet_v3_large") == {"b": 1}
    assert p.starts == 0
    assert not planner.served_whole(p)


def test_split_arrivals_sends_each_request_to_one_copy() -> None:
    arr = generate("poisson", {"a": 200.0, "b": 100.0}, 10.0, 3)
    copies = {"n0": {"a": 1}, "n1": {"a": 1, "b": 1}, "n2": {}}
    parts = split_arrivals(arr, copies, seed=1)
    assert set(parts) == {"n0", "n1"}
    assert sum(p.times.size for p in parts.values()) == arr.times.size
    assert parts["n0"].names == ("a",) and parts["n1"].count("b") == arr.count("b")
    assert abs(parts["n0"].count("a") - arr.count("a") / 2) < 0.1 * arr.count("a")
    assert all(np.all(np.diff(p.times) >= 0) for p in parts.values())


EXAMPLE = ROOT / "configs" / "cluster-h100-example.yaml"


def test_cluster_plan_prints_every_node_and_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cluster", "plan", "--config", str(EXAMPLE), "--plans"]) == 0
    out = capsys.readouterr().out
    for name in ("h100-0", "h100-1", "resnet50", "vgg19", "mobilenet_v3_large", "vit_b_16"):
        assert name in out
    assert "served/expected" in out and "slice%" in out  # placement, then each node's plan


def test_nodes_auto_prints_the_fewest_devices(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cluster", "plan", "--config", str(EXAMPLE), "--nodes", "auto"]) == 0
    out = capsys.readouterr().out
    line = [x for x in out.splitlines() if x.startswith("fewest")][0]
    n = int(line.split(":")[1].split()[0])
    alone = int(line.split("one model per device:")[1].strip(" )"))
    assert 1 <= n <= alone == 4
    # Fewer than that does not serve every model at its rate.
    planner = ClusterPlanner(cluster(parse_models(EXAMPLE)))
    if n > 1:
        p = planner.place(nodes=planner.with_nodes("h100", n - 1))
        assert planner.served_whole(p)


def parse_models(path: Path) -> list[dict]:
    import yaml

    return yaml.safe_load(path.read_text())["models"]


def test_simulate_nodes_runs_the_fleet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(f"""
policy: dstack
device: cuda
profiles: {H100}
models:
  - {{name: resnet50, slo_ms: 20, rate_rps: 2000, max_batch_size: 64}}
  - {{name: vgg19, slo_ms: 40, rate_rps: 600, max_batch_size: 64}}
  - {{name: mobilenet_v3_large, slo_ms: 8, rate_rps: 3000, max_batch_size: 64}}
""")
    assert main(["simulate", "--config", str(deploy), "--nodes", "2", "--duration", "2s"]) == 0
    out = capsys.readouterr().out
    rows = [r for r in out.splitlines() if r.startswith("| dstack") or r.startswith("| ray")]
    assert len(rows) == 3
    goodput = [float(r.split("|")[5]) for r in rows]
    arrived = [float(r.split("|")[4]) for r in rows]
    assert goodput[0] > 0.95 * arrived[0]  # light load: dstack serves nearly everything


def test_a_bad_cluster_file_names_the_field(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "c.yaml"
    bad.write_text(f"nodes: [{{name: n, profiles: {H100}, memory_mb: 100}}]\n"
                   "models: [{name: resnet50, slo_ms: 20}]\n")
    assert main(["cluster", "plan", "--config", str(bad)]) == 2
    assert "rate_rps" in capsys.readouterr().err
