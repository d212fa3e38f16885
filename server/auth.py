"""Optional bearer-token authentication: one shared token, compared in constant time.

The token comes from `server.auth_token_file` or the environment variable
DSTACK_AUTH_TOKEN (read once, at start-up). Requests without it get 401
`{"error": ...}` with `WWW-Authenticate: Bearer`; the answer never says anything about
the token itself. `server.auth_open_paths` (health and metrics by default) stay open.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable, Iterable, Mapping

from starlette.types import ASGIApp, Receive, Scope, Send

from dstack.common.config import ServerConfig
from server.limits import refuse

TOKEN_ENV = "DSTACK_AUTH_TOKEN"


class AuthConfigError(ValueError):
    """The token cannot be read, is empty, or is given twice."""


def load_token(cfg: ServerConfig, environ: Mapping[str, str] = os.environ) -> str | None:
    """The token to require, or None when authentication is off."""
    from_env = environ.get(TOKEN_ENV, "").strip()
    if cfg.auth_token_file is None:
        return from_env or None
    if from_env:
        raise AuthConfigError(f"both {TOKEN_ENV} and server.auth_token_file are set: give one")
    try:
        token = cfg.auth_token_file.read_text().strip()
    except OSError as e:
        raise AuthConfigError(f"server.auth_token_file: cannot read it: {e}") from None
    if not token:
        raise AuthConfigError(f"server.auth_token_file {cfg.auth_token_file} is empty")
    return token


def is_open(path: str, open_paths: Iterable[str]) -> bool:
    """An entry ending in "/" opens every path under it; any other entry, itself only."""
    return any(path == p or (p.endswith("/") and path.startswith(p)) for p in open_paths)


def has_token(headers: Iterable[tuple[bytes, bytes]], token: bytes) -> bool:
    """Whether `headers` hold `Authorization: Bearer <token>`. The scheme is
    case-insensitive (RFC 9110); the token is compared in constant time."""
    sent = next((v for k, v in headers if k == b"authorization"), b"")
    return sent[:7].lower() == b"bearer " and hmac.compare_digest(sent[7:].strip(), token)


def header_allows(token: str | None, open_paths: Iterable[str]
                  ) -> Callable[[str, list[tuple[bytes, bytes]]], bool] | None:
    """For a check made from a request's header (path, headers): whether the request may
    go on as BearerAuth would let it; None when no token is wanted."""
    if token is None:
        return None
    secret, opened = token.encode(), tuple(open_paths)
    return lambda path, headers: is_open(path, opened) or has_token(headers, secret)


class BearerAuth:
    """Lets a request through when it sends `Authorization: Bearer <token>`."""

    def __init__(self, app: ASGIApp, *, token: str, open_paths: Iterable[str]) -> None:
        self.app = app
        self.token = token.encode()
        self.open_paths = tuple(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or is_open(scope["path"], self.open_paths):
            await self.app(scope, receive, send)
            return
        if has_token(scope["headers"], self.token):
            await self.app(scope, receive, send)
            return
        await refuse(scope, send, 401,
                     "unauthorized: send the server's token as `Authorization: Bearer <token>`",
                     headers=[(b"www-authenticate", b'Bearer realm="dstack"')])
