"""The model zoo. See `models.registry`."""

from models.registry import (
    ModelZooError,
    TinyCNN,
    ZooEntry,
    get,
    load_model,
    names,
    register,
    spec,
)

__all__ = ["ModelZooError", "TinyCNN", "ZooEntry", "get", "load_model", "names", "register", "spec"]
