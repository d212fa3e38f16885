"""Benchmarks: scripts that measure speed and print ratios against a baseline run beside
them (tests check behaviour; these measure it).

Shared pieces: `bench.servers` (a `dstack serve` subprocess on 127.0.0.1, stopped by PID;
peak RSS), `bench.loads` (open-loop Poisson load, closed-loop tritonclient clients and
their outcome accounting), `bench.ceiling` (the model called in process: the ceiling no
server can beat, and the single-model figure against it). Entry points: `python -m
bench.bench_mix` (`make bench`), `python -m bench.bench_closed_loop` (`make
bench-closed-loop`); the other `bench/bench_*.py` scripts say in their docstrings how they
are run.
"""
