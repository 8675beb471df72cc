"""Proving knowledge of the per-launch internal token without sending it (HMAC challenge-response).

The router, the workers and the KV receivers share a random token made at launch. Whoever accepts a
connection sends a fresh random nonce; the connecting side answers ``HMAC-SHA256(token, nonce)``. The
token itself never crosses the wire, so someone who can watch loopback or network traffic (a
non-loopback KV link, a packet capture) learns nothing they could replay: the next nonce differs.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

NONCE_BYTES = 32
MAC_BYTES = 32
_CONTEXT = b"paasbench-internal-v1\x00"


def nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def prove(token: str, nonce: bytes) -> bytes:
    return hmac.new(token.encode(), _CONTEXT + nonce, hashlib.sha256).digest()


def verify(token: str, nonce: bytes, mac: bytes) -> bool:
    return hmac.compare_digest(prove(token, nonce), mac)
