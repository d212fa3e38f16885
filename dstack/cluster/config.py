"""The cluster file: nodes (devices) and the models served over them.

```yaml
policy: dstack
nodes:
  - name: h100
    device: cuda
    profiles: ../profiles/nvidia-h100-80gb-hbm3
    memory_mb: 81559
    worker_overhead_mb: 500
    count: 8                 # h100-0 ... h100-7
models:
  - {name: resnet50, slo_ms: 20, rate_rps: 2000}
```

Relative paths are relative to the file. Every model needs a `rate_rps` (placement sizes
copies by it); `max_replicas` bounds a model's copies over the whole cluster.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dstack.common.config import (
    AdaptConfig,
    ConfigError,
    DeviceKind,
    ModelConfig,
    PolicyName,
    ServerConfig,
    read_yaml_mapping,
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NodeConfig(_Strict):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    """The node's name (with `count` > 1: the prefix of `name-0`, `name-1`, ...)."""
    device: DeviceKind = DeviceKind.CPU
    profiles: Path
    """Knee profiles measured on this kind of device (every model it may hold)."""
    memory_mb: Annotated[float, Field(gt=0)]
    """Device memory the node's workers may use (GPU memory; RAM on a CPU node)."""
    worker_overhead_mb: Annotated[float, Field(ge=0)] = 0.0
    """Memory a worker takes beyond its profile's `memory_mb` (a CUDA context: ~500)."""
    count: Annotated[int, Field(ge=1, le=4096)] = 1
    """This many identical nodes."""
    num_cpus: Annotated[float, Field(gt=0)] | None = None
    """Ray: CPUs the node's deployment reserves (default: a CPU node's profiled cores; a
    GPU node 1, with `num_gpus: 1`)."""
    resident: tuple[str, ...] = ()
    """Models already loaded there (moving a model costs a start-up)."""
    cores: tuple[Annotated[int, Field(ge=0)], ...] | None = None
    """CPU node: the cores its workers may use (default: every core its process may use).
    The node is then planned as a device of `len(cores)` cores: its profiles (measured on
    `units` cores) are read at the percentages that many cores make (docs/cluster.md)."""

    def names(self) -> list[str]:
        if self.count == 1:
            return [self.name]
        return [f"{self.name}-{i}" for i in range(self.count)]


class RayConfig(_Strict):
    address: str | None = None
    """An existing Ray cluster (`127.0.0.1:6379`; `auto`: the one RAY_ADDRESS or the last
    `ray start` names); none: start a local one of its own."""
    host: str = "127.0.0.1"
    """Address a local Ray binds (loopback unless you mean otherwise)."""


class IngressConfig(_Strict):
    """How the ingress calls the nodes, watches them, and re-places models."""

    call_timeout_slo_factor: Annotated[float, Field(ge=1, le=100)] = 2.0
    """A call to a node is given up after this many times the model's SLO (plus
    `call_timeout_grace_ms`): a node that hangs costs a request at most that long."""
    call_timeout_grace_ms: Annotated[float, Field(ge=0)] = 500.0
    """Added to every call's timeout (the hop through Ray and the transfer of tensors)."""
    retry_min_slo_fraction: Annotated[float, Field(ge=0, le=1)] = 0.25
    """A request whose node failed is retried once on another node holding its model if
    at least this fraction of its SLO is left."""
    health_interval_s: Annotated[float, Field(gt=0, le=60)] = 1.0
    """Every node is pinged this often."""
    ping_timeout_s: Annotated[float, Field(gt=0, le=60)] = 2.0
    dead_after: Annotated[int, Field(ge=1, le=100)] = 2
    """A node that failed this many pings (or calls) in a row, or whose Ray node is gone,
    is dead: its models are placed again on the survivors."""
    replace_dead: bool = True
    """Re-place a dead node's models on the survivors (False: only route around it)."""
    replace_on_drift: bool = True
    """Re-place when the measured rates drift (`adapt`); False: the placement stays as
    started (the nodes' own runtimes still adapt their plans)."""
    drain_timeout_s: Annotated[float, Field(gt=0, le=600)] = 30.0
    """A move stops a model on its old node once its requests there are answered, or
    after this long."""
    start_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 300.0
    """A node's runtime (its workers) must be ready within this long."""


class ClusterConfig(_Strict):
    server: ServerConfig = ServerConfig()
    """The ingress (one KServe v2 endpoint for the whole cluster)."""
    policy: PolicyName = PolicyName.DSTACK
    """Every node's policy."""
    rate_headroom: Annotated[float, Field(ge=0, le=10)] = 0.2
    reuse_idle: bool = True
    adapt: AdaptConfig = AdaptConfig()
    """Re-placement when rates drift: the ingress measures each model's arrival rate
    (`sample_s`, `ewma_alpha`) and places again when one drifts (`drift`, `hold_s`,
    `down_hold_s`); the nodes' own runtimes re-plan their slices with it too."""
    ingress: IngressConfig = IngressConfig()
    ray: RayConfig = RayConfig()
    nodes: list[NodeConfig] = Field(min_length=1)
    models: list[ModelConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _check(self) -> ClusterConfig:
        models = {m.name for m in self.models}
        if len(models) != len(self.models):
            raise ValueError("a model name appears twice")
        seen: set[str] = set()
        for n in self.nodes:
            for name in n.names():
                if name in seen:
                    raise ValueError(f"node name {name!r} appears twice")
                seen.add(name)
            unknown = set(n.resident) - models
            if unknown:
                raise ValueError(f"node {n.name}: resident {sorted(unknown)} are not models")
        for m in self.models:
            if m.rate_rps <= 0:
                raise ValueError(f"model {m.name}: a cluster needs rate_rps (> 0) to place it")
        return self


def parse_cluster(data: object, *, source: str = "cluster config") -> ClusterConfig:
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as e:
        lines = [f"  {'.'.join(str(x) for x in err['loc']) or '(top level)'}: {err['msg']}"
                 for err in e.errors()]
        raise ConfigError(f"{source} is invalid:\n" + "\n".join(lines)) from None


def load_cluster(path: str | Path) -> ClusterConfig:
    """Read and validate a cluster file; relative paths are taken from its directory."""
    path = Path(path)
    cfg = parse_cluster(read_yaml_mapping(path, "cluster"), source=str(path))
    base = path.parent

    def fix(p: Path | None) -> Path | None:
        return p if p is None or p.is_absolute() else (base / p).resolve()

    nodes = [n.model_copy(update={"profiles": fix(n.profiles)}) for n in cfg.nodes]
    models = [m.model_copy(update={"weights": fix(m.weights), "torchscript": fix(m.torchscript)})
              for m in cfg.models]
    return cfg.model_copy(update={"nodes": nodes, "models": models})
