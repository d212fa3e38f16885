"""`make chaos` (`python -m bench.bench_chaos`): overload, faults and hostile clients against
real `dstack serve` processes on 127.0.0.1, each scenario bounded in count and time (each
function below says what it does), and ONE table (scenario | sent | in SLO | refused by
reason | 4xx | 5xx | hung | conn | server peak / final RSS), then each scenario's notes;
every number in out/chaos/chaos.json; figures and targets in docs/limits.md.

The load generator (`bench.chaos_load.LeanClient`) shares the machine: client-side figures
include its own scheduling delays, and what it costs is taken from the workers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bench import chaos_load as cl
from bench.servers import (
    ROOT,
    Server,
    cpu_s,
    cpu_user_sys_s,
    front_ends,
    get_json,
    model_ready,
    open_sockets,
    rates_slos,
    rss_mb,
    serving,
    write_config,
)
from dstack.common.pauses import freeze_startup_objects
from dstack.common.slices import available_cores, pin_threads

#: The two-model mixes, per `--mix`: `cpu` (this machine's cores as slices) and `h100`
#: (MPS slices of an NVIDIA H100, the overload scenario only).
MIXES = {"cpu": "configs/bench-mix-{}.yaml", "h100": "configs/bench-mix-h100-{}.yaml"}
MIX = {p: ROOT / MIXES["cpu"].format(p) for p in ("dstack", "spatial")}
LOAD_PROCS = 1  # processes the overload scenario's load is sent from (`--load-procs`)
TINY = ROOT / "configs/bench-single-tiny_cnn-shared.yaml"  # the fuzzer's target: cheap
OUT = ROOT / "out/chaos"
Row = dict[str, Any]


def config(policy: str, name: str, server: dict[str, Any] | None = None, *,
           top: dict[str, Any] | None = None) -> Path:
    """The bench mix for `policy` (or TINY) with `server:` and top-level (`top`)
    overrides, under out/chaos."""
    return write_config(MIX.get(policy, TINY), OUT / f"{name}.yaml", server=server,
                        **(top or {}))


def mix(policy: str) -> tuple[dict[str, float], dict[str, float]]:  # rates, SLOs
    return rates_slos(MIX[policy])


def row(scenario: str, t: cl.Tally, srv_pid: int | None, **extra: Any) -> Row:
    r: Row = {"scenario": scenario, "sent": t.sent, "in_slo": t.ok, "late": t.late,
              "refused": dict(t.refused), "other_4xx": t.other_4xx, "5xx": t.err_5xx,
              "hung": t.hung, "conn": t.conn, "non_json_errors": t.non_json_errors,
              "p99_ms": cl.pct(t.latencies_ms, 99),
              "refusal_p50_ms": cl.pct(t.refusal_ms, 50),
              "refusal_p99_ms": cl.pct(t.refusal_ms, 99), "samples_5xx": t.samples_5xx,
              "refusal_p50_p99_ms_by_reason": {
                  k: (round(cl.pct(v, 50), 1), round(cl.pct(v, 99), 1))
                  for k, v in sorted(t.refusal_ms_by_reason.items())}}
    if srv_pid is not None:
        r["peak_rss_mb"] = rss_mb(srv_pid, "VmHWM:")
        r["final_rss_mb"] = rss_mb(srv_pid)
    r.update(extra)
    print(f"  {scenario}: sent {t.sent}, in SLO {t.ok}, late {t.late}, refused "
          f"{dict(t.refused)}, 4xx {t.other_4xx}, 5xx {t.err_5xx}, hung {t.hung}, "
          f"conn {t.conn}" + "".join(f", {k} {_fmt(v)}" for k, v in extra.items()),
          flush=True)
    return r


def _fmt(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def run(coro: Any) -> Any:
    """`asyncio.run(coro)` in a thread of its own, after freezing this process's objects (a
    full collection among earlier windows' results took 45 ms in the middle of a window,
    and each answer in flight was timed that much late)."""
    freeze_startup_objects()
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


# ------------------------------------------------------------------ overload


def calibrate(srv: Server, base: dict[str, float], slos: dict[str, float]) -> float:
    """The knee: the multiple of `base` that gets the most requests answered within SLO
    per second in a short ramp (5 s at each of 4x, 8x, ... 28x)."""
    best, best_good = 4.0, -1.0
    for s in (4.0, 8.0, 12.0, 16.0, 20.0, 24.0, 28.0):
        res, _ = run(cl.open_loop_sharded(srv.host, {m: r * s for m, r in base.items()},
                                          slos, 5.0, seed=int(s * 10), procs=LOAD_PROCS))
        good = sum(t.ok for t in res.values()) / 5.0
        att = min(t.ok / t.sent if t.sent else 0.0 for t in res.values())
        print(f"  calibration x{s:g}: goodput {good:.1f}/s, attainment {100 * att:.1f}% "
              f"(worst model)", flush=True)
        if good > best_good:
            best, best_good = s, good
    return best


LEVELS = (1, 2, 4)  # the overload scenario's loads, as multiples of capacity
#: The control window of each round (`--no-control` leaves it out): 1x of capacity while a
#: process copies memory for as much CPU as the load generator took at 4x beyond 1x. Its
#: goodput against 1x is what the 4x load costs the workers on the client's side alone: on
#: a machine the load generator shares, the most any server could keep at 4x.
CONTROL = "1x+client4x"
_KEYS: tuple[int | str, ...] = (*LEVELS, CONTROL)


def _each(make: Callable[[], Any]) -> Any:
    """A dataclass field: one `make()` per level."""
    return field(default_factory=lambda: {x: make() for x in _KEYS})


@dataclass
class _Levels:
    """One policy's server under the overload scenario, and what its windows measured
    (per level; lists by round)."""

    srv: Server
    base: dict[str, float]
    slos: dict[str, float]
    cap: float
    tallies: dict[int | str, cl.Tally] = _each(cl.Tally)
    good: dict[int | str, list[float]] = _each(list)
    per_model: dict[int | str, dict[str, int]] = _each(dict)
    load_cores: dict[int | str, list[float]] = _each(list)  # the load generator's
    burnt: list[float] = field(default_factory=list)  # the burner's cores, by round


def overload(args: argparse.Namespace) -> list[Row]:
    """Every policy's server up at once (each calibrated alone), then `args.reps` rounds
    of 1x, 2x and 4x of capacity, every policy in turn at each level (the order reversed
    every other round), so that the machine's noise falls on the policies and the levels
    alike. Ratios are medians over the rounds. A server waits idle while another is
    measured."""
    host = available_cores()
    load = tuple(args.load_cores or ())
    with ExitStack() as stack:
        stack.callback(pin_threads, host)
        runs: dict[str, _Levels] = {}
        for policy, n, solve in ((p, k, solve) for p in args.policies for k in args.frontends
                                 for solve in args.solve_in or [None]):
            base, slos = mix(policy)
            # server.frontends: n (1 said: a one-process server whatever `auto` would
            # make of this host), adapt.solve_in: solve (None: its default)
            label = ((policy if n == 1 else f"{policy}+{n}fe")
                     + (f"+solve-{solve}" if solve is not None else ""))
            top = {"adapt": {"solve_in": solve}} if solve is not None else {}
            if load:  # the server and its workers start on the cores the load leaves
                pin_threads(tuple(c for c in host if c not in load))
            srv = stack.enter_context(serving(
                config(policy, f"overload-{label}", {"frontends": n}, top=top),
                OUT / f"overload-{label}.log"))
            if load:
                pin_threads(load)
            run(cl.open_loop(srv.host, {m: min(r, 5.0) for m, r in base.items()}, slos, 2.0))
            cap = args.capacity_scale or calibrate(srv, base, slos)
            args.capacity[label] = cap
            print(f"  {label}: capacity = {cap:g}x the mix ("
                  + ", ".join(f"{m} {r * cap:g} rps" for m, r in base.items()) + ")",
                  flush=True)
            runs[label] = _Levels(srv, base, slos, cap)
        for rep in range(args.reps):
            order = list(runs) if rep % 2 == 0 else list(reversed(runs))
            for x in LEVELS:  # the policies' windows of one level one after the other
                for policy in order:
                    _window(runs[policy], policy, x, rep, args)
            for policy in order if args.control else ():
                lv = runs[policy]
                with cl.Burner(max(0.0, lv.load_cores[4][-1] - lv.load_cores[1][-1])) as burner:
                    _window(lv, policy, CONTROL, rep, args, burner)
        rows = []
        secs = args.reps * args.overload_seconds
        for policy, lv in runs.items():
            for x in _KEYS if args.control else LEVELS:
                t = lv.tallies[x]
                ratios = [g / g1 if g1 else float("nan")
                          for g, g1 in zip(lv.good[x], lv.good[1], strict=True)]
                extra = {"offered_rps": lv.cap * _times(x) * sum(lv.base.values()),
                         "goodput_rps": statistics.median(lv.good[x]),
                         "goodput_vs_1x": statistics.median(ratios),
                         "goodput_vs_1x_rounds": [round(r, 2) for r in ratios],
                         "accepted_in_slo": t.ok / t.accepted if t.accepted else float("nan")}
                for m, ok in lv.per_model[x].items():
                    extra[f"goodput_{m}"] = ok / secs
                    one = lv.per_model[1].get(m, 0)
                    extra[f"goodput_{m}_vs_1x"] = ok / one if one else float("nan")
                for other, ov in runs.items():  # side by side, round by round
                    if other != policy and policy.startswith("dstack"):
                        by_round = [g / o if o else float("nan")
                                    for g, o in zip(lv.good[x], ov.good[x], strict=True)]
                        extra[f"goodput_vs_{other}"] = statistics.median(by_round)
                        extra[f"goodput_vs_{other}_rounds"] = [round(r, 2) for r in by_round]
                if x == CONTROL:
                    extra["client_4x_extra_cores_rounds"] = [
                        round(a - b, 2) for a, b in zip(lv.load_cores[4], lv.load_cores[1],
                                                        strict=True)]
                    extra["burnt_cores_rounds"] = [round(c, 2) for c in lv.burnt]
                rows.append(row(f"overload {policy} {_label(x)} ({args.reps} x "
                                f"{args.overload_seconds:g} s)", t, lv.srv.pid, **extra))
        return rows


def _times(x: int | str) -> int:
    return 1 if x == CONTROL else int(x)


def _label(x: int | str) -> str:
    return "1x+client 4x CPU" if x == CONTROL else f"{x}x"


def _window(lv: _Levels, policy: str, x: int | str, rep: int, args: argparse.Namespace,
            burner: cl.Burner | None = None) -> None:
    """One window of level `x` (a multiple of `policy`'s capacity, or CONTROL while
    `burner` runs), added to `lv`; the load generator's cores (and the burner's) kept."""
    rates = {m: r * lv.cap * _times(x) for m, r in lv.base.items()}
    load0 = sum(os.times()[:2])
    burnt0 = cpu_s(burner.pid) if burner is not None else 0.0
    t0, began = time.monotonic(), time.strftime("%H:%M:%S", time.gmtime())
    res, shards_cpu = run(cl.open_loop_sharded(lv.srv.host, rates, lv.slos,
                                               args.overload_seconds, seed=100 * rep + _times(x),
                                               procs=LOAD_PROCS))
    wall = time.monotonic() - t0
    lv.load_cores[x].append((sum(os.times()[:2]) - load0 + shards_cpu) / wall)
    if burner is not None:
        lv.burnt.append((cpu_s(burner.pid) - burnt0) / wall)
    t = cl.total(res)
    lv.tallies[x].add(t)
    lv.good[x].append(t.ok / args.overload_seconds)
    for m, tm in res.items():
        lv.per_model[x][m] = lv.per_model[x].get(m, 0) + tm.ok
    print(f"    round {rep + 1} {policy} {_label(x)} (from {began} UTC): goodput "
          f"{lv.good[x][-1]:.1f}/s, sent {t.sent}, refused {dict(t.refused)}, hung {t.hung}, "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)


# ------------------------------------------------------------------ faults, hostile clients


def _capacity(args: argparse.Namespace) -> float:
    """The dstack mix's capacity (a multiple of rate_rps): given, calibrated by the overload
    scenario, else 2 (what calibration found on this 2-core machine)."""
    return args.capacity_scale or args.capacity.get("dstack", 2.0)


def worker_kill(args: argparse.Namespace) -> Row:
    base, slos = mix("dstack")
    with serving(config("dstack", "kill"), OUT / "kill.log") as srv:
        pid = srv.worker_pid("resnet18")
        rates = {m: r * 0.7 * _capacity(args) for m, r in base.items()}

        async def go() -> tuple[dict[str, cl.Tally], float]:
            load = asyncio.create_task(cl.open_loop(srv.host, rates, slos, 12.0))
            await asyncio.sleep(3)
            os.kill(pid, signal.SIGKILL)
            t_kill = time.monotonic()
            back = float("nan")
            while time.monotonic() - t_kill < 60:
                await asyncio.sleep(0.25)
                if await asyncio.to_thread(model_ready, srv.host, "resnet18"):
                    back = time.monotonic() - t_kill
                    break
            return await load, back

        res, back = run(go())
        mnv3 = res["mobilenet_v3_small"]
        return row("worker kill -9 (resnet18) at 0.7x", cl.total(res), srv.pid,
                   resnet18_ready_again_s=back, mobilenet_5xx=mnv3.err_5xx,
                   mobilenet_in_slo=mnv3.ok, mobilenet_sent=mnv3.sent)


def big_bodies(args: argparse.Namespace) -> Row:
    """5 storms of 20 concurrent JSON bodies of 20 MB each (sent by a child:
    cl.BigBodySender), beside 4x the mix's rate. The other traffic's p99 per model counts
    the requests under way during a storm, against the same load without bodies just
    before (a server that ends a storm sooner is not credited with the quiet time after)."""
    base, slos = mix("dstack")
    rates = {m: r * 4.0 for m, r in base.items()}
    with serving(config("dstack", "bodies"), OUT / "bodies.log") as srv, \
            cl.BigBodySender(f"{srv.host}/v2/models/mobilenet_v3_small/infer", 20, 20.0) as sender:
        run(cl.open_loop(srv.host, rates, slos, 2.0))
        quiet = run(cl.open_loop(srv.host, rates, slos, 12.0, seed=4))
        before, cpu0 = rss_mb(srv.pid), cpu_s(srv.pid)
        spans: list[tuple[float, float]] = []
        bigs: list[cl.BigBodiesResult] = []

        async def storms() -> dict[str, cl.Tally]:
            stop = asyncio.Event()
            load = asyncio.create_task(cl.open_loop(srv.host, rates, slos, 3600, seed=5,
                                                    stop=stop))
            for _ in range(5):
                await asyncio.sleep(0.5)
                t0 = time.perf_counter()
                bigs.append(await sender.send())
                spans.append((t0, time.perf_counter()))
            await asyncio.sleep(0.5)
            stop.set()
            return await load

        res = run(storms())
        cpu = cpu_s(srv.pid) - cpu0
        time.sleep(2)
        after = rss_mb(srv.pid)
        during = {m: res[m].latencies_within(spans) for m in res}
        p99 = {m: (round(cl.pct(quiet[m].latencies_ms, 99), 1), round(cl.pct(during[m], 99), 1))
               for m in res}
        statuses: Counter[str] = Counter()
        for b in bigs:
            statuses.update(b.statuses)
        slowest = {k: round(max(b.slowest_s.get(k, 0.0) for b in bigs), 2) for k in statuses}
        return row(f"5 x 20 x {sender.body_bytes / 1e6:.0f} MB JSON bodies", cl.total(res),
                   srv.pid, big_body_statuses=dict(sorted(statuses.items())),
                   big_body_slowest_answer_s=slowest,
                   storm_s=[round(b - a, 2) for a, b in spans],
                   sender_cpu_s=round(sum(b.cpu_s for b in bigs), 1),
                   server_cpu_s=round(cpu, 1),
                   answers_during_storms_by_model={m: len(v) for m, v in during.items()},
                   p99_unloaded_storm_ms_by_model=p99,
                   p99_ratio_by_model={m: round(b / a, 2) for m, (a, b) in p99.items()},
                   rss_before_mb=before, rss_after_mb=after)


def refusal_cost(args: argparse.Namespace) -> list[Row]:
    """What a refusal from the header costs the server: the dstack mix with SLOs of 1 ms
    (no plan meets them: every request is refused from its header, `unplanned`), 20,000
    one-item resnet18 requests (600 KB bodies); see `_server_cost`."""
    out = []
    for n in args.frontends:
        cfg = config("dstack", f"refusal-cost-{n}", {"frontends": n})
        spec = yaml.safe_load(cfg.read_text())
        for m in spec["models"]:
            m["slo_ms"], m["max_queue_delay_ms"] = 1, 0.5
        cfg.write_text(yaml.safe_dump(spec))
        out.append(_server_cost(cfg, "resnet18", 20_000, "refusal cost (resnet18", n))
    return out


#: One model of next to no compute on a 600 KB input, every request answered.
ACCEPT_CONFIG = {"device": "cpu", "policy": "shared", "worker_nice": 0, "models": [
    {"name": "image", "zoo_name": "pool_linear", "slo_ms": 1000, "max_batch_size": 8,
     "max_queue_delay_ms": 0}]}


def accept_cost(args: argparse.Namespace) -> list[Row]:
    """What an answered request costs the server's processes, the worker's compute aside:
    5,000 one-item requests of `ACCEPT_CONFIG`'s model (`answered_per_s` under `per_s`
    says some were refused: their CPU is in the figures); see `_server_cost`."""
    out = []
    for n in args.frontends:
        cfg = OUT / f"accept-cost-{n}.yaml"
        cfg.write_text(yaml.safe_dump({**ACCEPT_CONFIG, "server": {"frontends": n}}))
        out.append(_server_cost(cfg, "image", 5_000, "accept cost (pool_linear", n))
    return out


def _server_cost(cfg: Path, model: str, n: int, label: str, frontends: int) -> Row:
    """`n` one-item requests of `model` back to back on 8 kept-alive connections to a
    server of `cfg` (once per `--frontends` value): its CPU per request, user and kernel
    (`server_*`: with front ends, the dispatch process's), and the front ends' together
    (`frontends_us`), from /proc."""
    conns = 8
    with serving(cfg, OUT / f"{cfg.stem}.log") as srv:
        meta = get_json(f"{srv.host}/v2/models/{model}")
        tally = cl.Tally()

        async def send(client: cl.LeanClient, req: bytes, k: int) -> None:
            for _ in range(k):
                t0 = time.perf_counter()
                status, body, headers = await client.send(req, 10)
                tally.record(status, body, headers, (time.perf_counter() - t0) * 1000, 1e9)

        async def all_of(k: int) -> None:
            client = cl.LeanClient(srv.host)
            req = client.post(f"/v2/models/{model}/infer", *cl.one_item_body(meta))
            try:
                await asyncio.gather(*(send(client, req, k // conns) for _ in range(conns)))
            finally:
                client.close()

        run(all_of(conns * 25))  # warm
        tally = cl.Tally()
        fronts = front_ends(srv.pid)
        user0, sys0 = cpu_user_sys_s(srv.pid)
        front0 = sum(sum(cpu_user_sys_s(p)) for p in fronts)
        t0 = time.monotonic()
        run(all_of(n))
        wall = time.monotonic() - t0
        user1, sys1 = cpu_user_sys_s(srv.pid)
        front1 = sum(sum(cpu_user_sys_s(p)) for p in fronts)
        where = f", {frontends} front ends" if frontends > 1 else ""
        return row(f"{label}, 600 KB bodies{where})", tally, srv.pid,
                   per_s=tally.sent / wall, answered_per_s=tally.accepted / wall,
                   server_user_us=1e6 * (user1 - user0) / tally.sent,
                   server_kernel_us=1e6 * (sys1 - sys0) / tally.sent,
                   **({"frontends_us": 1e6 * (front1 - front0) / tally.sent} if fronts else {}))


def slowloris(args: argparse.Namespace) -> Row:
    """1,000 half-header sockets, kept open for one header timeout and 2 s (the attacker
    opens again, 0.1 s later, every socket the server closes), beside 0.5x load sent each
    request on a new connection (as from many clients: what a full connection cap turns
    away). Reported: that load's p99 against the same load unloaded, its 503s, and how
    and when the server closed the stalled sockets (each socket's life from its connect)."""
    import resource

    n = 1000
    base, slos = mix("dstack")
    rates = {m: r * 0.5 for m, r in base.items()}
    timeout_s = 10.0  # the default header_timeout_s
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # the server inherits it too
    if soft != resource.RLIM_INFINITY and soft < n + 1024:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n + 1024 if hard == resource.RLIM_INFINITY
                                                    else min(n + 1024, hard), hard))
    with serving(config("dstack", "slowloris"), OUT / "slowloris.log") as srv:
        run(cl.open_loop(srv.host, rates, slos, 2.0, fresh_connections=True))
        quiet = cl.total(run(cl.open_loop(srv.host, rates, slos, 8, seed=4,
                                          fresh_connections=True)))
        hold_s = timeout_s + 2

        async def go() -> tuple[dict[str, cl.Tally], cl.SlowlorisResult, int]:
            # the load first: it reads the models' metadata before the attack starts
            load = asyncio.create_task(cl.open_loop(srv.host, rates, slos, hold_s, seed=5,
                                                    fresh_connections=True))
            await asyncio.sleep(0.5)
            attack = asyncio.create_task(
                cl.slowloris("127.0.0.1", srv.port, n, hold_s, timeout_s + 3))
            await asyncio.sleep(hold_s / 2)
            held = open_sockets(srv.pid)
            return await load, await attack, held

        res, sl, held = run(go())
        t = cl.total(res)
        return row(f"slowloris {n} half headers", t, srv.pid,
                   normal_503=t.refused.get("unavailable", 0),
                   other_p99_ms=cl.pct(t.latencies_ms, 99),
                   unloaded_p99_ms=cl.pct(quiet.latencies_ms, 99),
                   p99_ratio=cl.pct(t.latencies_ms, 99) / cl.pct(quiet.latencies_ms, 99),
                   server_sockets_mid_attack=held, stalled_opened=sl.opened,
                   stalled_connect_failed=sl.connect_failed, stalled_closed=dict(sl.closed),
                   stalled_longest_life_s={k: round(max(v), 2)
                                           for k, v in sl.lifetime_s.items()},
                   stalled_still_open=sl.still_open)


