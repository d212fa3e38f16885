"""optimizer.placement: the exact search against brute force, memory, residency, spread.

Most tests use a small fluid scorer (below) so that many random instances run in seconds;
`test_cluster_plan.py` runs the same checks with the `dstack` lane planner as the scorer.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from optimizer.placement import (
    ModelDemand,
    NodeScore,
    NodeSpec,
    better,
    brute_force,
    exact,
    greedy,
    place,
    placement_key,
)

# Per model: device share per rps, and the most one copy serves (rps).
COST = {"a": 0.004, "b": 0.002, "c": 0.01}
PER_COPY = {"a": 150.0, "b": 400.0, "c": 60.0}
WEIGHT = {"a": 1.0, "b": 4.0, "c": 1.0}
CAPACITY = {"small": 0.5, "big": 1.0}


def fluid(kind: str, workers: tuple[tuple[str, int, float], ...]) -> NodeScore:
    """A node serves each copy's rate up to the copy's throughput, all scaled down
    together when the node's capacity is exceeded."""
    served = {m: min(c * rate, c * PER_COPY[m]) for m, c, rate in workers}
    load = sum(COST[m] * s for m, s in served.items())
    if load > CAPACITY[kind]:
        served = {m: s * CAPACITY[kind] / load for m, s in served.items()}
    return NodeScore(sum(WEIGHT[m] * s for m, s in served.items()), served)


def memory_used(placement, nodes, models) -> dict[str, float]:  # type: ignore[no-untyped-def]
    mem = {m.name: m.memory_mb for m in models}
    return {n.name: sum(c * mem[m][n.kind] for m, c in placement.copies[n.name].items())
            for n in nodes}


@st.composite
def instances(draw):  # type: ignore[no-untyped-def]
    names = draw(st.lists(st.sampled_from(sorted(COST)), min_size=1, max_size=3, unique=True))
    n_nodes = draw(st.integers(1, 3))
    models = [ModelDemand(m, draw(st.sampled_from([50.0, 120.0, 300.0])), WEIGHT[m],
                          {k: draw(st.sampled_from([10.0, 30.0, 60.0])) for k in CAPACITY},
                          max_copies=draw(st.integers(1, 2 if len(names) * n_nodes <= 6 else 1)))
              for m in names]
    nodes = [NodeSpec(f"n{i}", draw(st.sampled_from(sorted(CAPACITY))),
                      draw(st.sampled_from([40.0, 70.0, 200.0])),
                      frozenset(draw(st.lists(st.sampled_from(names), max_size=2))))
             for i in range(n_nodes)]
    return nodes, models


@settings(max_examples=60, deadline=None)
@given(instances())
def test_exact_equals_brute_force(inst) -> None:  # type: ignore[no-untyped-def]
    nodes, models = inst
    best, _ = brute_force(nodes, models, fluid)
    got = exact(nodes, models, fluid)
    key = placement_key(nodes, models, got, fluid)
    assert not better(best, key) and not better(key, best), (key, best)
    assert got.proven_optimal


@settings(max_examples=40, deadline=None)
@given(instances())
def test_memory_never_exceeded_and_greedy_never_beats_exact(inst) -> None:  # type: ignore[no-untyped-def]
    nodes, models = inst
    best, _ = brute_force(nodes, models, fluid)
    for p in (exact(nodes, models, fluid), greedy(nodes, models, fluid, time_limit_s=2.0)):
        used = memory_used(p, nodes, models)
        assert all(used[n.name] <= n.memory_mb + 1e-9 for n in nodes), (p.method, used)
        assert all(p.total_copies(m.name) <= m.max_copies for m in models)
        assert not better(placement_key(nodes, models, p, fluid), best)


def test_residency_kept_when_it_costs_no_goodput() -> None:
    models = [ModelDemand("a", 100.0, 1.0, {"big": 10.0}),
              ModelDemand("b", 100.0, 1.0, {"big": 10.0})]
    nodes = [NodeSpec("n0", "big", 100.0), NodeSpec("n1", "big", 100.0, frozenset({"b"})),
             NodeSpec("n2", "big", 100.0, frozenset({"a"}))]
    for p in (exact(nodes, models, fluid), greedy(nodes, models, fluid)):
        assert p.copies_of("a") == {"n2": 1} and p.copies_of("b") == {"n1": 1}, p.method
        assert p.starts == 0


def test_a_model_moves_off_its_node_when_staying_costs_goodput() -> None:
    # Both resident on n0, which holds only one of them in memory: one starts on n1.
    models = [ModelDemand("a", 100.0, 1.0, {"big": 60.0}),
              ModelDemand("b", 100.0, 4.0, {"big": 60.0})]
    nodes = [NodeSpec("n0", "big", 100.0, frozenset({"a", "b"})), NodeSpec("n1", "big", 100.0)]
    for p in (exact(nodes, models, fluid), greedy(nodes, models, fluid)):
        assert p.value == sum(WEIGHT[m] * 100.0 for m in "ab"), p.method
        assert p.starts == 1 and len(p.copies["n0"]) == len(p.copies["n1"]) == 1


def test_a_hot_model_gets_copies_spread_over_nodes() -> None:
    # c serves 60 rps a copy; 110 rps need two copies, and on two nodes they do not stack.
    models = [ModelDemand("c", 110.0, 1.0, {"big": 10.0}, max_copies=3)]
    nodes = [NodeSpec(f"n{i}", "big", 100.0) for i in range(3)]
    for p in (exact(nodes, models, fluid), greedy(nodes, models, fluid)):
        assert p.served["c"] == 110.0
        assert sorted(p.copies_of("c").values()) == [1, 1], p.method


def test_memory_leaves_a_model_out_rather_than_overflow() -> None:
    models = [ModelDemand("a", 100.0, 1.0, {"big": 80.0}),
              ModelDemand("b", 100.0, 4.0, {"big": 80.0})]
    nodes = [NodeSpec("n0", "big", 100.0)]
    p = place(nodes, models, fluid)
    assert p.copies["n0"] == {"b": 1}
    assert p.served["a"] == 0.0


def test_greedy_places_a_large_fleet_within_memory() -> None:
    names = sorted(COST)
    models = [ModelDemand(f"{names[i % 3]}-{i}", 40.0, 1.0, {"big": 25.0 + i % 7})
              for i in range(60)]
    nodes = [NodeSpec(f"n{i}", "big", 180.0) for i in range(16)]

    def scorer(kind: str, workers: tuple[tuple[str, int, float], ...]) -> NodeScore:
        served = {m: min(c * r, c * PER_COPY[m[0]]) for m, c, r in workers}
        load = sum(COST[m[0]] * s for m, s in served.items())
        scale = min(1.0, CAPACITY[kind] / load) if load > 0 else 1.0
        return NodeScore(sum(s * scale for s in served.values()),
                         {m: s * scale for m, s in served.items()})

    p = greedy(nodes, models, scorer, time_limit_s=3.0)
    used = memory_used(p, nodes, models)
    assert all(used[n.name] <= n.memory_mb for n in nodes)
    assert all(p.total_copies(m.name) == 1 for m in models)  # room for every model
