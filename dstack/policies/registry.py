"""One registry from policy name to the function that builds it.

Adding a policy is adding a class and one entry here; `make_policy` is the only way the
runtime, the simulator and the planning code make a policy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from dstack.common.config import PolicyName
from dstack.common.slices import SliceBackend
from dstack.common.types import Plan, Schedule
from dstack.policies.baselines import SharedPolicy, SpatialPolicy, TemporalPolicy
from dstack.policies.contract import ModelParams, Policy
from dstack.policies.lane_policy import LanePolicy


@dataclass(frozen=True)
class PolicyInputs:
    """What planning worked out for a policy (each policy reads its own fields)."""

    plan: Plan | None = None
    schedule: Schedule | None = None
    knees: dict[str, float] = field(default_factory=dict)
    temporal_batch: dict[str, int] = field(default_factory=dict)
    origin: float = 0.0
    reuse_idle: bool = True
    guests: dict[str, str] = field(default_factory=dict)  # guest worker -> its host


Builder = Callable[[dict[str, ModelParams], SliceBackend, PolicyInputs], Policy]


def _dstack(models: dict[str, ModelParams], backend: SliceBackend, inp: PolicyInputs) -> Policy:
    if inp.plan is None or inp.schedule is None:
        raise ValueError("policy dstack needs a plan and a schedule")
    return LanePolicy(models, backend, inp.plan, inp.schedule, inp.origin,
                      reuse_idle=inp.reuse_idle, guests=inp.guests)


REGISTRY: dict[PolicyName, Builder] = {
    PolicyName.SHARED: lambda models, backend, inp: SharedPolicy(models, backend),
    PolicyName.TEMPORAL: lambda models, backend, inp: TemporalPolicy(
        models, backend, batch=dict(inp.temporal_batch)),
    PolicyName.SPATIAL: lambda models, backend, inp: SpatialPolicy(
        models, backend, knees=dict(inp.knees)),
    PolicyName.DSTACK: _dstack,
}


def make_policy(name: PolicyName, models: dict[str, ModelParams], backend: SliceBackend,
                **inputs: object) -> Policy:
    """The policy `name` for `models` on `backend`; `inputs` are `PolicyInputs` fields."""
    try:
        build = REGISTRY[PolicyName(name)]
    except (KeyError, ValueError):
        raise ValueError(f"unknown policy {name!r}; known: "
                         f"{', '.join(p.value for p in REGISTRY)}") from None
    return build(models, backend, PolicyInputs(**inputs))  # type: ignore[arg-type]