def stalled(args: argparse.Namespace) -> Row:
    base, slos = mix("dstack")
    rates = {m: r * 0.5 for m, r in base.items()}
    body_timeout = 5
    with serving(config("dstack", "stalled", {"body_timeout_s": body_timeout}),
                 OUT / "stalled.log") as srv:
        t0 = time.monotonic()

        async def go() -> tuple[dict[str, cl.Tally], Counter]:
            load = asyncio.create_task(cl.open_loop(srv.host, rates, slos, body_timeout + 3,
                                                    seed=5))
            await asyncio.sleep(0.5)
            got = await cl.stalled_uploads("127.0.0.1", srv.port, 50, 1_000_000, 500_000,
                                           body_timeout + 5)
            return await load, got

        res, outcomes = run(go())
        return row(f"50 stalled uploads (body timeout {body_timeout} s)", cl.total(res),
                   srv.pid, stalled_outcomes=dict(outcomes),
                   answered_within_s=time.monotonic() - t0)


def over_limit(args: argparse.Namespace) -> Row:
    """64 bodies over the limit, sent whole before the answer is read, one after another
    on kept-alive connections (declared and chunked, with and without `Connection: close`):
    each must read its 413, not a reset, and the server must be left as it was."""
    limit = 1 << 20
    with serving(config("tiny", "overlimit", {"max_body_bytes": limit}),
                 OUT / "overlimit.log") as srv:
        socks0, rss0 = open_sockets(srv.pid), rss_mb(srv.pid)
        t0 = time.monotonic()
        times = cl.post_bodies(f"{srv.host}/v2/models/tiny_cnn/infer", b"x" * 32 * limit, 64,
                               8, 60, variants=True)
        seconds = time.monotonic() - t0
        got = Counter({k: len(v) for k, v in times.items()})
        slowest = max(max(v) for v in times.values())
        time.sleep(1)  # the last connections' lingering closes
        answered = {int(k): v for k, v in got.items() if k.isdigit()}
        t = cl.Tally(sent=sum(got.values()), hung=got["TimeoutError"],
                     other_4xx=sum(v for k, v in answered.items() if 400 <= k < 500),
                     err_5xx=sum(v for k, v in answered.items() if k >= 500),
                     conn=sum(got.values()) - sum(answered.values()) - got["TimeoutError"])
        return row("64 x 32 MiB over a 1 MiB limit", t, srv.pid,
                   statuses=dict(sorted(got.items())), slowest_answer_s=slowest,
                   seconds=seconds, sockets_before_after=(socks0, open_sockets(srv.pid)),
                   rss_before_mb=rss0, still_serving=model_ready(srv.host, "tiny_cnn"))


