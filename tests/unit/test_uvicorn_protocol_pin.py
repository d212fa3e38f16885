"""`server.httptools_protocol` subclasses uvicorn's private `HttpToolsProtocol`: this fails,
naming what changed, when the installed uvicorn is not the pinned one or no longer has what
the subclass overrides or relies on (read `server.connection`'s docstring for why it is
kept). After a uvicorn upgrade, read the new `httptools_impl.py` against the subclass, then
update the pin and the lists here."""

from __future__ import annotations

import asyncio
import inspect
import re
from pathlib import Path

import uvicorn
from uvicorn.config import Config
from uvicorn.protocols.http import httptools_impl
from uvicorn.server import ServerState

from server.httptools_protocol import LimitedHttpToolsProtocol

CONSTRAINTS = Path(__file__).resolve().parents[2] / "constraints.txt"

#: uvicorn's methods the subclass overrides, with their parameters as it expects them.
OVERRIDDEN = {
    "__init__": ["self", "config", "server_state", "app_state", "_loop"],
    "connection_made": ["self", "transport"],
    "connection_lost": ["self", "exc"],
    "data_received": ["self", "data"],
    "eof_received": ["self"],
    "pause_writing": ["self"],
    "resume_writing": ["self"],
    "shutdown": ["self"],
    "send_400_response": ["self", "msg"],
    "on_message_begin": ["self"],
    "on_headers_complete": ["self"],
    "on_body": ["self", "body"],
    "on_message_complete": ["self"],
    "on_response_complete": ["self"],
}

#: uvicorn's methods the subclass calls without overriding them.
CALLED = ["_should_upgrade", "_unset_keepalive_if_required", "_unsupported_upgrade_warning",
          "handle_websocket_upgrade", "timeout_keep_alive_handler"]

#: What a uvicorn connection holds, which the subclass reads or replaces.
INSTANCE_ATTRIBUTES = ["client", "connections", "cycle", "expect_100_continue", "flow",
                       "headers", "logger", "loop", "parser", "pipeline", "scheme", "scope",
                       "server_state", "timeout_keep_alive", "transport"]

#: A request-response cycle's attributes the subclass reads or sets.
CYCLE_ATTRIBUTES = ["body", "disconnected", "message_event", "response_complete",
                    "response_started", "transport"]


def pinned_uvicorn() -> str:
    for line in CONSTRAINTS.read_text().splitlines():
        m = re.fullmatch(r"uvicorn==(\S+)", line.strip())
        if m:
            return m.group(1)
    raise AssertionError(f"{CONSTRAINTS} pins no uvicorn version (uvicorn==X)")


def test_installed_uvicorn_is_the_pinned_one() -> None:
    pinned = pinned_uvicorn()
    assert uvicorn.__version__ == pinned, (
        f"uvicorn {uvicorn.__version__} is installed but constraints.txt pins {pinned}: "
        "server.httptools_protocol subclasses uvicorn's private HttpToolsProtocol and is "
        "checked against the pinned version only")


def test_overridden_methods_keep_their_signatures() -> None:
    base = httptools_impl.HttpToolsProtocol
    changed = []
    for name, params in OVERRIDDEN.items():
        if not hasattr(base, name):
            changed.append(f"{name}: gone from uvicorn's HttpToolsProtocol")
            continue
        have = list(inspect.signature(getattr(base, name)).parameters)
        if have != params:
            changed.append(f"{name}: uvicorn's takes {have}, the subclass expects {params}")
    assert not changed, ("uvicorn's HttpToolsProtocol changed under "
                         "server.httptools_protocol.LimitedHttpToolsProtocol: "
                         + "; ".join(changed))
    # and the list above is complete: every override of a uvicorn method is in it
    ours = {n for n in LimitedHttpToolsProtocol.__dict__
            if callable(getattr(LimitedHttpToolsProtocol, n)) and hasattr(base, n)}
    assert ours <= set(OVERRIDDEN), f"overrides not checked here: {sorted(ours - set(OVERRIDDEN))}"


def test_what_the_subclass_relies_on_is_still_there() -> None:
    base = httptools_impl.HttpToolsProtocol
    missing = [f"HttpToolsProtocol.{n}" for n in CALLED if not callable(getattr(base, n, None))]
    loop = asyncio.new_event_loop()
    try:
        config = Config(app=lambda scope, receive, send: None)
        config.load()
        conn = base(config=config, server_state=ServerState(), app_state={}, _loop=loop)
        missing += [f"a connection's .{n}" for n in INSTANCE_ATTRIBUTES if not hasattr(conn, n)]
    finally:
        loop.close()
    cycle_params = inspect.signature(httptools_impl.RequestResponseCycle.__init__).parameters
    init = inspect.getsource(httptools_impl.RequestResponseCycle.__init__)
    missing += [f"RequestResponseCycle.{n}" for n in CYCLE_ATTRIBUTES
                if f"self.{n} " not in init and f"self.{n}:" not in init and n not in cycle_params]
    if not isinstance(getattr(httptools_impl, "STATUS_LINE", None), dict):
        missing.append("httptools_impl.STATUS_LINE (a dict of status lines)")
    assert not missing, ("uvicorn no longer has what server.httptools_protocol relies on: "
                         + ", ".join(missing))
