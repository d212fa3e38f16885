"""MIG placement rules (data in `mig_layouts.json`) and the valid layouts they allow.

NVIDIA's rule, as `nvidia-smi mig -lgipp` states it: a GPU has 8 memory slices (and 7
compute slices); each GPU instance profile may start only at its listed slices and then
occupies `memory_slices` consecutive ones; two instances may not share a memory slice. So
on an A100 a 4g may only start at 0 and a 3g at 0 or 4: 4g + 3g is a layout, 3g + 4g is
not. A *layout* is a set of instances no further instance can join (a maximal placement):
the rows of the MIG User Guide's table of valid combinations. Pure functions over data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

DATA = Path(__file__).with_name("mig_layouts.json")


class MigDataError(ValueError):
    """Unknown GPU name, or a placement table that breaks its own rules."""


@dataclass(frozen=True, slots=True)
class MigProfile:
    """One GPU instance profile, e.g. 3g.40gb: 3 of 7 compute slices, 4 of 8 memory slices."""

    name: str
    id: int
    compute: int  # compute slices (of `MigGpu.compute_slices`)
    memory_slices: int
    memory_gb: float  # nominal, from the name
    starts: tuple[int, ...]  # allowed first memory slice
    extra: bool = False  # 1g with two memory slices: enumerated only on request

    @property
    def memory_mb(self) -> float:
        return self.memory_gb * 1000.0


@dataclass(frozen=True, slots=True)
class MigGpu:
    key: str  # "a100-40gb"
    name: str
    compute_slices: int
    memory_slices: int
    published_layouts: int
    published_source: str
    profiles: tuple[MigProfile, ...]

    def percent(self, profile: MigProfile) -> float:
        """The instance's share of the SMs, as an MPS percentage: K/7 for a Kg instance."""
        return 100.0 * profile.compute / self.compute_slices

    def profile(self, name: str) -> MigProfile:
        for p in self.profiles:
            if p.name == name:
                return p
        raise KeyError(name)


@dataclass(frozen=True, slots=True)
class Placed:
    profile: MigProfile
    start: int  # first memory slice

    @property
    def slices(self) -> range:
        return range(self.start, self.start + self.profile.memory_slices)

    def __str__(self) -> str:
        return f"{self.profile.name}@{self.start}"


Layout = tuple[Placed, ...]  # ordered by start


def gpu_names() -> tuple[str, ...]:
    return tuple(_raw()["gpus"])


def load_gpu(key: str) -> MigGpu:
    """The placement table of one GPU (`a100-40gb`, `a100-80gb`, `h100-80gb`)."""
    gpus = _raw()["gpus"]
    if key not in gpus:
        raise MigDataError(f"unknown --gpu {key!r} (known: {', '.join(gpus)})")
    g = gpus[key]
    profiles = tuple(
        MigProfile(p["name"], int(p["id"]), int(p["compute"]), int(p["memory_slices"]),
                   float(p["memory_gb"]), tuple(int(s) for s in p["starts"]),
                   bool(p.get("extra", False)))
        for p in g["profiles"]
    )
    gpu = MigGpu(key, g["name"], int(g["compute_slices"]), int(g["memory_slices"]),
                 int(g["published_layouts"]), g["published_source"], profiles)
    for p in profiles:
        bad = [s for s in p.starts if s < 0 or s + p.memory_slices > gpu.memory_slices]
        if bad:
            raise MigDataError(f"{key} {p.name}: start {bad[0]} runs past the "
                               f"{gpu.memory_slices} memory slices")
    return gpu


@cache
def _raw() -> dict:
    return json.loads(DATA.read_text())


def placements(gpu: MigGpu, *, extra: bool = False) -> list[Layout]:
    """Every set of non-overlapping instances at allowed starts (the empty one included),
    each once, instances ordered by start."""
    profiles = [p for p in gpu.profiles if extra or not p.extra]
    out: list[Layout] = []

    def go(pos: int, used: frozenset[int], acc: list[Placed]) -> None:
        if pos >= gpu.memory_slices:
            out.append(tuple(acc))
            return
        go(pos + 1, used, acc)  # nothing starts at `pos`
        for p in profiles:
            if pos in p.starts:
                inst = Placed(p, pos)
                if used.isdisjoint(inst.slices):
                    go(pos + 1, used | set(inst.slices), [*acc, inst])

    go(0, frozenset(), [])
    return out


def _can_add(gpu: MigGpu, layout: Layout, profiles: list[MigProfile]) -> bool:
    used = {s for inst in layout for s in inst.slices}
    compute = sum(inst.profile.compute for inst in layout)
    return any(
        used.isdisjoint(range(s, s + p.memory_slices))
        and compute + p.compute <= gpu.compute_slices
        for p in profiles for s in p.starts
    )


def valid_layouts(gpu: MigGpu, *, extra: bool = False) -> list[Layout]:
    """The maximal placements: no further instance fits. Ordered by the sizes of their
    instances, largest first (7g, then 4g + ..., ...)."""
    profiles = [p for p in gpu.profiles if extra or not p.extra]
    out = []
    for lay in placements(gpu, extra=extra):
        if not lay:
            continue
        compute = sum(inst.profile.compute for inst in lay)
        if compute > gpu.compute_slices:  # the memory rule already prevents it; checked
            raise MigDataError(f"{gpu.key}: {' + '.join(map(str, lay))} uses {compute} of "
                               f"{gpu.compute_slices} compute slices")
        if not _can_add(gpu, lay, profiles):
            out.append(lay)
    out.sort(key=lambda lay: ([-i.profile.compute for i in lay], [i.start for i in lay]))
    return out


def describe(layout: Layout) -> str:
    return " + ".join(str(i) for i in layout)