def sigterm(args: argparse.Namespace) -> Row:
    base, slos = mix("dstack")
    rates = {m: r * _capacity(args) for m, r in base.items()}
    with serving(config("dstack", "sigterm"), OUT / "sigterm.log") as srv:
        async def go() -> tuple[dict[str, cl.Tally], int | None, float]:
            stop = asyncio.Event()
            load = asyncio.create_task(cl.open_loop(srv.host, rates, slos, 8, stop=stop))
            await asyncio.sleep(3)
            t0 = time.monotonic()
            os.kill(srv.pid, signal.SIGTERM)
            code = await asyncio.to_thread(_wait_exit, srv.pid, 30)
            exited = time.monotonic() - t0
            stop.set()
            return await load, code, exited

        res, code, exited = run(go())
        return row("SIGTERM under 1x load", cl.total(res), None, exit_code=code,
                   exit_after_s=exited)


def _wait_exit(pid: int, timeout_s: float) -> int | None:
    """The exit code of our own child `pid` (None if it did not exit in time)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    return None


def fuzz_real(args: argparse.Namespace) -> Row:
    limit = 1 << 20
    with serving(config("tiny", "fuzz", {"max_body_bytes": limit, "body_budget_bytes":
                                         64 * limit, "body_timeout_s": 2}),
                 OUT / "fuzz.log") as srv:
        models = {"tiny_cnn": get_json(f"{srv.host}/v2/models/tiny_cnn")}
        start, t0 = rss_mb(srv.pid), time.monotonic()
        samples: list[float] = []
        done = 0
        statuses: Counter = Counter()
        tally = cl.Tally()
        bad: list[str] = []
        step = max(1, args.fuzz // 10)
        while done < args.fuzz:  # in tenths, to sample memory as it goes
            n = min(step, args.fuzz - done)
            s, t, b = run(cl.fuzz("127.0.0.1", srv.port, models, n, seed=done, concurrency=32,
                                  max_body_bytes=limit, hang_s=15))
            statuses.update(s)
            tally.add(t)
            bad += b
            done += n
            samples.append(rss_mb(srv.pid))
            print(f"  fuzz {done}: RSS {samples[-1]:.0f} MB, 5xx {tally.err_5xx}, "
                  f"hung {tally.hung}", flush=True)
        return row(f"fuzzer {args.fuzz} cases", tally, srv.pid,
                   statuses=dict(sorted(statuses.items())), rss_start_mb=start,
                   rss_samples_mb=samples, seconds=time.monotonic() - t0,
                   still_serving=model_ready(srv.host, "tiny_cnn"), examples=bad[:5])


# ------------------------------------------------------------------ report


def table(rows: list[Row]) -> str:
    head = (f"{'scenario':44s} {'sent':>7s} {'in SLO':>7s} {'late':>5s} {'refused (reason)':30s}"
            f" {'4xx':>5s} {'5xx':>4s} {'hung':>4s} {'conn':>5s} {'peak MB':>8s} {'final MB':>8s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        refused = ", ".join(f"{k} {v}" for k, v in sorted(r["refused"].items())) or "0"
        lines.append(
            f"{r['scenario'][:44]:44s} {r['sent']:7d} {r['in_slo']:7d} {r['late']:5d} "
            f"{refused[:30]:30s} {r['other_4xx']:5d} {r['5xx']:4d} {r['hung']:4d} "
            f"{r['conn']:5d} {r.get('peak_rss_mb', float('nan')):8.0f} "
            f"{r.get('final_rss_mb', float('nan')):8.0f}")
    return "\n".join(lines)


def notes(rows: list[Row]) -> str:
    out = []
    skip = {"scenario", "sent", "in_slo", "late", "refused", "other_4xx", "5xx", "hung",
            "conn", "peak_rss_mb", "final_rss_mb", "refusal_p50_ms", "samples_5xx",
            "refusal_p50_p99_ms_by_reason", "p99_ms", "refusal_p99_ms", "non_json_errors"}
    for r in rows:
        if not r["scenario"].startswith("overload"):
            out.append(r["scenario"] + ": " + ", ".join(
                f"{k} {_fmt(v)}" for k, v in r.items() if k not in skip))
            continue
        vs = "".join(f"{k.removeprefix('goodput_')} {r[k]:.2f} (rounds {r[k + '_rounds']}), "
                     for k in r if k.startswith("goodput_vs_") and k != "goodput_vs_1x"
                     and not k.endswith("_rounds"))
        by_reason = ", ".join(f"{k} {v[0]:g} / {v[1]:g}"
                              for k, v in r["refusal_p50_p99_ms_by_reason"].items())
        out.append(f"{r['scenario']}: offered {r['offered_rps']:.0f} rps, goodput "
                   f"{r['goodput_rps']:.1f}/s = {r['goodput_vs_1x']:.2f} of 1x (>= 0.90; "
                   f"rounds {r['goodput_vs_1x_rounds']}), {vs}accepted within SLO "
                   f"{100 * r['accepted_in_slo']:.1f}% (>= 99%), refusal p50 / p99 "
                   f"{r['refusal_p50_ms']:.1f} / {r['refusal_p99_ms']:.1f} ms (p99 < 5); "
                   f"by reason (p50, p99): {by_reason}")
    return "\n".join(out)


def _interrupt(sig: int, _: Any) -> None:
    raise KeyboardInterrupt(f"signal {sig}")


def main(argv: list[str] | None = None) -> int:
    global MIX, LOAD_PROCS
    scenarios: dict[str, Callable[[argparse.Namespace], Row | list[Row]]] = {
        "overload": overload, "kill": worker_kill, "bodies": big_bodies,
        "over-limit": over_limit, "slowloris": slowloris, "stalled": stalled,
        "sigterm": sigterm, "fuzz": fuzz_real, "refusal-cost": refusal_cost,
        "accept-cost": accept_cost}
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--only", nargs="*", choices=list(scenarios), default=list(scenarios))
    add("--policies", nargs="*", choices=list(MIX), default=list(MIX))
    add("--frontends", type=int, nargs="+", default=[1],
        help="overload, refusal-cost, accept-cost: each server once per value of "
             "server.frontends (labelled POLICY+Nfe for N > 1), side by side")
    add("--solve-in", choices=["process", "thread"], nargs="+", default=None,
        help="overload: each server once per value of adapt.solve_in (labelled +solve-X)")
    add("--mix", choices=list(MIXES), default="cpu",
        help="overload: the servers' model mix: cpu, or h100 (MPS slices of an H100)")
    add("--load-procs", type=int, default=1,
        help="overload: processes the load is sent from (one Python process cannot send "
             "thousands of 600 KB requests a second)")
    add("--load-cores", type=int, nargs="+", default=None,
        help="overload: the load generator on these cores, the servers and workers on the "
             "others (no control window then)")
    add("--overload-seconds", type=float, default=10.0)
    add("--reps", type=int, default=3, help="rounds of 1x, 2x, 4x")
    add("--no-control", dest="control", action="store_false",
        help="leave out each round's control window (CONTROL)")
    add("--capacity-scale", type=float, default=0.0,
        help="capacity as a multiple of the mix's rate_rps (0: calibrate)")
    add("--fuzz", type=int, default=100_000, help="fuzzer cases")
    args = p.parse_args(argv)
    if args.load_cores:
        if not set(args.load_cores) < set(host := available_cores()):
            p.error(f"--load-cores must name some of this process's cores {host} and leave "
                    "at least one for the servers")
        args.control = False
    if args.mix != "cpu" and set(args.only) != {"overload"}:
        p.error(f"--mix {args.mix} runs the overload scenario only (--only overload)")
    if args.load_procs < 1:
        p.error("--load-procs must be at least 1")
    MIX = {pol: ROOT / MIXES[args.mix].format(pol) for pol in MIX}
    LOAD_PROCS = args.load_procs
    args.capacity = {}
    signal.signal(signal.SIGTERM, _interrupt)  # stop our servers on `timeout` / kill too
    OUT.mkdir(parents=True, exist_ok=True)
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start",
          flush=True)
    rows: list[Row] = []
    for name in args.only:
        print(f"== {name}", flush=True)
        t0 = time.monotonic()
        try:
            got = scenarios[name](args)
            rows += got if isinstance(got, list) else [got]
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            print(f"  {name} failed: {e}", file=sys.stderr, flush=True)
        print(f"   ({time.monotonic() - t0:.0f} s; load average {os.getloadavg()[0]:.2f})",
              flush=True)
    print(f"\n{table(rows)}\n\n{notes(rows)}")
    (OUT / "chaos.json").write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
