"""Local networking helpers every process that binds on this machine shares (stdlib only, so the
GPU machine's scripts use it too)."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` (an address of this machine) that nothing listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port
