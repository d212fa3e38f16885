"""Shared test set-up: tests marked `gpu` are skipped where CUDA is not available, the
suite refuses to run on a compiled module older than its source, property tests draw
the same examples on every run (`HYPOTHESIS_PROFILE=explore` draws new ones), and
`profiles: auto` caches in a directory of the session's own, never ~/.cache."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import settings

# A red CI must mean a regression, not a new draw: the default profile is repeatable.
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


@pytest.fixture(autouse=True, scope="session")
def _profile_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """DSTACK_PROFILE_CACHE for the whole session, in os.environ so that the servers and
    commands the tests start inherit it: a test never reads profiles a user measured, nor
    leaves its own in their cache."""
    before = os.environ.get("DSTACK_PROFILE_CACHE")
    os.environ["DSTACK_PROFILE_CACHE"] = str(tmp_path_factory.mktemp("profile-cache"))
    yield
    if before is None:
        os.environ.pop("DSTACK_PROFILE_CACHE", None)
    else:
        os.environ["DSTACK_PROFILE_CACHE"] = before


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
