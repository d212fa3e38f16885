"""Locust load test of a running dstack (or any KServe v2 / Triton HTTP) server.

One user class per served model, found at start-up with `POST /v2/repository/index` and
`GET /v2/models/{m}` (for the input tensors). Each user sends KServe v2 infer requests
with binary tensors, built and parsed by `server.codec`'s client functions (the wire
protocol only: nothing else of the server is imported).

SLO accounting, per request:
- answered in time (HTTP 200, well-formed, within the model's SLO): a success;
- answered late: a failure named "SLO miss";
- refused (HTTP 429 or 503): a failure named "refused";
- anything else: a failure naming the status and the server's error.

The SLO of each model comes from `--slo-ms` (`model=ms,model=ms` or one number for all,
env `DSTACK_SLO_MS`), else from the deployment file `--dstack-config` (env
`DSTACK_CONFIG`: each model's `slo_ms`). A served model with neither is an error.

Load: `--rate` is the total offered request rate (rps) at the shape's peak, spread over
the users (each user paces itself at rate/users rps, a closed loop with a throughput
cap). `--shape` picks the user count over time: `steady` (all users for the run),
`steps` (a quarter more users every quarter of the run), `burst` (a quarter of the users,
all of them in the middle fifth of the run). The run lasts `--run-time`.

The host is needed before Locust parses its options (to make the user classes), so it is
read from `LOCUST_HOST` or `-H/--host` on the command line.

    LOCUST_HOST=http://127.0.0.1:8000 locust -f loadtests/locustfile.py --headless \
        -u 4 -t 30s --rate 8 --shape steady --dstack-config configs/default.yaml
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from typing import Any

import numpy as np
import yaml
from locust import FastHttpUser, LoadTestShape, constant_throughput, events, task

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


def _host_from_argv(argv: list[str]) -> str | None:
    for i, a in enumerate(argv):
        if a in ("-H", "--host") and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--host="):
            return a.split("=", 1)[1]
    return None


def _http_json(url: str, method: str = "GET") -> Any:
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def discover(host: str) -> dict[str, dict[str, Any]]:
    """Served model name -> its KServe v2 metadata."""
    host = host.rstrip("/")
    index = _http_json(f"{host}/v2/repository/index", "POST")
    return {m["name"]: _http_json(f"{host}/v2/models/{m['name']}") for m in index}


def parse_slos(spec: str | None, config: str | None, models: list[str]) -> dict[str, float]:
    """Each model's SLO in ms, from `--slo-ms` first, then the deployment file."""
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
    missing = [m for m in models if m not in slos]
    if missing:
        raise SystemExit(
            f"no SLO for model(s) {', '.join(missing)}: pass --slo-ms or --dstack-config"
        )
    return slos


def request_body(meta: dict[str, Any], seed: int = 0) -> tuple[bytes, dict[str, str]]:
    """A one-item binary infer request for the model described by `meta`."""
    rng = np.random.default_rng(seed)
    inputs = {}
    for t in meta["inputs"]:
        shape = [1] + [d if d > 0 else 1 for d in t["shape"][1:]]
        dtype = NP_DTYPES[t["datatype"]]
        if np.issubdtype(dtype, np.floating):
            inputs[t["name"]] = rng.random(shape).astype(dtype)
        else:
            inputs[t["name"]] = rng.integers(0, 2, shape).astype(dtype)
    body, hlen = codec.encode_request(inputs)
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
        "--outcomes-json",
        default=os.environ.get("DSTACK_OUTCOMES_JSON"),
        help="write each model's exact outcome counts and SLO here at exit "
        "(Locust's CSV is written every second and misses the last one)",
    )


# model -> outcome -> count; outcomes: ok, slo_miss, refused, error
OUTCOMES: dict[str, dict[str, int]] = {}
SLOS_MS: dict[str, float] = {}


def _tally(model: str, outcome: str) -> None:
    per = OUTCOMES.setdefault(model, {"ok": 0, "slo_miss": 0, "refused": 0, "error": 0})
    per[outcome] += 1


@events.quitting.add_listener
def _write_outcomes(environment: Any, **_: Any) -> None:
    path = getattr(environment.parsed_options, "outcomes_json", None)
    if path:
        with open(path, "w") as f:
            json.dump({"outcomes": OUTCOMES, "slo_ms": SLOS_MS}, f, indent=1)


class ModelUser(FastHttpUser):
    """Sends one model's infer requests; subclassed per served model below."""

    abstract = True
    model = ""
    meta: dict[str, Any] = {}
    slo_s = 0.0
    body = b""
    headers: dict[str, str] = {}

    def wait_time(self) -> float:  # type: ignore[override]
        opts = self.environment.parsed_options
        users = max(1, opts.num_users or 1)
        return constant_throughput(opts.rate / users)(self)

    def on_start(self) -> None:
        cls = type(self)
        if not cls.body:
            opts = self.environment.parsed_options
            slos = parse_slos(opts.slo_ms, opts.dstack_config, [cls.model])
            cls.slo_s = slos[cls.model] / 1000
            SLOS_MS[cls.model] = slos[cls.model]
            cls.body, cls.headers = request_body(cls.meta)

    @task
    def infer(self) -> None:
        t0 = time.perf_counter()
        with self.client.post(
            f"/v2/models/{self.model}/infer",
            data=self.body,
            headers=self.headers,
            name=self.model,
            catch_response=True,
        ) as resp:
            elapsed = time.perf_counter() - t0
            if resp.status_code in REFUSED_STATUS:
                resp.failure("refused")
                _tally(self.model, "refused")
            elif resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {(resp.text or '')[:200]}")
                _tally(self.model, "error")
            else:
                try:
                    codec.decode_response(resp.content, resp.headers.get(codec.HEADER_LENGTH))
                except ValueError as e:
                    resp.failure(f"bad response: {e}")
                    _tally(self.model, "error")
                    return
                if elapsed > self.slo_s:
                    resp.failure("SLO miss")
                    _tally(self.model, "slo_miss")
                else:
                    resp.success()
                    _tally(self.model, "ok")


def _make_users() -> dict[str, type[ModelUser]]:
    host = os.environ.get("LOCUST_HOST") or _host_from_argv(sys.argv)
    if not host:
        return {}  # `locust --help` and friends; a run without a host fails in Locust
    users = {}
    for name, meta in discover(host).items():
        cls_name = "User_" + "".join(c if c.isalnum() else "_" for c in name)
        users[cls_name] = type(
            cls_name, (ModelUser,), {"model": name, "meta": meta, "abstract": False}
        )
    return users


globals().update(_make_users())


class DStackShape(LoadTestShape):
    """steady / steps / burst over `--run-time` (see module docstring)."""

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
