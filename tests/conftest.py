"""Shared test set-up: tests marked `gpu` are skipped where CUDA is not available, the
suite refuses to run on a compiled module older than its source, and property tests draw
the same examples on every run (`HYPOTHESIS_PROFILE=explore` draws new ones)."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

# A red CI must mean a regression, not a new draw: the default profile is repeatable.
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


def pytest_configure(config: pytest.Config) -> None:
    # An extension module is imported before its .py: a stale one would test old code.
    from dstack import stale_extensions

    if stale := stale_extensions():
        pytest.exit(f"{', '.join(stale)} changed since it was compiled: run `make test` (it "
                    "compiles them again) or `python setup.py build_ext --inplace`",
                    returncode=4)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
