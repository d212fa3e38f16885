"""The model zoo and the deployment config: what a user sees when they get them wrong."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import models
from dstack.common.config import (
    ConfigError,
    PolicyName,
    decision_timeout_s,
    frontend_processes,
    load_config,
    parse_config,
    solve_in_process,
    worker_niceness,
)
from dstack.runtime.specs import served_spec


def test_zoo_has_torchvision_classifiers_and_tiny_cnn_with_batch_dim_specs() -> None:
    names = models.names()
    for n in ("resnet50", "vgg19", "alexnet", "mobilenet_v3_small", "efficientnet_b0",
              "vit_b_16", "tiny_cnn"):
        assert n in names
    s = models.spec("vit_b_16")
    assert s.inputs[0].shape == (-1, 3, 224, 224) and s.outputs[0].shape == (-1, 1000)


def test_unknown_model_lists_the_known_ones() -> None:
    with pytest.raises(models.ModelZooError, match="known models: .*resnet18"):
        models.get("resnet51")


def test_local_weights_load_with_weights_only(tmp_path: Path) -> None:
    torch.manual_seed(3)
    ref = models.load_model("tiny_cnn")
    path = tmp_path / "w.pt"
    torch.save(ref.state_dict(), path)
    got = models.load_model("tiny_cnn", weights=path)
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(got(x), ref(x))
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(models.ModelZooError, match="cannot read weights"):
        models.load_model("tiny_cnn", weights=tmp_path / "bad.pt")
    with pytest.raises(models.ModelZooError, match="does not exist"):
        models.load_model("tiny_cnn", weights=tmp_path / "missing.pt")


class Doubler(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(x, 1)[:, :5] * 2


def build_doubler() -> nn.Module:
    return Doubler()


def test_user_models_from_torchscript_or_a_builder(tmp_path: Path) -> None:
    ts = tmp_path / "m.pt"
    torch.jit.script(Doubler()).save(str(ts))
    x = torch.ones(2, 3, 4, 4)
    assert torch.equal(models.load_model("mine", torchscript=ts)(x), torch.full((2, 5), 2.0))
    m = models.load_model("mine", builder=f"{__name__}:build_doubler")
    assert torch.equal(m(x), torch.full((2, 5), 2.0))
    with pytest.raises(models.ModelZooError, match="package.module:function"):
        models.load_model("mine", builder="no_colon")


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "deploy.yaml"
    p.write_text(text)
    return p


def test_config_defaults_and_relative_paths(tmp_path: Path) -> None:
    (tmp_path / "w").mkdir()
    cfg = load_config(write(tmp_path, "models:\n  - name: tiny_cnn\n    weights: w/t.pt\n"))
    assert cfg.server.host == "127.0.0.1" and cfg.policy is PolicyName.SHARED
    assert cfg.models[0].weights == (tmp_path / "w" / "t.pt").resolve()


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("models: []\n", "models"),
        ("models:\n  - name: a\n    slo_ms: -1\n", "models.0.slo_ms"),
        ("models:\n  - name: a\n    slo_ms: 10\n    max_queue_delay_ms: 20\n", "below slo_ms"),
        ("models:\n  - name: a\n  - name: a\n", "appears twice"),
        ("policy: dstack\nprofiles: 3\nmodels:\n  - name: a\n", "profiles"),
        ("policy: fastest\nmodels:\n  - name: a\n", "policy"),
        ("models:\n  - name: a\n    colour: red\n", "models.0.colour"),
        ("server:\n  port: 70000\nmodels:\n  - name: a\n", "server.port"),
        ("server:\n  frontends: many\nmodels:\n  - name: a\n", "server.frontends"),
        ("server:\n  frontends: 0\nmodels:\n  - name: a\n", "server.frontends"),
        ("models: [\n", "not valid YAML"),
    ],
)
def test_bad_config_names_the_field_and_the_reason(tmp_path: Path, text: str,
                                                   needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    assert needle in str(e.value)


@pytest.mark.parametrize(
    ("device", "cores", "models", "expected"),
    [
        ("cuda", 16, 2, 4),  # a lent H100 host: the four it was measured with
        ("cuda", 64, 2, 4),  # never more than AUTO_FRONTENDS_MAX
        ("cuda", 8, 2, 2),  # (8 - 1 - 2) // 2
        ("cuda", 8, 4, 1),  # one would be no front end at all
        ("cuda", 4, 1, 1),
        ("cpu", 64, 2, 1),  # the workers compute on the cores
    ],
)
def test_frontends_auto_runs_front_ends_on_a_cuda_host_with_cores_to_spare(
        caplog: pytest.LogCaptureFixture, device: str, cores: int, models: int,
        expected: int) -> None:
    from server.main import _with_frontends

    cfg = parse_config({"device": device,
                        "models": [{"name": f"m{i}", "zoo_name": "tiny_cnn"}
                                   for i in range(models)]})
    assert cfg.server.frontends == "auto"  # the default
    with caplog.at_level(logging.INFO, logger="dstack.server"):
        served = _with_frontends(cfg, cores)
    assert served.server.frontends == expected == frontend_processes(cfg, cores)
    said = (f"{expected} front-end processes" if expected > 1
            else "this process serves HTTP")
    assert f"server.frontends auto: {said} (device {device}, {cores} cores" in caplog.text
    # a number given is kept as it is, on any host, and said nothing about
    caplog.clear()
    given = cfg.model_copy(update={"server": cfg.server.model_copy(update={"frontends": 3})})
    assert _with_frontends(given, cores).server.frontends == 3
    assert "auto" not in caplog.text


def test_a_front_ends_bound_on_the_decision_defaults_by_device() -> None:
    """`server.decision_timeout_ms` not given: 3 ms on a CUDA device, none on a CPU device
    (where the server's process shares the cores with the workers' compute); a value
    given, 0 included, is used on either."""
    def bound_s(device: str, **server: float) -> float:
        return decision_timeout_s(parse_config({
            "device": device, "server": server, "models": [{"name": "tiny_cnn"}]}))

    assert bound_s("cuda") == 0.003 and bound_s("cpu") == 0.0
    assert bound_s("cuda", decision_timeout_ms=0) == 0.0
    assert bound_s("cpu", decision_timeout_ms=5) == 0.005


def test_workers_run_nicer_by_default_only_on_cuda() -> None:
    """`worker_nice` not given: 10 on a CUDA device, 0 on a CPU device (whose workers,
    niced, lost their cores to any other program on the host); a value given is used on
    either; one outside 0-19 is an error naming the field."""
    def nice(device: str, **top: int) -> int:
        return worker_niceness(parse_config({
            "device": device, **top, "models": [{"name": "tiny_cnn"}]}))

    assert nice("cuda") == 10 and nice("cpu") == 0
    assert nice("cuda", worker_nice=0) == 0 and nice("cpu", worker_nice=7) == 7
    with pytest.raises(ConfigError, match="worker_nice"):
        nice("cpu", worker_nice=20)


def test_replans_are_solved_in_a_process_by_default_on_cuda_and_in_a_thread_on_cpu() -> None:
    """`adapt.solve_in: auto`: a process of its own on a CUDA device (the deciding loop
    loses no turns at the GIL), a thread on a CPU device (the GIL keeps the solve off a
    second core the workers compute on); a value given is used on either; another is an
    error naming the field."""
    def in_process(device: str, **adapt: str) -> bool:
        return solve_in_process(parse_config({
            "device": device, "adapt": adapt, "models": [{"name": "tiny_cnn"}]}))

    assert in_process("cuda") and not in_process("cpu")
    assert in_process("cpu", solve_in="process") and not in_process("cuda", solve_in="thread")
    with pytest.raises(ConfigError, match="adapt.solve_in"):
        in_process("cpu", solve_in="ray")


def test_the_gil_switch_interval_defaults_to_half_a_ms_and_must_be_positive() -> None:
    def server(**s: float) -> dict:
        return {"server": s, "models": [{"name": "tiny_cnn"}]}

    assert parse_config(server()).server.switch_interval_ms == 0.5
    assert parse_config(server(switch_interval_ms=5)).server.switch_interval_ms == 5
    with pytest.raises(ConfigError, match="switch_interval_ms"):
        parse_config(server(switch_interval_ms=0))


def test_served_spec_uses_the_configured_max_batch_and_user_shapes(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, (
        "models:\n  - name: r\n    zoo_name: resnet18\n    max_batch_size: 3\n"
        "  - name: mine\n    builder: x:y\n    input_shape: [3, 4, 4]\n    num_classes: 5\n"
        "  - name: nope\n"
    )))
    assert served_spec(cfg.models[0]).max_batch_size == 3
    assert served_spec(cfg.models[1]).inputs[0].shape == (-1, 3, 4, 4)
    with pytest.raises(ConfigError, match="models.nope: unknown model"):
        served_spec(cfg.models[2])
