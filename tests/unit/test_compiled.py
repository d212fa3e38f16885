"""The simulator's hot path (setup.py: the modules Cython compiles) runs compiled, and
compiled it decides exactly as its Python source does."""

from __future__ import annotations

import importlib.machinery
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import dstack.policies.baselines
import dstack.policies.contract
import dstack.policies.latency
import dstack.runtime.core_state
import dstack.runtime.dispatch
import dstack.runtime.lanes
import dstack.simulate.engine

ROOT = Path(__file__).resolve().parents[2]
COMPILED = (dstack.policies.contract, dstack.policies.latency, dstack.policies.baselines,
            dstack.runtime.core_state, dstack.runtime.lanes, dstack.runtime.dispatch,
            dstack.simulate.engine)


def _compiled(module: object) -> bool:
    return str(module.__file__).endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def test_the_hot_path_is_compiled_where_a_c_compiler_is() -> None:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc}): the package runs its Python source")
    missing = [m.__name__ for m in COMPILED if not _compiled(m)]
    assert not missing, f"{missing} run as Python: `make setup` (pip install -e .) builds them"
    assert dstack.simulate.engine.COMPILED  # what `dstack simulate` reports


def _run(script_dir: Path, seeds: int) -> str:
    shutil.copy(Path(__file__).with_name("_compiled_script.py"), script_dir / "script.py")
    out = subprocess.run([sys.executable, str(script_dir / "script.py"), str(ROOT), str(seeds)],
                         cwd=script_dir, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stderr.strip().splitlines()[0] + "\n" + out.stdout


@pytest.mark.slow
def test_compiled_modules_decide_exactly_as_their_source(tmp_path: Path) -> None:
    if not all(_compiled(m) for m in COMPILED):
        pytest.skip("nothing compiled to compare")
    compiled_dir, source_dir = tmp_path / "compiled", tmp_path / "source"
    compiled_dir.mkdir()
    # The script's directory comes first on sys.path: a copy of dstack/ without the
    # extension modules there makes it import the source.
    shutil.copytree(ROOT / "dstack", source_dir / "dstack",
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "*.c", "__pycache__"))
    compiled = _run(compiled_dir, seeds=12)
    source = _run(source_dir, seeds=12)
    assert compiled.startswith("compiled\n") and source.startswith("source\n")
    c_lines, s_lines = compiled.splitlines()[1:], source.splitlines()[1:]
    assert len(c_lines) > 3000  # 12 histories of 300 decisions, then every policy
    for c, s in zip(c_lines, s_lines, strict=True):
        assert c == s


def test_a_source_changed_since_it_was_compiled_is_named() -> None:
    if not _compiled(dstack.policies.latency):
        pytest.skip("nothing compiled")
    from dstack import stale_extensions

    src = ROOT / "dstack" / "policies" / "latency.py"
    ext = Path(str(dstack.policies.latency.__file__))
    before = src.stat()
    assert stale_extensions() == []
    try:
        os.utime(src, (before.st_atime, ext.stat().st_mtime + 10))  # "edited" after the build
        assert stale_extensions() == ["dstack/policies/latency.py"]
    finally:
        os.utime(src, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert stale_extensions() == []
