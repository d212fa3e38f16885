"""Closed-loop load: tritonclient.http clients (gevent: one per process), each sending its
next one-item request as soon as the last one is answered, for a set time; after a refusal
(429), once `refusal_pause_s` has gone by. Every request ends in exactly one outcome:
answered within the model's SLO (send to full answer), answered late, refused with 429 (by
the `reason` of the server's JSON body), another 4xx, a 5xx, a timeout (a hang), a
connection error, or another client-side error.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import queue
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.servers import get_json

TIMEOUT_S = 30.0  # a request not answered in this long is a hang
# A refused client sends again after this long: on a small machine a client that sends again
# at once spins at the rate the server refuses, and its own CPU starves the batches it waits
# for (docs/decisions.md).
REFUSAL_PAUSE_S = 0.005


@dataclass(frozen=True)
class Target:
    """One served model as a client sees it: its input, and the SLO to judge answers by."""

    model: str
    slo_ms: float
    input_name: str
    shape: tuple[int, ...]  # one item: [1, ...]
    datatype: str

    @classmethod
    def from_server(cls, host: str, model: str, slo_ms: float) -> Target:
        """Input name, shape and datatype from the model's metadata (GET /v2/models/m)."""
        t = get_json(f"{host}/v2/models/{model}")["inputs"][0]
        return cls(model, slo_ms, t["name"], (1, *t["shape"][1:]), t["datatype"])


