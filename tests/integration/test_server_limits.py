"""The pieces of the server limits that need no server process: config checks, the token
source, open paths, and big JSON bodies decoded off the event loop. The limits themselves
are checked against a real server in tests/e2e/test_server_limits.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from dstack.common.config import ConfigError, ServerConfig, parse_config
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


def test_a_big_json_body_is_decoded_in_a_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    threads: list[object] = []
    real = asyncio.to_thread

    async def spy(fn, *args):  # noqa: ANN001, ANN202
        threads.append(fn)
        return await real(fn, *args)

    monkeypatch.setattr(app_module.asyncio, "to_thread", spy)
    doc = {"inputs": [{"name": "x", "shape": [2, 3], "datatype": "FP32",
                       "data": [1, 2, 3, 4, 5, 6]}]}
    small = json.dumps(doc).encode()
    big = small + b" " * app_module.DECODE_INLINE_BYTES  # still one JSON document
    with TestClient(app_module.create_app(FakeBackend(), max_body_bytes=4 << 20)) as c:
        for body in (small, big):
            r = c.post("/v2/models/double/infer", content=body)
            assert r.status_code == 200, r.text
            assert r.json()["outputs"][0]["data"] == [2, 4, 6, 8, 10, 12]
    assert threads == [app_module.codec.decode_request]  # the big one only
