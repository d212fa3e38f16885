"""The model repository at run time (Triton's model repository extension): load a model,
unload one, and each model's state.

Loading re-plans for the new set of models (`setup_policy`; the workers other models have
are kept, replicas included), starts the new model's workers and shadows for every model
whose slice changes, switches when they are ready (`Supervisor.start_shadows` / `switch`,
as a re-plan does), and only then gives the dispatch core the new model and the new
policy, in one step on the event loop. Unloading refuses new requests for the model (503),
lets what is queued finish (answered, or refused by its deadline as always), re-plans for
the rest the same way, then drops the model from the core and stops its workers. Other
models' requests are queued and served all along.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from dstack.common.config import ConfigError, DeployConfig, ModelConfig, PolicyName
from dstack.common.errors import BackendError, ModelNotFound, RequestError, Unavailable
from dstack.common.slices import SliceBackend
from dstack.policies.latency import LinearLatency
from dstack.policies.planning import (
    PolicySetup,
    replica_counts,
    served_profiles,
    setup_policy,
)
from dstack.policies.replicas import public_name, replica_groups, replica_names
from dstack.runtime.dispatch import CoreModel
from dstack.runtime.specs import served_spec
from dstack.runtime.supervisor import Supervisor, passive_models

if TYPE_CHECKING:
    from dstack.runtime.serving import Runtime

log = logging.getLogger("dstack.runtime.repository")

#: Unloading waits this long past the model's SLO for its queue to empty; what is still
#: queued then is refused (a worker that restarts meanwhile, say).
DRAIN_EXTRA_S = 5.0


class ModelState(StrEnum):
    """Triton's model states (`POST /v2/repository/index`)."""

    READY = "READY"
    LOADING = "LOADING"
    UNLOADING = "UNLOADING"
    UNAVAILABLE = "UNAVAILABLE"


@dataclass(frozen=True, slots=True)
class RepoEntry:
    name: str
    state: ModelState
    reason: str = ""


def model_config(rt: Runtime, name: str, raw: dict[str, Any] | None) -> ModelConfig:
    """The config to load `name` with: `raw` (the model's dstack config, as in the YAML
    file's `models:` list) validated, else the one it was served or loaded with.
    RequestError (400) names the bad field; ModelNotFound (404) for a name never seen
    and no config."""
    if raw is None:
        known = rt.known_configs.get(name)
        if known is None:
            raise ModelNotFound(
                f"unknown model {name!r}: not in the repository (known: "
                f"{', '.join(rt.known_configs)}); give its config to load it: "
                '{"parameters": {"config": "{\\"zoo_name\\": ..., \\"slo_ms\\": ...}"}}')
        return known
    if not isinstance(raw, dict):
        raise RequestError("parameters.config must be a JSON object (the model's config)")
    if raw.get("name", name) != name:
        raise RequestError(f"config.name ({raw['name']!r}) is not the model in the URL "
                           f"({name!r})")
    try:
        return ModelConfig.model_validate({**raw, "name": name})
    except ValidationError as e:
        fields = "; ".join(f"config.{'.'.join(str(x) for x in err['loc']) or '(top level)'}: "
                           f"{err['msg']}" for err in e.errors())
        raise RequestError(f"model {name}: bad config: {fields}") from None


def plan_models(cfg: DeployConfig, backend: SliceBackend, current: PolicySetup, *,
                origin: float) -> PolicySetup:
    """The policy for a new set of models (blocking: run it in a thread). Models served
    now keep their number of workers; a new one gets what the planner chooses."""
    replicas: dict[str, int] | None = None
    if cfg.policy is PolicyName.DSTACK and cfg.profiles is not None:
        counts = replica_counts(cfg, served_profiles(cfg, backend=backend), backend)
        names = {m.name for m in cfg.models}
        replicas = {**counts, **{m: n for m, n in current.replicas.items() if m in names}}
    return setup_policy(cfg, backend, origin=origin, replicas=replicas, guests=current.guests)


def _supervisor(rt: Runtime) -> Supervisor:
    if not isinstance(rt.supervisor, Supervisor):
        raise RequestError("this runtime's workers cannot be loaded or unloaded")
    return rt.supervisor


