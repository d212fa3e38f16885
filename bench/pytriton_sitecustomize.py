"""Copied as `sitecustomize.py` into the site-packages of the PyTriton venv that
`bench/bench_triton.py` uses, where Triton's Python-backend stub loads it. The stub
embeds its own libpython 3.11, older than a 3.11.7 standard library: its C RLock lacks
`_recursion_count`, which 3.11.7's multiprocessing resource tracker calls, and the model
fails to load. The pure-Python RLock has it."""

import threading
from multiprocessing import resource_tracker as _rt

if not hasattr(_rt._resource_tracker._lock, "_recursion_count"):
    _rt._resource_tracker._lock = threading._PyRLock()  # type: ignore[attr-defined]
