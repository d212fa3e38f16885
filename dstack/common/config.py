"""Deployment configuration: one YAML file, validated by pydantic at start-up.

A bad file fails with the field's path and the reason (`ConfigError`), never later.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dstack.common.pauses import SWITCH_INTERVAL_S
from dstack.common.types import ModelSLO, Priority


class ConfigError(ValueError):
    """The deployment file is missing, not YAML, or fails validation (message names the field)."""


class PolicyName(StrEnum):
    TEMPORAL = "temporal"
    SHARED = "shared"
    SPATIAL = "spatial"
    DSTACK = "dstack"


class Batching(StrEnum):
    """How policies `shared` and `spatial` decide a batch is ready (`batching:`)."""

    WINDOW = "window"  # wait at most max_queue_delay_ms from the first queued request
    RATE = "rate"  # wait for b* = k*c / (1 - t*c) items (Zhang et al. 2019)


#: The policies that plan with knee profiles: `profiles:` unset means `auto` for them.
PROFILED_POLICIES = (PolicyName.SPATIAL, PolicyName.DSTACK)


class DeviceKind(StrEnum):
    CPU = "cpu"
    CUDA = "cuda"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    """Address to bind. Loopback by default: expose it on purpose, not by accident."""
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    """TCP port (0 picks a free one)."""
    grpc_port: Annotated[int, Field(ge=0, le=65535)] = 8001
    """TCP port of the KServe v2 / Triton gRPC endpoint (`server.grpc_server`), on `host`,
    in the server's own process; 0 turns it off. Left at its default, a port another
    process holds turns gRPC off with a warning instead of failing the start (a second
    server on the host); set here or with `--grpc-port`, it must be free."""
    allow_client_shm: bool = False
    """Serve Triton's system and CUDA shared-memory extensions (`v2/systemsharedmemory`,
    `v2/cudasharedmemory`, their gRPC RPCs, and tensors read from and written into
    registered regions), as Triton's `--allow-client-shm`; also `dstack serve
    --allow-client-shm`. Only clients on this host (loopback or a Unix socket) may use
    them; others are answered 403 / PERMISSION_DENIED. Off: every such call is answered
    400 / INVALID_ARGUMENT. Over HTTP it needs `frontends` 1 (a front end does not pass
    its client's address on); gRPC is served by the server's own process either way
    (docs/shared-memory.md)."""
    max_body_bytes: Annotated[int, Field(ge=1024)] = 64 * 1024 * 1024
    """Largest request body accepted; larger ones get 413."""
    body_budget_bytes: Annotated[int, Field(ge=1024)] = 256 * 1024 * 1024
    """Bytes of request bodies held in memory at once, all requests together. A request
    whose Content-Length does not fit in what is left gets 503 (with Retry-After) before
    its body is read; a chunked body is counted as it arrives."""
    max_header_bytes: Annotated[int, Field(ge=1024)] = 64 * 1024
    """Largest request header (request line and header fields) read; past it the request
    gets 431 and the connection closes. A header is read as it comes, so without a bound a
    client could send tens of MB of one within the header timeout."""
    header_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    """A client must send a request's whole header within this many seconds of connecting
    (or of the request's first byte on a kept-alive connection), and over TLS complete its
    handshake within it; else it is closed."""
    body_timeout_s: Annotated[float, Field(gt=0)] = 30.0
    """An upload that sends no byte for this many seconds gets 408 and is closed."""
    send_timeout_s: Annotated[float, Field(gt=0)] = 30.0
    """A client that takes none of its answers for this many seconds, while the server holds
    more of them than its socket takes, is disconnected (nginx's `send_timeout`). Meanwhile
    the server reads no more of its requests."""
    keep_alive_s: Annotated[float, Field(gt=0)] = 75.0
    """An HTTP connection kept alive and idle between requests for this many seconds is
    closed. Longer than common clients keep an idle connection in their pools (aiohttp,
    under `tritonclient.http.aio`: 15 s), so that the client drops it first: a server that
    closes first (uvicorn's default, 5 s) races a client sending on it, which then fails
    ("Cannot write to closing transport"). Idle connections count toward
    `max_connections`, where the one idle longest goes first."""
    max_connections: Annotated[int, Field(ge=1)] = 1000
    """Open client connections at most. At the cap a new connection closes the one that
    has waited longest for a request header (half sent, or idle between requests); when
    every connection is inside a request, the new one is answered 503 and closed at once.
    The server raises its own open-files soft limit to this + 256 at start-up (up to the
    hard limit)."""
    dropped_body_bytes_per_s: Annotated[float, Field(ge=0)] = 200e6
    """The rest of a big body (4 MiB or more declared, or chunked) that the server has refused
    is read and dropped at most this fast, all connections together (0: as fast as it
    comes). The refused clients' uploads then take longer, and cannot take the cores that
    the requests the server did take need."""
    max_body_reads: Annotated[int, Field(ge=0)] = 64
    """Request bodies the server's process (each front end, with `frontends` > 1) reads at
    once, at most; fewer (down to 2) while bodies take longer than usual to come, which is
    what reading too many at once does to a busy process (dstack.runtime.reading). A
    request over the limit is refused at its header (429 `work_ahead`), its body unread,
    unless the server keeps up with its model and the model's SLO is `reading.SLO_TIMES`
    (50) times what its slow bodies take (`ReadLimit.holds`).
    0: no limit."""
    hold_refusals: bool = True
    """A request refused for the work ahead of its model (429 `work_ahead`) is answered
    once that work has gone down enough that a request sent then could be taken (the
    refusal's predicted lateness), at most the model's SLO later, instead of at once. A
    client that sends again the moment it is refused (tritonclient in a loop, Locust, a
    retrying proxy) is so paced to what the model serves: answered at once, such clients
    sent over 1,000 requests a second on a 2-core machine, whose uploads took the CPU
    the batches needed, and goodput collapsed (docs/decisions.md). False: at once."""
    shutdown_grace_s: Annotated[float, Field(ge=0)] = 10.0
    """On SIGTERM / SIGINT: how long requests in flight may take to finish (uploads still
    arriving are refused at once with 503); what is still running after it is cancelled."""
    auth_token_file: Path | None = None
    """File holding a bearer token that every request must send (`Authorization: Bearer
    ...`), except on `auth_open_paths`. The environment variable DSTACK_AUTH_TOKEN is
    the alternative; give one or neither. Neither: no authentication."""
    auth_open_paths: tuple[str, ...] = ("/v2/health/", "/metrics")
    """Paths served without a token: an entry ending in "/" is a prefix, others exact."""
    tls_certfile: Path | None = None
    """PEM certificate (chain): serve HTTPS instead of HTTP (uvicorn's ssl_certfile)."""
    tls_keyfile: Path | None = None
    """PEM private key of `tls_certfile` (not needed when the cert file holds the key)."""
    log_level: str = "info"
    frontends: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = "auto"
    """Processes that read, refuse and answer HTTP requests. 1: the server's own process does
    it all. More: that many front-end processes share the listening socket, each under these
    limits (`max_connections` and `body_budget_bytes` shared out among them), and pass
    each request to the server's process, which decides and runs it (docs/frontends.md).
    For a host whose one server process is busier than its device (a GPU host under
    overload); on a machine with few cores they take the workers' cores. `auto`
    (`frontend_processes`): up to 4 on a CUDA device with cores to spare, else 1."""
    decision_timeout_ms: Annotated[float, Field(ge=0)] | None = None
    """With `frontends` > 1, while the server is refusing (a quarter or more of a front
    end's recent header decisions were refusals: under overload): a front end answers an
    infer request's header itself (429 `work_ahead`, as the server's refusals for work
    ahead are) when the server's process has not decided on it within this many ms of its
    first byte, as under overload it may not (its loop busy with the requests it took).
    Bounds how long a refusal at the header takes; a request so refused may have been one
    the server would have taken. At normal load a front end waits for the decision. 0: it
    always waits. Default (`decision_timeout_s`): 3 on a CUDA device, 0 on a CPU device,
    where the server's process shares the cores with the workers' compute and a request
    not decided in time was more often one it would have taken (docs/decisions.md)."""
    switch_interval_ms: Annotated[float, Field(gt=0, le=100)] = 1000 * SWITCH_INTERVAL_S
    """How long a thread of the server's processes (front ends included) that runs Python
    (a re-plan's solve, a model's load) keeps the GIL while the event loop waits for it:
    CPython's switch interval, 5 by default there. At 5 a re-plan beside a busy loop was
    starved for seconds and held the loop 5-8 ms each time it ran (`dstack.common.pauses`)."""
    cores: tuple[int, ...] | None = Field(default=None, min_length=1)
    """CPU cores the server's own process runs on: reading, refusing and answering
    requests (with `frontends` > 1, the front ends run on the other cores this process
    could use), and dispatch. Default: the cores each plan's workers leave free, or, where
    their slices take every core, those of the slice whose models' tightest SLO is the
    longest (`dstack.common.slices.quiet_cores`; moved with a re-plan; the front ends it
    starts share those of the first plan), as on cores the workers compute on it
    pre-empts their batches (`worker_nice`); anywhere on a GPU. On a host with cores to
    spare, give it one the workers' `cores:` leave out. The workers start on the cores the
    server had before it confined itself to these."""

    @model_validator(mode="after")
    def _check(self) -> ServerConfig:
        if self.body_budget_bytes < self.max_body_bytes:
            raise ValueError(
                f"body_budget_bytes ({self.body_budget_bytes}) is below max_body_bytes "
                f"({self.max_body_bytes}): a body of the largest allowed size could never be read"
            )
        if self.tls_keyfile is not None and self.tls_certfile is None:
            raise ValueError("tls_keyfile is given without tls_certfile")
        return self


class ModelConfig(_Strict):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    """The name clients use in URLs. Also the zoo name unless `zoo_name` is given."""
    zoo_name: str | None = None
    """Zoo model to build when `name` is an alias (two copies of one model, say)."""
    slo_ms: Annotated[float, Field(gt=0)] = 100.0
    """Latency objective: a request must be answered within this many ms of arrival."""
    max_batch_size: Annotated[int, Field(ge=1, le=1024)] = 8
    """Largest batch the worker runs; a single request above it is refused (400)."""
    max_queue_delay_ms: Annotated[float, Field(ge=0)] = 2.0
    """Dynamic batching: wait at most this long from the first queued request for more."""
    batching: Batching = Batching.WINDOW
    """Policies shared and spatial: `window` waits up to `max_queue_delay_ms` for more
    requests; `rate` waits for b* = k*c / (1 - t*c) items, from the measured arrival rate c
    and the fitted batch latency k + t*b, capped so that L(b) <= slo_ms / 2 and by
    max_batch_size (the window until a rate is measured). temporal and dstack ignore it."""
    max_queue: Annotated[int, Field(ge=1)] = 1024
    """Bounded queue: requests beyond this many waiting are refused (429)."""
    rate_rps: Annotated[float, Field(ge=0)] = 0.0
    """Expected request rate, for the optimizer (0: unknown)."""
    priority: Priority = Priority.NORMAL
    max_replicas: Annotated[int, Field(ge=1, le=64)] = 4
    """Policy dstack: at most this many workers for the model, side by side, when one
    cannot serve its rate within the SLO (each loads the weights; 1: never)."""
    weights: Path | None = None
    """Local state-dict file (torch.load weights_only=True) or TorchScript file."""
    torchscript: Path | None = None
    """A whole TorchScript module to serve instead of a zoo model."""
    builder: str | None = None
    """`package.module:function` returning an nn.Module, instead of the zoo's builder."""
    input_shape: tuple[int, ...] | None = None
    """Per-item input shape (no batch dimension); needed with `torchscript`/`builder`
    when the model is not in the zoo."""
    num_classes: int | None = None
    """Output width for a `torchscript`/`builder` model not in the zoo."""

    @property
    def zoo(self) -> str:
        return self.zoo_name or self.name

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.torchscript is not None and self.builder is not None:
            raise ValueError("give either torchscript or builder, not both")
        if self.max_queue_delay_ms >= self.slo_ms:
            raise ValueError(
                f"max_queue_delay_ms ({self.max_queue_delay_ms}) must be below slo_ms "
                f"({self.slo_ms}): waiting that long alone would miss the SLO"
            )
        return self

    def slo(self) -> ModelSLO:
        return ModelSLO(self.name, self.slo_ms, self.rate_rps, self.priority)


class AdaptConfig(_Strict):
    enabled: bool = True
    """Re-plan when measured arrival rates drift (policy dstack)."""
    ewma_alpha: Annotated[float, Field(gt=0, le=1)] = 0.2
    """Weight of the newest rate sample in the moving average."""
    sample_s: Annotated[float, Field(gt=0)] = 1.0
    """Rates are sampled every this many seconds."""
    drift: Annotated[float, Field(gt=0)] = 0.25
    """Re-plan when a rate moves by more than this fraction from the planned one."""
    hold_s: Annotated[float, Field(ge=0)] = 5.0
    """Hysteresis: after a re-plan, wait at least this long before another."""
    weigh_switch: bool = True
    """A re-plan that starts workers (a slice changes) is taken only once its predicted
    gain, over as long as the plan in force has lasted, outweighs what their starts cost
    (on a CPU each start takes a core from serving for as long as the worker's last start
    took; on a GPU it costs the device nothing). False: taken whenever it predicts more."""
    down_hold_s: Annotated[float, Field(ge=0)] = 60.0
    """Re-plan for lower rates only once they have stayed low this long (a lull must not
    take slices away from the next burst)."""
    solve_in: Literal["auto", "process", "thread"] = "auto"
    """Where a re-plan is solved: `process`, a small process of its own (started with the
    server, about 40 MB); `thread`, a thread of the serving process, whose 5-20 ms of
    Python then take turns at the GIL with the event loop, which falls that far behind.
    `auto`: a process on a CUDA device, where the loop has a core to itself and every ms
    it loses delays requests in hand; a thread on a CPU device, where the GIL's turns keep
    the solve from taking a second core from the workers (docs/decisions.md)."""


class DeployConfig(_Strict):
    server: ServerConfig = ServerConfig()
    device: DeviceKind = DeviceKind.CPU
    policy: PolicyName = PolicyName.SHARED
    """Scheduling policy: temporal, shared, spatial or dstack (ARCHITECTURE.md)."""
    profiles: Literal["auto"] | Path | None = None
    """Knee profiles (spatial and dstack plan with them): a directory, or `auto`, the
    profiles measured on this very machine, kept in a cache (`$DSTACK_PROFILE_CACHE`, else
    `~/.cache/dstack-serve/profiles`, a directory per device) and measured at start-up
    where missing (`dstack.policies.auto_profiles`; `dstack profile --config FILE` does it
    ahead of time). Unset: `auto` for spatial and dstack, none for the others. (A
    directory named auto: write `./auto`.)"""
    profile_time_limit_s: Annotated[float, Field(gt=0)] = 300.0
    """`profiles: auto`: measuring the missing profiles at start-up stops after this many
    seconds, all models together; the start then fails and says so (what was measured is
    kept, and the next start goes on from there)."""
    cores: tuple[int, ...] | None = None
    """CPU cores the workers may use (default: all this process may use)."""
    adapt: AdaptConfig = AdaptConfig()
    reuse_idle: bool = True
    """Policy dstack: a model with queued work may run in capacity left idle by another
    model's empty slot (never past anyone's bound). False: strictly its own slots."""
    borrow_lanes: Annotated[int, Field(ge=0)] = 2
    """Policy dstack: how many other lanes each model's bursts may borrow while they are
    idle (a guest worker of the model on each, the widest first: a process with the model
    loaded, on that lane's slice). 0: every model keeps to its own lane."""
    rate_headroom: Annotated[float, Field(ge=0, le=10)] = 0.2
    """Policy dstack plans for rate x (1 + rate_headroom): a plan sized for exactly the mean
    rate falls behind on every Poisson burst."""
    profile_margin: Annotated[float, Field(gt=0)] | None = 0.3
    """Policies spatial and dstack: where a worker's warm-up batches of one item take more
    than (1 + this) times, or less than 1 / (1 + this) of, what its model's profile says
    at its slice (a profile measured on another machine, or a machine busier than when it
    was measured), the server says so in one line and plans again, before it serves,
    with that model's profile latencies scaled by the ratio. null: plan with the profiles
    as they are."""
    double_buffer: bool = True
    """Workers get two arena halves: a batch's inputs are written into one while the batch
    before it computes from the other (on CUDA: from pinned memory, on a copy stream), and
    the next batch is sent before the last one's outputs are read. False: one half."""
    cuda_graphs: bool = True
    """Device cuda: each worker replays its model's forward as CUDA graphs, one per batch
    size, as the knee profiles were timed; eager PyTorch spent ~5 ms launching kernels per
    forward on an H100, several times the GPU's own time (dstack/runtime/graphs.py). A
    forward that cannot be captured runs eager, with a warning. False: always eager (a
    model whose rows interact, since a batch is padded to a captured size)."""
    worker_nice: Annotated[int, Field(ge=0, le=19)] | None = None
    """Workers run this much nicer than the server (Linux `nice`): on cores the workers
    share with the server's event loop, reading requests, refusing and answering them go
    before compute. Unset: 10 on a CUDA device (a worker there mostly waits on the GPU);
    0 on a CPU device, whose workers run as CPU-bound batch work instead (`SCHED_BATCH`:
    a worker waking does not pre-empt the server), since at 10 they lost their cores to
    any other program on the host (docs/machines.md has the figures)."""
    models: list[ModelConfig] = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _auto_profiles(cls, data: Any) -> Any:
        """spatial and dstack without `profiles:` plan with `profiles: auto`."""
        if isinstance(data, dict) and data.get("profiles") is None:
            try:
                policy = PolicyName(data.get("policy", PolicyName.SHARED))
            except ValueError:
                return data  # the field's own check names it
            if policy in PROFILED_POLICIES:
                return {**data, "profiles": "auto"}
        return data

    @model_validator(mode="after")
    def _unique(self) -> DeployConfig:
        seen: set[str] = set()
        for m in self.models:
            if m.name in seen:
                raise ValueError(f"model name {m.name!r} appears twice")
            seen.add(m.name)
        return self

    def model(self, name: str) -> ModelConfig:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)


#: `server.frontends: auto` runs at most this many front ends: what a lent H100 host with
#: 16 cores was measured with (docs/frontends.md).
AUTO_FRONTENDS_MAX = 4


#: `server.decision_timeout_ms` on a CUDA device when the config does not say.
CUDA_DECISION_TIMEOUT_MS = 3.0


def decision_timeout_s(cfg: DeployConfig) -> float:
    """The bound a front end puts on the decision about a header, in seconds (0: none):
    `server.decision_timeout_ms`, or by default `CUDA_DECISION_TIMEOUT_MS` on a CUDA
    device and none on a CPU device."""
    ms = cfg.server.decision_timeout_ms
    if ms is None:
        ms = CUDA_DECISION_TIMEOUT_MS if cfg.device == DeviceKind.CUDA else 0.0
    return ms / 1000


def worker_niceness(cfg: DeployConfig) -> int:
    """How much nicer than the server the workers run (`worker_nice`; unset: 10 on a
    CUDA device, 0 on a CPU device)."""
    if cfg.worker_nice is None:
        return 10 if cfg.device == DeviceKind.CUDA else 0
    return cfg.worker_nice


def solve_in_process(cfg: DeployConfig) -> bool:
    """Whether re-plans are solved in a process of their own (`adapt.solve_in`; `auto`:
    on a CUDA device)."""
    if cfg.adapt.solve_in == "auto":
        return cfg.device == DeviceKind.CUDA
    return cfg.adapt.solve_in == "process"


def frontend_processes(cfg: DeployConfig, cores: int) -> int:
    """How many front-end processes `dstack serve` runs for `cfg` on `cores` CPU cores
    (1: none, its own process serves HTTP). `server.frontends: auto`: on a CUDA device,
    where the workers need little CPU and the one server process is the bottleneck, half
    the cores left after the server's process and one per model's worker, up to
    `AUTO_FRONTENDS_MAX` (the other half for the OS and whatever else runs there); on a
    CPU device, or with fewer than two to give, 1 (the workers compute on the cores)."""
    n = cfg.server.frontends
    if n != "auto":
        return n
    if cfg.device != DeviceKind.CUDA:
        return 1
    n = min(AUTO_FRONTENDS_MAX, (cores - 1 - len(cfg.models)) // 2)
    return n if n >= 2 else 1


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "(top level)"
        lines.append(f"  {loc}: {e['msg']}")
    return "\n".join(lines)


def parse_config(data: object, *, source: str = "config") -> DeployConfig:
    try:
        return DeployConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{source} is invalid:\n{_format_errors(e)}") from None


def read_yaml_mapping(path: Path, what: str = "config") -> dict[str, Any]:
    """A YAML file whose top level is a mapping, or a ConfigError saying what is wrong."""
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such {what} file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return raw


def load_config(path: str | Path) -> DeployConfig:
    """Read and validate a deployment YAML file. Relative paths in it are taken relative
    to the file's directory."""
    path = Path(path)
    cfg = parse_config(read_yaml_mapping(path), source=str(path))
    return _resolve_paths(cfg, path.parent)


def _resolve_paths(cfg: DeployConfig, base: Path) -> DeployConfig:
    def fix(p: Path | None) -> Path | None:
        return p if p is None or p.is_absolute() else (base / p).resolve()

    models = [
        m.model_copy(update={"weights": fix(m.weights), "torchscript": fix(m.torchscript)})
        for m in cfg.models
    ]
    srv = cfg.server
    server = srv.model_copy(update={"auth_token_file": fix(srv.auth_token_file),
                                    "tls_certfile": fix(srv.tls_certfile),
                                    "tls_keyfile": fix(srv.tls_keyfile)})
    profiles = cfg.profiles if cfg.profiles == "auto" else fix(cfg.profiles)
    return cfg.model_copy(update={"profiles": profiles, "models": models, "server": server})
