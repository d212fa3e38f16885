"""The model zoo. See `models.registry` (the models, which needs torch) and `models.specs`
(their tensors' specs, which does not: the zoo is imported on first use of a name that needs
it, so that a process that only looks up specs never imports torch)."""

from __future__ import annotations

from typing import Any

from models.specs import ModelZooError, builtin_spec

_ZOO = ("TinyCNN", "ZooEntry", "get", "load_model", "names", "register", "spec")


def __getattr__(name: str) -> Any:
    if name in _ZOO:
        from models import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")


__all__ = ["ModelZooError", "builtin_spec", *_ZOO]
