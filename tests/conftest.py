"""Shared test set-up: tests marked `gpu` are skipped where CUDA is not available, and
the suite refuses to run on a compiled module older than its source."""

from __future__ import annotations

import importlib.machinery
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def pytest_configure(config: pytest.Config) -> None:
    # An extension module is imported before its .py: a stale one would test old code.
    stale = []
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        for ext in (ROOT / "dstack").rglob(f"*{suffix}"):
            src = ext.with_name(ext.name[: -len(suffix)] + ".py")
            if src.exists() and src.stat().st_mtime > ext.stat().st_mtime:
                stale.append(str(src.relative_to(ROOT)))
    if stale:
        pytest.exit(f"{', '.join(sorted(stale))} changed since it was compiled: run "
                    "`make test` (it compiles them again) or `python setup.py build_ext "
                    "--inplace`", returncode=4)


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
