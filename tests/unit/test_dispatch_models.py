"""Models added to and removed from the dispatch core at run time (the model repository's
load and unload): the others' queues, positions and counters are untouched."""

from __future__ import annotations

import pytest

from dstack.common.config import PolicyName
from dstack.common.slices import CpuSlices
from dstack.policies.contract import ModelParams
from dstack.policies.registry import make_policy
from dstack.runtime.dispatch import CoreModel, DispatchCore, Ticket


def shared(*names: str) -> object:
    return make_policy(PolicyName.SHARED, {m: ModelParams(m, 4, 0.0, 0.1) for m in names},
                       CpuSlices((0, 1)))


def test_a_model_added_then_removed_leaves_the_others_as_they_were() -> None:
    core = DispatchCore([CoreModel("a", 0.1, 4, 64)], shared("a"), now=0.0)  # type: ignore[arg-type]
    ta = core.admit("a", 1, 0.0)
    assert isinstance(ta, Ticket)
    core.add_models([CoreModel("b", 0.1, 4, 64)], 0.0)
    core.set_policy(shared("a", "b"), 0.0)  # type: ignore[arg-type]
    tb = core.admit("b", 2, 0.001)
    assert isinstance(tb, Ticket) and tb.model == 1 and ta.model == 0
    s = core.step(0.002)
    assert sorted(b.model for b in s.launches) == ["a", "b"]
    for b in s.launches:
        core.complete(b, 0.01, 0.012)
    assert core.counters("b").served == 1 and core.counters("a").served == 1
    with pytest.raises(ValueError, match="served already"):
        core.add_models([CoreModel("b", 0.1, 4, 64)], 0.0)

    busy = core.admit("b", 1, 0.02)
    with pytest.raises(ValueError, match="queued or running"):
        core.remove_models(["b"])  # an unload finishes the queue first
    assert core.drain("b") == (busy,)
    core.remove_models(["b"])
    core.set_policy(shared("a"), 0.02)  # type: ignore[arg-type]
    assert set(core.views()) == {"a"} and "b" not in core.index
    t = core.admit("a", 1, 0.03)
    s = core.step(0.03)
    assert [b.tickets for b in s.launches] == [(t,)] and s.launches[0].index == 0
    # loaded again: a new place, fresh counters
    core.add_models([CoreModel("b", 0.1, 4, 64)], 0.04)
    core.set_policy(shared("a", "b"), 0.04)  # type: ignore[arg-type]
    assert core.index["b"] == 2 and core.counters("b").served == 0
