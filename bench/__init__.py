"""Benchmarks: scripts that measure speed and print ratios against a baseline run beside
them. The shared harness: `bench.servers` (a `dstack serve` subprocess, its configs and
/proc), `bench.closed_loop` and `bench.chaos_load` (load), and `bench.fitted`.
docs/benchmarks.md lists the entry points.
"""
