"""The pieces of the server limits that need no server process: config checks, the token
source, open paths, and big JSON bodies: parsed a piece at a time, and refused by their
batch size before their numbers are parsed. The limits themselves
are checked against a real server in tests/e2e/test_server_limits.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from dstack.common.config import ConfigError, ServerConfig, parse_config
from dstack.common.types import DType, ModelSpec, TensorSpec
from server import app as app_module
from server.auth import TOKEN_ENV, AuthConfigError, is_open, load_token
from server.main import build_app, server_config
from tests.integration.fakes import FakeBackend


def test_a_budget_below_the_body_limit_is_refused_naming_both() -> None:
    with pytest.raises(ConfigError, match="body_budget_bytes.*max_body_bytes"):
        parse_config({"server": {"max_body_bytes": 4096, "body_budget_bytes": 2048},
                      "models": [{"name": "double"}]})
    with pytest.raises(ConfigError, match="tls_keyfile"):
        parse_config({"server": {"tls_keyfile": "k.pem"}, "models": [{"name": "double"}]})


def test_token_from_the_file_or_the_environment_never_both(tmp_path: Path) -> None:
    assert load_token(ServerConfig(), {}) is None
    assert load_token(ServerConfig(), {TOKEN_ENV: " abc \n"}) == "abc"
    f = tmp_path / "token"
    f.write_text("from-file\n")
    assert load_token(ServerConfig(auth_token_file=f), {}) == "from-file"
    with pytest.raises(AuthConfigError, match="give one"):
        load_token(ServerConfig(auth_token_file=f), {TOKEN_ENV: "abc"})
    with pytest.raises(AuthConfigError, match="cannot read"):
        load_token(ServerConfig(auth_token_file=tmp_path / "missing"), {})
    f.write_text("\n")
    with pytest.raises(AuthConfigError, match="empty"):
        load_token(ServerConfig(auth_token_file=f), {})


def test_open_paths_are_exact_or_prefixes_ending_in_a_slash() -> None:
    paths = ServerConfig().auth_open_paths
    assert is_open("/v2/health/ready", paths) and is_open("/metrics", paths)
    assert not is_open("/metrics/x", paths) and not is_open("/v2/health", paths)
    assert not is_open("/v2/models/double/infer", paths)


def test_tls_files_reach_uvicorn(tmp_path: Path) -> None:
    cfg = ServerConfig(tls_certfile=tmp_path / "c.pem", tls_keyfile=tmp_path / "k.pem")
    config = server_config(build_app(parse_config({"models": [{"name": "double"}]}),
                                     FakeBackend()), cfg)
    assert (config.ssl_certfile, config.ssl_keyfile) == (cfg.tls_certfile, cfg.tls_keyfile)
    assert config.is_ssl


def _big_double_body(rows: int) -> tuple[bytes, list[float]]:
    values = [float(i % 97) / 8 for i in range(rows * 3)]
    doc = {"inputs": [{"name": "x", "shape": [rows, 3], "datatype": "FP32", "data": values}]}
    return json.dumps(doc).encode(), values


class _Wide(FakeBackend):
    """One more model, `wide`: 4,096 FP32 values per item, doubled."""

    WIDE = ModelSpec("wide", (TensorSpec("x", DType.FP32, (-1, 4096)),),
                     (TensorSpec("y", DType.FP32, (-1, 4096)),), max_batch_size=2)

    def __init__(self) -> None:
        super().__init__()
        self.ready["wide"] = True

    def spec(self, model: str) -> ModelSpec:
        return self.WIDE if model == "wide" else super().spec(model)

    async def infer(self, model: str, inputs: dict[str, np.ndarray],
                    since_received_s: float = 0.0) -> dict[str, np.ndarray]:
        if model == "wide":
            return {"y": inputs["x"] * 2}
        return await super().infer(model, inputs)


def test_other_requests_are_served_while_a_big_json_body_is_parsed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    import httpx

    from server import json_tensors

    monkeypatch.setattr(json_tensors, "CHUNK_BYTES", 1024)  # some 80 pieces
    x = np.random.default_rng(1).random((2, 4096)).astype(np.float32)
    body = json.dumps({"inputs": [{"name": "x", "shape": [2, 4096], "datatype": "FP32",
                                   "data": x.ravel().tolist()}]}).encode()
    order: list[str] = []

    async def go() -> None:
        app = app_module.create_app(_Wide(), max_body_bytes=4 << 20)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            async def infer() -> httpx.Response:
                r = await c.post("/v2/models/wide/infer", content=body)
                order.append("infer")
                return r

            async def live() -> None:
                await asyncio.sleep(0)  # the infer request is under way first
                r = await c.get("/v2/health/live")
                assert r.status_code == 200
                order.append("live")

            r, _ = await asyncio.gather(infer(), live())
            assert r.status_code == 200, r.text
            got = np.array(r.json()["outputs"][0]["data"], np.float32).reshape(2, 4096)
            np.testing.assert_array_equal(got, x * 2)

    asyncio.run(go())
    assert order == ["live", "infer"]  # served between two pieces of the infer's numbers


def _big_double_body(rows: int) -> tuple[bytes, list[float]]:
    values = [float(i % 97) / 8 for i in range(rows * 3)]
    doc = {"inputs": [{"name": "x", "shape": [rows, 3], "datatype": "FP32", "data": values}]}
    return json.dumps(doc).encode(), values


class _RefusesBigBatches(FakeBackend):
    """Refuses batches over 2 by their size, as the runtime's admission does."""

    def check_batch(self, model: str, n: int, since_s: float = 0.0,
                    ready_s: float = 0.0) -> None:
        from dstack.common.errors import Overloaded

        if n > 2:
            raise Overloaded(f"a batch of {n} does not fit")


def test_a_request_refused_by_its_batch_size_is_refused_before_its_numbers_are_parsed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from server import json_tensors

    parsed: list[int] = []
    real = json_tensors.decode_flat

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        parsed.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(json_tensors, "decode_flat", spy)
    backend = _RefusesBigBatches()
    with TestClient(app_module.create_app(backend, max_body_bytes=4 << 20)) as c:
        body, _ = _big_double_body(4)
        r = c.post("/v2/models/double/infer", content=body)
        assert r.status_code == 429, r.text
        assert "a batch of 4" in r.json()["error"]
        assert parsed == []  # refused on its header alone
        # Its numbers were never read: garbage there does not change the answer.
        r = c.post("/v2/models/double/infer", content=body.replace(b"0.125", b"0.1.2.5"))
        assert r.status_code == 429, r.text
        body, values = _big_double_body(2)
        r = c.post("/v2/models/double/infer", content=body)
        assert r.status_code == 200, r.text
        assert r.json()["outputs"][0]["data"] == [2 * v for v in values]
        assert parsed == [1] and backend.calls["double"] == [2]