async def load(rt: Runtime, m: ModelConfig) -> None:
    """Serve `m` (not served now): plan, start its workers (and shadows), switch, hand
    over. On failure nothing served changes and the model is UNAVAILABLE with why."""
    sup = _supervisor(rt)
    core = rt.core
    assert core is not None and rt.setup is not None
    name = m.name
    rt.repo_state[name] = RepoEntry(name, ModelState.LOADING)
    rt.known_configs[name] = m
    try:
        spec = served_spec(m)
        cfg = rt.cfg.model_copy(update={"models": [*rt.cfg.models, m]})
        setup = await asyncio.to_thread(plan_models, cfg, rt.slices, rt.setup,
                                        origin=rt.clock())
    except ConfigError as e:
        rt.repo_state[name] = RepoEntry(name, ModelState.UNAVAILABLE, str(e))
        raise RequestError(f"model {name}: {e}") from None
    except Exception as e:
        rt.repo_state[name] = RepoEntry(name, ModelState.UNAVAILABLE, f"planning failed: {e}")
        raise BackendError(f"model {name}: planning failed: {e!r}") from e
    workers = replica_names(name, setup.replicas.get(name, 1))
    slices = setup.policy.slices()
    sup.add_models({name: (m, spec)})
    try:
        shadows = await sup.start_shadows(slices, passive=passive_models(
            slices, setup.policy.concurrent, setup.guests))
    except Exception as e:
        sup.remove_models(list(workers))
        rt.repo_state[name] = RepoEntry(name, ModelState.UNAVAILABLE, f"failed to load: {e}")
        if isinstance(e, RequestError):  # its config's fault (`worker.start_failure`)
            raise RequestError(f"model {name} failed to load: {e}") from None
        raise BackendError(f"model {name} failed to load: {e}") from e
    await sup.switch(shadows, lambda n: n in core.index and core.running(n))
    now = rt.clock()
    estimates = dict(setup.estimates)
    for w in workers:  # no profile: the worker's warm-up timings seed its estimate
        info = shadows[w].ready_info if w in shadows else None
        if info is not None:
            estimates.setdefault(w, LinearLatency.from_points(
                1, info.warm_ms_batch1 / 1000, info.max_batch, info.warm_ms_max / 1000))
    core.add_models([CoreModel(r.name, r.slo_ms / 1000, r.max_batch_size, r.max_queue)
                     for r in setup.run_cfg.models if public_name(r.name) == name], now,
                    groups=replica_groups({name: len(workers)}))
    rt.models_changed(cfg, setup, now, estimates)
    rt.specs[name] = spec
    del rt.repo_state[name]
    log.info("model %s loaded (%d worker%s)", name, len(workers), "s" * (len(workers) > 1))


async def unload(rt: Runtime, name: str, why: str) -> None:
    """Stop serving `name`: refuse new requests (503 naming `why`), finish what is queued,
    re-plan for the rest (shadows first), drop it, stop its workers."""
    sup = _supervisor(rt)
    core = rt.core
    assert core is not None and rt.setup is not None
    if len(rt.cfg.models) == 1:
        raise RequestError(f"model {name} is the only model served: load another first")
    m = rt.cfg.model(name)
    workers = rt.workers(name)
    rt.repo_state[name] = RepoEntry(name, ModelState.UNLOADING, why)
    try:
        until = rt.clock() + m.slo_ms / 1000 + DRAIN_EXTRA_S
        while core.pending(name):  # queued, or in a running batch
            if rt.clock() > until:
                for w in workers:
                    rt.fail_queued(w, Unavailable(f"model {name} was unloaded ({why}) before "
                                                  "this request could run"))
            await asyncio.sleep(0.005)
        cfg = rt.cfg.model_copy(update={"models": [x for x in rt.cfg.models if x.name != name]})
        setup = await asyncio.to_thread(plan_models, cfg, rt.slices, rt.setup,
                                        origin=rt.clock())
        slices = setup.policy.slices()
        shadows = await sup.start_shadows(slices, passive=passive_models(
            slices, setup.policy.concurrent, setup.guests))
        await sup.switch(shadows, core.running)
    except Exception:
        rt.repo_state.pop(name, None)  # still served, as before
        raise
    for w in workers:  # nothing can have been queued since (refused), but be sure
        rt.fail_queued(w, Unavailable(f"model {name} was unloaded ({why})"))
    core.remove_models(list(workers))
    rt.models_changed(cfg, setup, rt.clock(), setup.estimates)
    del rt.specs[name]
    rt.repo_state[name] = RepoEntry(name, ModelState.UNAVAILABLE, f"unloaded ({why})")
    olds = sup.remove_models(list(workers))
    await asyncio.gather(*(o.stop() for o in olds), return_exceptions=True)
    log.info("model %s unloaded (%s)", name, why)
