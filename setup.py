"""Compiles the simulator's hot path with Cython; everything else is in pyproject.toml.

The modules below are plain Python (Cython's pure-Python mode): compiled, the same source
runs the simulator's event loop and the policies several times faster
(`python -m bench.bench_policies --speed`); where no C compiler is at hand the build says
so and the package runs them as Python.
"""

from Cython.Build import cythonize  # the build-system table requires it
from setuptools import setup

COMPILED = [
    "dstack/policies/latency.py",
    "dstack/policies/contract.py",
    "dstack/policies/baselines.py",
    "dstack/runtime/core_state.py",
    "dstack/runtime/lanes.py",
    "dstack/runtime/dispatch.py",
    "dstack/simulate/engine.py",
]

ext_modules = cythonize(COMPILED, language_level=3, quiet=True)
for ext in ext_modules:
    ext.optional = True  # no compiler: warn and fall back to the Python source

setup(ext_modules=ext_modules)
