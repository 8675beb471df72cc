"""A free TCP port on one address: for the children the server starts that need a port chosen before they
start (a vLLM instance, its NIXL side channel, Mooncake's master and client). The port is free when this returns;
the child binds it moments later (the same race every `--port 0`-less launcher accepts, on loopback)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
