"""The MPS control-daemon helpers now live in `dstack.common.mps` (the runtime needs them too);
re-exported here so the profiler's imports stay as they were."""

from __future__ import annotations

from dstack.common.mps import (
    CONTROL,
    MpsError,
    PrivateDaemon,
    client_list,
    control,
    daemon_answers,
    server_list,
    start_private_daemon,
    verify_client,
)

__all__ = [
    "CONTROL",
    "MpsError",
    "PrivateDaemon",
    "client_list",
    "control",
    "daemon_answers",
    "server_list",
    "start_private_daemon",
    "verify_client",
]
