"""A short `make bench-closed-loop`: a policy's bench-mix server, fitted to this machine
(`bench.fitted`: SLOs and rates scaled by how much slower than its profiles the machine
runs the models), a real `dstack serve` process polled on its readiness endpoint and
stopped by its PID, under two closed-loop tritonclient clients per model for a few seconds.
What a user would notice: the server never fails (5xx), never leaves a request hanging,
and answers every model. Under `dstack` the clients send again the moment they are refused
(as tritonclient in a loop and Locust do), and that must not set off a storm of refusals.
And the benchmark's own accounting: a 429 is counted by the `reason` in its body, and a
refused client waits its pause."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from bench.bench_closed_loop import run_policy
from bench.closed_loop import REFUSAL_PAUSE_S, Target, closed_loop

# Two of the four policies, ~35-60 s each here (most of it the server starting its two
# workers): `temporal` (round robin on the whole device, the policy that refuses the most
# under this load) and `dstack` (the lane plan and re-planning). `make bench-closed-loop`
# runs all four.
SMOKE_POLICIES = ("temporal", "dstack")


@pytest.mark.slow
@pytest.mark.parametrize("policy", SMOKE_POLICIES)
def test_closed_loop_every_model_is_answered_without_5xx_or_hangs(
    policy: str, tmp_path: Path
) -> None:
    pause_s = 0.0 if policy == "dstack" else REFUSAL_PAUSE_S
    counts, _ = run_policy(policy, tmp_path, clients=2, duration_s=3.0, timeout_s=30.0,
                           refusal_pause_s=pause_s)
    assert set(counts) == {"mobilenet_v3_small", "resnet18"}
    log = (tmp_path / f"server-closed-loop-{policy}.log").read_text()[-3000:]
    for model, c in counts.items():
        assert c.sent > 0, (model, log)
        assert not c.server_5xx, (model, dict(c.server_5xx), log)
        assert c.timeouts == 0, (model, f"{c.timeouts} requests not answered in 30 s", log)
        assert c.connection_errors == 0 and c.client_errors == 0, (model, c.to_json(), log)
        assert not c.other_4xx, (model, dict(c.other_4xx))
        assert c.answered > 0, (model, c.to_json())
    if policy == "dstack":
        # Clients that send again at once are paced by held refusals (`server.hold_refusals`):
        # answered at once, they sent over a thousand requests a second and 98% of them
        # were refused, their uploads taking the CPU the batches needed.
        sent = sum(c.sent for c in counts.values())
        answered = sum(c.answered for c in counts.values())
        assert answered >= 0.75 * sent, {m: c.to_json() for m, c in counts.items()}


class _Refuses(BaseHTTPRequestHandler):
    """Refuses every infer request with 429, every other one without a `reason`."""

    count = 0

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).count += 1
        body = {"error": "queue full"} | ({"reason": "queue_full"} if self.count % 2 else {})
        data = json.dumps(body).encode()
        self.send_response(429)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def refusing_server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Refuses)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_a_refusal_is_counted_by_the_reason_in_its_body(refusing_server: str) -> None:
    target = Target("m", 100.0, "INPUT0", (1, 4), "FP32")
    counts = closed_loop(refusing_server, [target], 1, 0.5, timeout_s=5.0)["m"]
    assert counts.sent > 1
    assert counts.answered == 0 and not counts.server_5xx and counts.timeouts == 0
    assert sum(counts.refused.values()) == counts.sent
    assert set(counts.refused) == {"queue_full", "unspecified"}


def test_a_refused_client_waits_its_pause_before_it_sends_again(refusing_server: str) -> None:
    target = Target("m", 100.0, "INPUT0", (1, 4), "FP32")
    counts = closed_loop(refusing_server, [target], 1, 0.5, timeout_s=5.0,
                         refusal_pause_s=0.1)["m"]
    # every refusal is followed by 0.1 s asleep: at most 6 requests in 0.5 s
    assert 1 <= counts.sent <= 6
    assert sum(counts.refused.values()) == counts.sent
