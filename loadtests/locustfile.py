"""Locust load test of a running dstack (or any KServe v2 / Triton HTTP) server.

Needs only the host: at the start of a run it finds the served models with
`POST /v2/repository/index`, their input tensors with `GET /v2/models/{m}`, and each
model's SLO with `GET /v2/models/{m}/config` (dstack's `slo_ms` under `parameters`).
Each user sends one model's KServe v2 infer requests (each new user takes the model with
the fewest users) with binary tensors, built and parsed by `server.codec`'s client
functions (the wire protocol only: nothing else of the server is imported).

`--protocol` (env `DSTACK_PROTOCOL`) says how (`loadtests.protocols`): `http` (binary
tensors, the default), `grpc` (`tritonclient.grpc` at `--grpc-url`, default the host's
name on port 8001; a refusal is UNAVAILABLE) or `shm` (HTTP, the tensors in each user's
own system shared-memory regions: a server on this host with `server.allow_client_shm`).

SLO accounting, per request:
- answered in time (HTTP 200, well-formed, within the model's SLO): a success;
- answered late: a failure named "SLO miss";
- refused (HTTP 429 or 503): a failure named "refused";
- anything else: a failure naming the status and the server's error.

`--slo-ms` (`model=ms,model=ms` or one number for all, env `DSTACK_SLO_MS`) overrides
the server's SLOs, and so does the deployment file `--dstack-config` (env `DSTACK_CONFIG`:
each model's `slo_ms`); `--slo-ms` wins over both. A model with no SLO from any of them
(a server without the config extension) is an error.

Discovery runs once per run: headless (or `--autostart`) when Locust starts, so an
unreachable server is one error line and exit code 1 before any user starts; in the web
UI, where the host may be typed in with the run, when the run starts (an unreachable
server there stops the run, and the error is logged and shown as a failure).

Load: `--rate` is the total offered request rate (rps) at the shape's peak, spread over
the users (each user paces itself at rate/users rps, a closed loop with a throughput
cap). `--shape` picks the user count over time: `steady` (all users for the run),
`steps` (a quarter more users every quarter of the run), `burst` (a quarter of the users,
all of them in the middle fifth of the run). The run lasts `--run-time`.

    locust -f loadtests/locustfile.py --headless -u 4 -t 30s --rate 8 --shape steady \
        --host http://127.0.0.1:8000
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import gevent
import numpy as np
import yaml
from locust import FastHttpUser, LoadTestShape, constant_throughput, events, task

from loadtests.protocols import PROTOCOLS, GrpcSender, ShmSender, grpc_url
from server import codec

# KServe v2 datatype -> numpy dtype (client side; the server has its own table).
NP_DTYPES = {
    "FP32": np.float32,
    "FP16": np.float16,
    "FP64": np.float64,
    "INT64": np.int64,
    "INT32": np.int32,
    "INT16": np.int16,
    "INT8": np.int8,
    "UINT8": np.uint8,
    "BOOL": np.bool_,
}
REFUSED_STATUS = (429, 503)

log = logging.getLogger("dstack.loadtest")


@dataclass(frozen=True, slots=True)
class Target:
    """One served model under test: its SLO and a ready one-item request (its binary
    HTTP body, its input arrays and its outputs' metadata for the other protocols)."""

    model: str
    slo_ms: float
    body: bytes
    headers: dict[str, str]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    outputs: list[dict[str, Any]] = field(default_factory=list)


class DiscoveryError(Exception):
    """The server cannot be read, serves nothing, or a model has no SLO."""


def _http_json(url: str, method: str = "GET") -> Any:
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def _server_slo_ms(host: str, model: str) -> float | None:
    """The SLO in the model's config (`parameters.slo_ms`); None from a server without
    the config extension or without that parameter."""
    try:
        cfg = _http_json(f"{host}/v2/models/{model}/config")
    except urllib.error.HTTPError:
        return None
    value = cfg.get("parameters", {}).get("slo_ms", {}).get("string_value")
    return float(value) if value else None


def discover(host: str, slo_spec: str | None, config: str | None) -> list[Target]:
    """The models `host` serves, each with its SLO (`parse_slos`' overrides first, then
    the server's) and a request body for its inputs. Raises DiscoveryError."""
    host = host.rstrip("/")
    try:
        index = _http_json(f"{host}/v2/repository/index", "POST")
        metas = {m["name"]: _http_json(f"{host}/v2/models/{m['name']}") for m in index}
        server_slos = {name: _server_slo_ms(host, name) for name in metas}
    except urllib.error.HTTPError as e:
        raise DiscoveryError(f"{e.url} answered HTTP {e.code}: is {host} a KServe v2 "
                             "server?") from None
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise DiscoveryError(f"cannot reach the server at {host} ({reason}): start it, "
                             "or pass the right --host") from None
    if not metas:
        raise DiscoveryError(f"the server at {host} serves no models")
    try:
        given = parse_slos(slo_spec, config, list(metas))
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise DiscoveryError(f"bad --slo-ms or --dstack-config: {e}") from None
    slos = {name: ms for name, ms in server_slos.items() if ms is not None} | given
    if missing := sorted(metas.keys() - slos.keys()):
        raise DiscoveryError(f"no SLO for model(s) {', '.join(missing)}: the server reports "
                             "none; pass --slo-ms or --dstack-config")
    return [Target(name, slos[name], *request_body(meta), request_inputs(meta),
                   meta.get("outputs", [])) for name, meta in metas.items()]


def parse_slos(spec: str | None, config: str | None, models: list[str]) -> dict[str, float]:
    """The SLOs in ms given on the command line: `--slo-ms` first, then the deployment
    file; models in neither are left out."""
    slos: dict[str, float] = {}
    if config:
        with open(config) as f:
            raw = yaml.safe_load(f) or {}
        for m in raw.get("models", []):
            if "slo_ms" in m:
                slos[m["name"]] = float(m["slo_ms"])
            else:
                slos[m["name"]] = 100.0  # dstack.common.config's default slo_ms
    if spec:
        if "=" not in spec:
            slos.update(dict.fromkeys(models, float(spec)))
        else:
            for part in spec.split(","):
                name, _, ms = part.partition("=")
                slos[name.strip()] = float(ms)
    return slos


def request_inputs(meta: dict[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    """One item of every input of the model described by `meta`."""
    rng = np.random.default_rng(seed)
    inputs = {}
    for t in meta["inputs"]:
        shape = [1] + [d if d > 0 else 1 for d in t["shape"][1:]]
        dtype = NP_DTYPES[t["datatype"]]
        if np.issubdtype(dtype, np.floating):
            inputs[t["name"]] = rng.random(shape).astype(dtype)
        else:
            inputs[t["name"]] = rng.integers(0, 2, shape).astype(dtype)
    return inputs


def request_body(meta: dict[str, Any], seed: int = 0) -> tuple[bytes, dict[str, str]]:
    """A one-item binary infer request for the model described by `meta`."""
    body, hlen = codec.encode_request(request_inputs(meta, seed))
    headers = {"Content-Type": "application/octet-stream"}
    if hlen is not None:
        headers[codec.HEADER_LENGTH] = str(hlen)
    return body, headers


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    parser.add_argument(
        "--slo-ms",
        default=os.environ.get("DSTACK_SLO_MS"),
        help="SLO in ms: one number, or model=ms,model=ms",
    )
    parser.add_argument(
        "--dstack-config",
        default=os.environ.get("DSTACK_CONFIG"),
        help="deployment YAML to read each model's slo_ms from",
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=float(os.environ.get("DSTACK_RATE", 8)),
        help="total offered request rate (rps) at the shape's peak",
    )
    parser.add_argument(
        "--shape",
        default=os.environ.get("DSTACK_SHAPE", "steady"),
        choices=["steady", "steps", "burst"],
        help="load shape over time",
    )
    parser.add_argument(
        "--protocol",
        default=os.environ.get("DSTACK_PROTOCOL", "http"),
        choices=list(PROTOCOLS),
        help="http (binary tensors), grpc, or shm (HTTP with system shared memory)",
    )
    parser.add_argument(
        "--grpc-url",
        default=os.environ.get("DSTACK_GRPC_URL"),
        help="the gRPC endpoint (host:port) for --protocol grpc; default the host's "
        "name on port 8001",
    )
    parser.add_argument(
        "--outcomes-json",
        default=os.environ.get("DSTACK_OUTCOMES_JSON"),
        help="write each model's exact outcome counts and SLO here at exit "
        "(Locust's CSV is written every second and misses the last one)",
    )


# model -> outcome -> count; outcomes: ok, slo_miss, refused, error
OUTCOMES: dict[str, dict[str, int]] = {}
SLOS_MS: dict[str, float] = {}
# This run's models (found when it starts) and how many users each has now.
TARGETS: list[Target] = []
USERS_PER_MODEL: Counter[str] = Counter()
_FOUND_AT_INIT: set[str] = set()  # hosts discovered at init, for the run about to start


def _tally(model: str, outcome: str) -> None:
    per = OUTCOMES.setdefault(model, {"ok": 0, "slo_miss": 0, "refused": 0, "error": 0})
    per[outcome] += 1


def _discover(environment: Any) -> None:
    """Find this run's models on `environment.host` (raises DiscoveryError)."""
    opts = environment.parsed_options
    TARGETS.clear()  # a failed discovery leaves no stale models behind
    if not environment.host:
        raise DiscoveryError("no host to load test: pass --host (or enter it in the web UI)")
    TARGETS.extend(discover(environment.host, opts.slo_ms, opts.dstack_config))
    SLOS_MS.update({t.model: t.slo_ms for t in TARGETS})
    log.info("load testing %s: %s", environment.host,
             ", ".join(f"{t.model} (SLO {t.slo_ms:g} ms)" for t in TARGETS))


@events.init.add_listener
def _discover_at_init(environment: Any, **_: Any) -> None:
    """Headless and --autostart runs know their host before they start: discover now, so
    that a bad host is one error line and exit code 1 before anything runs."""
    opts = environment.parsed_options
    if opts is None or opts.worker or not (opts.headless or opts.autostart):
        return
    try:
        _discover(environment)
    except DiscoveryError as e:
        log.error("%s", e)
        raise SystemExit(1) from None
    _FOUND_AT_INIT.add(environment.host)


@events.test_start.add_listener
def _discover_at_test_start(environment: Any, **_: Any) -> None:
    """Runs started from the web UI (which may set the host with the run) and on workers
    discover as they start. A failure is logged, shown in the UI as a failed DISCOVER
    request, and stops the run."""
    if environment.host in _FOUND_AT_INIT:
        _FOUND_AT_INIT.discard(environment.host)  # found at init for this very run
        return
    try:
        _discover(environment)
    except DiscoveryError as e:
        log.error("%s", e)
        environment.events.request.fire(
            request_type="DISCOVER", name=environment.host or "(no host)", response_time=0,
            response_length=0, exception=e, context={})
        # Not stopped from here: stop() kills the greenlet that is starting the run.
        gevent.spawn(environment.runner.stop)


@events.quitting.add_listener
def _write_outcomes(environment: Any, **_: Any) -> None:
    path = getattr(environment.parsed_options, "outcomes_json", None)
    if path:
        with open(path, "w") as f:
            json.dump({"outcomes": OUTCOMES, "slo_ms": SLOS_MS}, f, indent=1)


class ModelUser(FastHttpUser):
    """Sends one served model's infer requests. Each new user takes the model with the
    fewest users, so the users spread evenly over the models."""

    target: Target | None = None
    grpc: GrpcSender | None = None
    shm: ShmSender | None = None

    def wait_time(self) -> float:  # type: ignore[override]
        opts = self.environment.parsed_options
        users = max(1, opts.num_users or 1)
        return constant_throughput(opts.rate / users)(self)

    def on_start(self) -> None:
        if not TARGETS:  # discovery failed and the run is stopping: send nothing
            return
        t = self.target = min(TARGETS, key=lambda t: USERS_PER_MODEL[t.model])
        USERS_PER_MODEL[t.model] += 1
        opts = self.environment.parsed_options
        protocol = getattr(opts, "protocol", "http")
        if protocol == "grpc":
            _grpc_under_gevent()
            self.grpc = GrpcSender(grpc_url(self.host, opts.grpc_url), t.model, t.inputs)
        elif protocol == "shm":
            self.shm = ShmSender(self._post, t.model, t.inputs, t.outputs)

    def _post(self, path: str, body: bytes, headers: dict[str, str]) -> int:
        resp = self.client.post(path, data=body, headers=headers, name="shm region")
        return int(resp.status_code)

    def on_stop(self) -> None:
        if self.target is not None:
            USERS_PER_MODEL[self.target.model] -= 1
        for sender in (self.grpc, self.shm):
            if sender is not None:
                sender.close()
        self.grpc = self.shm = None

    @task
    def infer(self) -> None:
        t = self.target
        if t is None:
            return
        if self.grpc is not None:
            self._infer_grpc(t, self.grpc)
            return
        body, headers = (t.body, t.headers) if self.shm is None else (self.shm.body,
                                                                      self.shm.headers)
        t0 = time.perf_counter()
        with self.client.post(
            f"/v2/models/{t.model}/infer",
            data=body,
            headers=headers,
            name=t.model,
            catch_response=True,
        ) as resp:
            elapsed_ms = 1000 * (time.perf_counter() - t0)
            if resp.status_code in REFUSED_STATUS:
                resp.failure("refused")
                _tally(t.model, "refused")
            elif resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {(resp.text or '')[:200]}")
                _tally(t.model, "error")
            else:
                hlen = resp.headers.get(codec.HEADER_LENGTH)
                if self.shm is not None:
                    wrong = self.shm.check(resp.content or b"", hlen)
                else:
                    try:
                        codec.decode_response(resp.content, hlen)
                        wrong = None
                    except ValueError as e:
                        wrong = f"bad response: {e}"
                if wrong is not None:
                    resp.failure(wrong)
                    _tally(t.model, "error")
                    return
                if elapsed_ms > t.slo_ms:
                    resp.failure("SLO miss")
                    _tally(t.model, "slo_miss")
                else:
                    resp.success()
                    _tally(t.model, "ok")


    def _infer_grpc(self, t: Target, sender: GrpcSender) -> None:
        t0 = time.perf_counter()
        out = sender.send()
        elapsed_ms = 1000 * (time.perf_counter() - t0)
        error: Exception | None = None
        if out.status in REFUSED_STATUS:
            error, outcome = Exception("refused"), "refused"
        elif out.status != 200:
            error, outcome = Exception(out.error), "error"
        elif elapsed_ms > t.slo_ms:
            error, outcome = Exception("SLO miss"), "slo_miss"
        else:
            outcome = "ok"
        _tally(t.model, outcome)
        self.environment.events.request.fire(
            request_type="grpc", name=t.model, response_time=elapsed_ms,
            response_length=out.length, exception=error, context={})


_GEVENT_GRPC = False


def _grpc_under_gevent() -> None:
    """grpcio's own threads would block Locust's gevent loop: make it cooperate, once,
    before the first channel (only in a gRPC run: it changes grpcio for the process)."""
    global _GEVENT_GRPC
    if not _GEVENT_GRPC:
        import grpc.experimental.gevent as grpc_gevent

        grpc_gevent.init_gevent()
        _GEVENT_GRPC = True


class DStackShape(LoadTestShape):
    """steady / steps / burst over `--run-time` (see module docstring)."""

    use_common_options = True  # it reads --users, --spawn-rate and --run-time

    def tick(self) -> tuple[int, float] | None:
        opts = self.runner.environment.parsed_options  # type: ignore[union-attr]
        duration = float(opts.run_time or 30)
        t = self.get_run_time()
        if t >= duration:
            return None
        peak = max(1, opts.num_users or 1)
        spawn = float(opts.spawn_rate or peak)
        if opts.shape == "steps":
            step = min(3, int(4 * t / duration))
            return max(1, round(peak * (step + 1) / 4)), spawn
        if opts.shape == "burst":
            in_burst = 0.4 * duration <= t < 0.6 * duration
            return (peak if in_burst else max(1, peak // 4)), max(spawn, peak)
        return peak, spawn