@dataclass
class Counts:
    """The outcomes of one model's requests (one client's, or several added up)."""

    within_slo: int = 0
    late: int = 0
    refused: Counter[str] = field(default_factory=Counter)  # 429 by reason
    other_4xx: Counter[str] = field(default_factory=Counter)  # by status code
    server_5xx: Counter[str] = field(default_factory=Counter)  # by status code
    timeouts: int = 0
    connection_errors: int = 0
    client_errors: int = 0
    latencies_ms: list[float] = field(default_factory=list)  # answered requests
    elapsed_s: float = 0.0  # the longest client's time, first send to last outcome

    @property
    def answered(self) -> int:
        return self.within_slo + self.late

    @property
    def sent(self) -> int:
        return (self.answered + sum(self.refused.values()) + sum(self.other_4xx.values())
                + sum(self.server_5xx.values()) + self.timeouts + self.connection_errors
                + self.client_errors)

    def add(self, other: Counts) -> None:
        for k in ("within_slo", "late", "timeouts", "connection_errors", "client_errors",
                  "refused", "other_4xx", "server_5xx", "latencies_ms"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.elapsed_s = max(self.elapsed_s, other.elapsed_s)

    def to_json(self) -> dict[str, Any]:
        lat = self.latencies_ms
        return {
            "sent": self.sent, "answered": self.answered, "within_slo": self.within_slo,
            "late": self.late, "refused_429": sum(self.refused.values()),
            "refused_by_reason": dict(self.refused), "other_4xx": dict(self.other_4xx),
            "5xx": dict(self.server_5xx), "timeouts": self.timeouts,
            "connection_errors": self.connection_errors, "client_errors": self.client_errors,
            "p50_ms": float(np.percentile(lat, 50)) if lat else None,
            "p99_ms": float(np.percentile(lat, 99)) if lat else None,
            "max_ms": max(lat) if lat else None, "elapsed_s": self.elapsed_s,
        }


def _client_main(url: str, target: Target, seed: int, duration_s: float, timeout_s: float,
                 refusal_pause_s: float, go: Any, results: Any) -> None:
    """One closed-loop client (a child process): connect, report ready, wait for `go`,
    send for `duration_s`, put the counts on `results`."""
    import tritonclient.http as th
    from tritonclient.utils import InferenceServerException

    class KeepErrorBody(th.InferenceServerClient):  # type: ignore[misc]
        """Keeps the body of the last answer that was not 200 (tritonclient keeps only its
        `error`; the server's `reason` is beside it)."""

        error_body = b""

        def _post(self, *args: Any, **kwargs: Any) -> Any:
            response = super()._post(*args, **kwargs)
            if response.status_code == 200:
                return response
            self.error_body = response.read()
            return _ReadAgain(response.status_code, self.error_body)

    rng = np.random.default_rng(seed)
    x = rng.random(target.shape, dtype=np.float32)
    inp = th.InferInput(target.input_name, list(target.shape), target.datatype)
    inp.set_data_from_numpy(x, binary_data=True)
    counts = Counts()
    try:
        client = KeepErrorBody(url, connection_timeout=timeout_s, network_timeout=timeout_s)
    except Exception as e:  # reported to the parent, never raised in a child
        results.put((target.model, None, repr(e)))
        return
    results.put(("ready", None, ""))
    go.wait()
    start = time.perf_counter()
    end = start + duration_s
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        try:
            client.infer(target.model, [inp])
        except InferenceServerException as e:
            status = e.status()
            code = int(status) if status and str(status).isdigit() else 0
            if code == 429:
                counts.refused[_reason(client.error_body)] += 1
                time.sleep(refusal_pause_s)
            elif 400 <= code < 500:
                counts.other_4xx[str(code)] += 1
            elif code >= 500:
                counts.server_5xx[str(code)] += 1
            else:
                counts.client_errors += 1
            continue
        except TimeoutError:
            counts.timeouts += 1
            continue
        except OSError:
            counts.connection_errors += 1
            time.sleep(0.05)  # a refused connection fails at once: do not spin on it
            continue
        except Exception:  # a client-side failure is an outcome too
            counts.client_errors += 1
            continue
        ms = (time.perf_counter() - t0) * 1000
        counts.latencies_ms.append(ms)
        if ms <= target.slo_ms:
            counts.within_slo += 1
        else:
            counts.late += 1
    counts.elapsed_s = time.perf_counter() - start
    client.close()
    results.put((target.model, counts, ""))


class _ReadAgain:
    """A non-200 response whose body was read already, for tritonclient to read again."""

    def __init__(self, status_code: int, body: bytes) -> None:
        self.status_code = status_code
        self._body = body

    def read(self) -> bytes:
        return self._body


def _reason(body: bytes) -> str:
    try:
        reason = json.loads(body).get("reason")
    except (ValueError, AttributeError):
        return "unspecified"
    return str(reason) if reason else "unspecified"


def closed_loop(host: str, targets: list[Target], clients_per_model: int, duration_s: float,
                *, timeout_s: float = TIMEOUT_S, refusal_pause_s: float = REFUSAL_PAUSE_S,
                start_timeout_s: float = 120.0) -> dict[str, Counts]:
    """`clients_per_model` closed-loop clients per target against `host`
    (http://127.0.0.1:PORT) for `duration_s`, all started together once every one is
    connected; the outcomes per model. Every child process is ended (by its own PID) on
    every path: one still running well past `duration_s + timeout_s` is killed."""
    ctx = mp.get_context("spawn")
    go, results = ctx.Event(), ctx.Queue()
    url = host.removeprefix("http://")
    procs = []
    seed = 0
    for t in targets:
        for _ in range(clients_per_model):
            seed += 1
            p = ctx.Process(target=_client_main, name=f"closed-loop {t.model} #{seed}",
                            args=(url, t, seed, duration_s, timeout_s, refusal_pause_s, go,
                                  results),
                            daemon=True)
            p.start()
            procs.append(p)
    out = {t.model: Counts() for t in targets}
    try:
        for _ in procs:
            tag, _, err = results.get(timeout=start_timeout_s)
            if tag != "ready":
                raise RuntimeError(f"closed-loop client for {tag} failed to start: {err}")
        go.set()
        # A client ends at most one timeout (plus its connection's) after `duration_s`.
        deadline = time.monotonic() + duration_s + 2 * timeout_s + 30
        for _ in procs:
            model, counts, _ = results.get(timeout=max(1.0, deadline - time.monotonic()))
            out[model].add(counts)
        for p in procs:
            p.join(10)
    except queue.Empty as e:
        raise RuntimeError("closed-loop clients did not report in time") from e
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    return out
