"""Hand-made profiles and configs for the simulator tests."""

from __future__ import annotations

from collections.abc import Callable

from dstack.common.config import DeployConfig, parse_config
from dstack.common.types import Cell, DeviceInfo, Profile


def make_profile(model: str, lat_ms: Callable[[int, float], float],
                 batches: tuple[int, ...] = (1, 8, 16),
                 percents: tuple[float, ...] = (25.0, 50.0, 100.0),
                 knee: float = 50.0, kind: str = "reference", units: int = 100) -> Profile:
    cells = tuple(Cell(b, p, lat_ms(b, p), lat_ms(b, p)) for b in batches for p in percents)
    return Profile(model, DeviceInfo(kind, "hand-made", units, "SMs"), "table", batches,
                   percents, cells, knee={b: knee for b in batches})


def knee50(b: int, p: float) -> float:
    """10 ms + 1 ms per item from 50% up; work-conserving below (twice as slow at 25%)."""
    return (10.0 + b) * max(1.0, 50.0 / p)


def config(models: list[dict], **top: object) -> DeployConfig:
    return parse_config({"device": "cuda", "policy": "shared", "models": models, **top})
