"""A served model's tensors are known without torch: `dstack serve` (and the cluster
ingress) look them up at start-up in a process that never runs a model."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torchvision.models as tvm

import models
from dstack.common.config import ConfigError, load_config
from models.specs import TORCHVISION_CLASSIFIERS, builtin_spec

ROOT = Path(__file__).resolve().parents[2]


def test_the_specs_without_torch_are_the_zoos() -> None:
    assert TORCHVISION_CLASSIFIERS == set(tvm.list_models(module=tvm))
    for name in models.names():
        assert builtin_spec(name) == models.spec(name), name
    assert builtin_spec("resnet51") is None


def test_a_server_looks_up_its_models_without_importing_torch(tmp_path: Path) -> None:
    cfg = tmp_path / "deploy.yaml"
    cfg.write_text("device: cpu\npolicy: shared\nmodels:\n"
                   "  - {name: small, zoo_name: mobilenet_v3_small, slo_ms: 60}\n"
                   "  - {name: inception_v3, slo_ms: 100, max_batch_size: 4}\n"
                   "  - {name: tiny_cnn, slo_ms: 50}\n")
    code = textwrap.dedent(f"""
        import sys
        from dstack.common.config import load_config
        from dstack.runtime.specs import served_spec
        import server.main, dstack.runtime.serving
        specs = [served_spec(m) for m in load_config({str(cfg)!r}).models]
        print([(s.name, s.inputs[0].shape, s.outputs[0].shape, s.max_batch_size)
               for s in specs])
        print("torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True, timeout=120).stdout.splitlines()
    assert out[0] == str([("small", (-1, 3, 224, 224), (-1, 1000), 8),  # the default
                          ("inception_v3", (-1, 3, 299, 299), (-1, 1000), 4),
                          ("tiny_cnn", (-1, 3, 32, 32), (-1, 10), 8)])
    assert out[1] == "False"


def test_other_names_are_still_asked_of_the_zoo(tmp_path: Path) -> None:
    from dstack.runtime.specs import served_spec

    cfg = tmp_path / "deploy.yaml"
    cfg.write_text("device: cpu\npolicy: shared\nmodels:\n  - {name: resnet51, slo_ms: 60}\n")
    with pytest.raises(ConfigError, match="models.resnet51: unknown model 'resnet51'; known "
                                          "models: .*resnet18"):
        served_spec(load_config(cfg).models[0])
