"""Proving knowledge of the per-launch internal token without sending it (HMAC challenge-response).

The router, the workers and the KV receivers share a random token made at launch. Whoever accepts a
connection sends a fresh random nonce; the connecting side answers ``HMAC-SHA256(token, nonce)``. The
token itself never crosses the wire, so someone who can watch loopback or network traffic (a
non-loopback KV link, a packet capture) learns nothing they could replay: the next nonce differs.

The control channel's messages (:mod:`reference_server.ipc`, and the join of a worker from another host,
:mod:`reference_server.join` with the supervisor's side) are made and checked here, once: :func:`ask`,
:func:`answer`, :func:`proven`. The KV link (:mod:`reference_server.kv.transport.tcp`) frames the same
nonce and proof as raw bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Any

NONCE_BYTES = 32
MAC_BYTES = 32
_CONTEXT = b"paasbench-internal-v1\x00"


def nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def prove(token: str, nonce: bytes) -> bytes:
    return hmac.new(token.encode(), _CONTEXT + nonce, hashlib.sha256).digest()


def verify(token: str, nonce: bytes, mac: bytes) -> bool:
    return hmac.compare_digest(prove(token, nonce), mac)


def ask() -> tuple[bytes, dict[str, Any]]:
    """A fresh nonce and the ``challenge`` message that carries it."""
    n = nonce()
    return n, {"op": "challenge", "nonce": n.hex()}


def answer(token: str, msg: dict[str, Any], **extra: Any) -> dict[str, Any] | None:
    """The ``hello`` that answers the challenge message ``msg`` (with ``extra`` fields); None when ``msg`` is
    not a challenge (the caller says whose)."""
    if msg.get("op") != "challenge":
        return None
    return {"op": "hello", "mac": mac_hex(token, msg.get("nonce")), **extra}


def mac_hex(token: str, nonce_hex: Any) -> str:
    """The proof for a nonce as it travels (hex), for whoever answers a challenge."""
    return prove(token, unhex(nonce_hex)).hex()


def proven(token: str, nonce: bytes, msg: dict[str, Any], op: str) -> bool:
    """``msg`` is an ``op`` message whose ``mac`` proves its sender holds ``token`` for ``nonce``."""
    return msg.get("op") == op and verify(token, nonce, unhex(msg.get("mac")))


def unhex(value: Any) -> bytes:
    """Hex from the wire as bytes; anything else is empty (and so fails :func:`verify`)."""
    try:
        return bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        return b""
