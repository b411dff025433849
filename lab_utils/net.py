"""The one network helper the launchers, the test clusters and the labs share."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the system picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
