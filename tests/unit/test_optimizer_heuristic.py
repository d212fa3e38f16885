"""The constructive plan on its own: always realisable, never better than the brute force
(it is a heuristic; `solve` proves small instances with the MILP)."""

from __future__ import annotations

import time

import pytest

from optimizer import SolveOptions
from optimizer.formulation import model_input, prune, unplaceable_reason
from optimizer.heuristic import search
from tests.unit.test_optimizer_exact import brute_force, random_instance


@pytest.mark.parametrize("seed", range(0, 200, 10))
def test_heuristic_plan_is_feasible_and_bounded_by_brute_force(seed: int) -> None:
    profiles, slos = random_instance(seed)
    inputs = [model_input(profiles[s.model], s, SolveOptions()) for s in slos]
    alive = [m for m in inputs if unplaceable_reason(m) is None]
    expect = brute_force(profiles, slos)
    if not alive:
        assert expect is None
        return
    lo = min(min(c.latency_ms for c in m.choices) for m in alive)
    found = search([prune(m, lo) for m in alive], time.perf_counter() + 5)
    if found is None:
        return
    assert expect is not None
    ev = found.evaluation
    assert (found.placed_weight, ev.goodput) <= (expect[0] + 1e-9, expect[1] * (1 + 1e-9) + 1e-9)
    for m, c in zip(alive, found.picks, strict=True):
        if c is not None:
            assert ev.cycle_ms + c.latency_ms <= m.slo_ms * (1 + 1e-9)
            assert c.latency_ms <= ev.cycle_ms * (1 + 1e-9)
