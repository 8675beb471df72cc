"""The per-launch internal token never crosses the wire: the control channel (router and worker to
worker) and the TCP KV link both answer a fresh nonce with HMAC-SHA256(token, nonce). Each test plays
the accepting side with a recording socket and checks what the connecting side sent."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading

import pytest

from reference_server import challenge
from reference_server.ipc import AuthError, connect_blocking, open_authenticated, pack
from reference_server.kv.transport.tcp import CHALLENGE, HELLO, KVAuthError, KVSender

TOKEN = "per-launch-t0ken-4f2a"


def _serve_once(respond) -> tuple[int, dict, threading.Thread]:
    """Accept one connection on loopback and hand it to ``respond(sock, seen)``; ``seen`` records."""
    srv = socket.create_server(("127.0.0.1", 0))
    seen: dict = {}

    def run() -> None:
        conn, _ = srv.accept()
        with conn:
            respond(conn, seen)
        srv.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return srv.getsockname()[1], seen, t


def _control_server(conn: socket.socket, seen: dict) -> None:
    n = challenge.nonce()
    conn.sendall(pack({"op": "challenge", "nonce": n.hex()}))
    head = conn.recv(8)
    jlen, _ = struct.unpack("!II", head)
    body = conn.recv(jlen)
    seen.update(raw=head + body, nonce=n, hello=json.loads(body))
    conn.sendall(pack({"op": "welcome"}))


def _check_control(seen: dict) -> None:
    assert TOKEN.encode() not in seen["raw"]                                   # before: {"token": TOKEN}
    assert challenge.verify(TOKEN, seen["nonce"], bytes.fromhex(seen["hello"]["mac"]))


def test_router_control_connection_answers_the_challenge():
    port, seen, t = _serve_once(_control_server)
    _, writer = asyncio.run(_open(port))
    t.join(5)
    _check_control(seen)


async def _open(port: int):
    reader, writer = await open_authenticated("127.0.0.1", port, TOKEN)
    writer.close()
    return reader, writer


def test_worker_to_worker_connection_answers_the_challenge():
    port, seen, t = _serve_once(_control_server)
    connect_blocking("127.0.0.1", port, TOKEN).close()
    t.join(5)
    _check_control(seen)


def test_a_peer_that_sends_no_challenge_is_not_trusted():
    port, _, t = _serve_once(lambda conn, seen: conn.sendall(pack({"op": "welcome"})))
    with pytest.raises(AuthError, match="no challenge"):
        connect_blocking("127.0.0.1", port, TOKEN)
    t.join(5)


def test_tcp_kv_link_answers_the_challenge():
    def kv_server(conn: socket.socket, seen: dict) -> None:
        n = challenge.nonce()
        conn.sendall(CHALLENGE + n)
        got = b""
        while len(got) < len(HELLO) + challenge.MAC_BYTES:
            got += conn.recv(64)
        seen.update(raw=got, nonce=n)
        conn.sendall(b"NO")                                  # refuse: the sender must say so

    port, seen, t = _serve_once(kv_server)
    with pytest.raises(KVAuthError, match=f"KV receiver 127.0.0.1:{port} refused the token"):
        KVSender("127.0.0.1", port, token=TOKEN)._connect()
    t.join(5)
    assert TOKEN.encode() not in seen["raw"]
    assert seen["raw"][:4] == HELLO and challenge.verify(TOKEN, seen["nonce"], seen["raw"][4:])


@pytest.mark.parametrize("router_token", [TOKEN, "another-t0ken-9c1d"])
def test_join_checks_the_routers_proof_too(router_token: str):
    """A joining worker answers the router's challenge and challenges it back in its ``hello``: it takes the
    router's configuration only from a ``welcome`` whose mac proves the router holds the same token."""
    from reference_server.ipc import recv_frame
    from reference_server.join import JoinRefused, handshake

    def router(conn: socket.socket, seen: dict) -> None:
        n, ask = challenge.ask()
        conn.sendall(pack(ask))
        hello, _ = recv_frame(conn)
        seen.update(proved=challenge.proven(router_token, n, hello, "hello"), role=hello.get("role"))
        conn.sendall(pack({"op": "welcome", "mac": challenge.mac_hex(router_token, hello.get("nonce")), "index": 0}))

    port, seen, t = _serve_once(router)
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        if router_token == TOKEN:
            assert handshake(sock, TOKEN, "decode", "127.0.0.1")["index"] == 0
        else:
            with pytest.raises(JoinRefused, match="did not prove"):
                handshake(sock, TOKEN, "decode", "127.0.0.1")
    finally:
        sock.close()
    t.join(5)
    assert seen["role"] == "decode" and seen["proved"] == (router_token == TOKEN)
