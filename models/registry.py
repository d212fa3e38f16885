"""The model zoo: name -> builder, tensor specs, max batch, local weight loading.

Nothing here downloads: torchvision models are built with `weights=None`, and weights come
only from a local file (a state dict read with `torch.load(weights_only=True)`, or a whole
TorchScript module). The zoo knows nothing about serving.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dstack.common.types import ModelSpec
from models.specs import (
    INPUT_SIZE,
    TINY_CNN_SPEC,
    ModelZooError,
    image_spec,
)


@dataclass(frozen=True, slots=True)
class ZooEntry:
    name: str
    builder: Callable[[], nn.Module]
    spec: ModelSpec


class TinyCNN(nn.Module):
    """A two-convolution classifier on 3x32x32 inputs: milliseconds per batch on a CPU."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.features(x), 1))


class PoolLinear(nn.Module):
    """An image classifier that costs next to nothing (average pool, one linear layer) on
    the 3x224x224 inputs of the real ones: a load whose bottleneck is the server itself,
    its HTTP front end and dispatch, as when the models run on a GPU
    (the removed `bench.bench_frontend_overload`; docs/decisions.md)."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.fc = nn.Linear(3, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean(dim=(2, 3)))


_REGISTRY: dict[str, ZooEntry] = {}


def register(name: str, builder: Callable[[], nn.Module], spec: ModelSpec) -> None:
    """Add a model to the zoo (replacing one of the same name)."""
    if spec.name != name:
        spec = ModelSpec(name, spec.inputs, spec.outputs, spec.max_batch_size)
    _REGISTRY[name] = ZooEntry(name, builder, spec)


def _torchvision_classifiers() -> dict[str, Callable[..., nn.Module]]:
    import torchvision.models as tvm

    return {n: tvm.get_model_builder(n) for n in tvm.list_models(module=tvm)}


def _register_defaults() -> None:
    register("tiny_cnn", TinyCNN, TINY_CNN_SPEC)
    register("pool_linear", PoolLinear, image_spec("pool_linear"))
    for name, fn in _torchvision_classifiers().items():
        # inception_v3/googlenet would add aux heads and try to fetch nothing, but their
        # eval-mode output is the plain logits; init_weights=False keeps build time down.
        def build(fn: Callable[..., nn.Module] = fn, name: str = name) -> nn.Module:
            kwargs: dict[str, object] = {"weights": None}
            if name in ("inception_v3", "googlenet"):
                kwargs.update(aux_logits=False, init_weights=False)
            return fn(**kwargs)

        register(name, build, image_spec(name, INPUT_SIZE.get(name, 224)))


def names() -> list[str]:
    _ensure_defaults()
    return sorted(_REGISTRY)


def get(name: str) -> ZooEntry:
    _ensure_defaults()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ModelZooError(
            f"unknown model {name!r}; known models: {', '.join(sorted(_REGISTRY))}"
        ) from None


def spec(name: str) -> ModelSpec:
    return get(name).spec


_defaults_done = False


def _ensure_defaults() -> None:
    global _defaults_done
    if not _defaults_done:
        _defaults_done = True
        _register_defaults()


def resolve_builder(ref: str) -> Callable[[], nn.Module]:
    """`package.module:function` -> the function (a user's own builder)."""
    mod_name, sep, attr = ref.partition(":")
    if not sep or not mod_name or not attr:
        raise ModelZooError(f"builder {ref!r} must look like 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise ModelZooError(f"builder {ref!r}: {e}") from e
    if not callable(fn):
        raise ModelZooError(f"builder {ref!r} is not callable")
    return fn  # type: ignore[no-any-return]


def load_model(
    name: str,
    *,
    weights: str | Path | None = None,
    builder: str | None = None,
    torchscript: str | Path | None = None,
) -> nn.Module:
    """Build a model in eval mode.

    - `torchscript`: load a whole TorchScript module from a local file;
    - `builder`: `module:function` returning an nn.Module (else the zoo's builder for name);
    - `weights`: a local state dict, read with `weights_only=True` (or a TorchScript file,
      whose state dict is then taken).
    """
    if torchscript is not None:
        path = Path(torchscript)
        if not path.is_file():
            raise ModelZooError(f"{name}: TorchScript file {path} does not exist")
        module = torch.jit.load(str(path), map_location="cpu")
        return module.eval()
    fn = resolve_builder(builder) if builder else get(name).builder
    model = fn()
    if weights is not None:
        model.load_state_dict(_read_state_dict(name, Path(weights)))
    return model.eval()


def _read_state_dict(name: str, path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise ModelZooError(f"{name}: weights file {path} does not exist")
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as first:  # not a plain state dict: maybe a TorchScript archive
        try:
            return dict(torch.jit.load(str(path), map_location="cpu").state_dict())
        except Exception:
            raise ModelZooError(f"{name}: cannot read weights {path}: {first}") from first
    if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict):
        raise ModelZooError(f"{name}: weights {path} hold a {type(obj).__name__}, not a state dict")
    return obj
