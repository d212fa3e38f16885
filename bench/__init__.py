"""Benchmarks: scripts that measure speed and print ratios against a baseline run beside
them (tests check behaviour; these measure it).

The shared harness: `bench.servers` (a `dstack serve` subprocess on 127.0.0.1, stopped by
PID; configs written for it; its /metrics and statistics; its processes' memory and CPU
from /proc), `bench.loads` (open-loop Poisson load and closed-loop tritonclient clients in
process), `bench.closed_loop` (closed-loop clients, a process each), `bench.chaos_load`
(the lean open loop with every outcome counted, and the hostile clients), `bench.fitted`
(configs fitted to this machine's speed), `bench.ceiling` (the model called in process:
the ceiling no server can beat). Entry points: the Makefile's bench targets and the
scripts' docstrings (docs/benchmarks.md lists them).
"""
