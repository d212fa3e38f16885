"""dstack."""

from __future__ import annotations

import importlib.machinery
import warnings
from pathlib import Path


def stale_extensions() -> list[str]:
    """Sources changed since setup.py compiled them (paths relative to the repository).

    Python imports an extension module before its .py, so a stale one runs old code;
    `make` (or `python setup.py build_ext --inplace`) compiles them again."""
    here = Path(__file__).resolve().parent
    stale: list[str] = []
    if not (here.parent / "setup.py").exists():
        return stale  # an installed copy: its files' times say nothing
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        for ext in here.rglob(f"*{suffix}"):
            src = ext.with_name(ext.name[: -len(suffix)] + ".py")
            if src.exists() and src.stat().st_mtime > ext.stat().st_mtime:
                stale.append(str(src.relative_to(here.parent)))
    return sorted(stale)


if _stale := stale_extensions():
    warnings.warn(f"{', '.join(_stale)} changed since it was compiled, and the compiled "
                  "(older) code is what runs: `make setup` compiles it again", stacklevel=2)
