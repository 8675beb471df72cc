"""Control-plane messages between the router and the workers: framed JSON plus an optional binary blob.

One frame = 8-byte header (JSON length, blob length, big-endian u32) + UTF-8 JSON + blob. Token id
lists travel as int32 blobs, not JSON, so a 400K-token prompt costs 1.6 MB of memcpy instead of a
multi-megabyte JSON encode/parse. Every connection starts with a challenge-response on the per-launch
internal token (:mod:`reference_server.challenge`): the worker sends ``{"op": "challenge", "nonce"}``,
the caller answers ``{"op": "hello", "mac"}``, and a worker closes any connection whose answer is wrong;
the token itself never crosses the wire.

Workers use blocking sockets and threads (their engine loop is blocking anyway); the router uses
asyncio streams. Both share the framing functions below.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
from typing import Any, Callable

import numpy as np

from reference_server import challenge

_HEADER = struct.Struct("!II")
MAX_JSON = 16 << 20
MAX_BLOB = 1 << 31


class AuthError(ConnectionError):
    pass


def pack(msg: dict[str, Any], blob: bytes | memoryview = b"") -> bytes:
    body = json.dumps(msg, separators=(",", ":")).encode()
    return _HEADER.pack(len(body), len(blob)) + body + bytes(blob)


def tokens_blob(token_ids: Any) -> bytes:
    return np.asarray(token_ids, dtype=np.int32).tobytes()


def blob_tokens(blob: bytes) -> list[int]:
    return np.frombuffer(blob, dtype=np.int32).tolist()


def _check_lengths(jlen: int, blen: int) -> None:
    if jlen > MAX_JSON or blen > MAX_BLOB:
        raise ConnectionError(f"frame too large ({jlen}, {blen})")


# ---------------------------------------------------------------- blocking side (worker processes)

def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("peer closed")
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket) -> tuple[dict[str, Any], bytes]:
    jlen, blen = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    _check_lengths(jlen, blen)
    msg = json.loads(_recv_exact(sock, jlen))
    blob = _recv_exact(sock, blen) if blen else b""
    return msg, blob


def drain(sock: socket.socket) -> None:
    """Read and discard until the peer closes ``sock`` (or it fails): for a connection on which nothing is
    expected, so that its close is noticed."""
    try:
        while sock.recv(4096):
            pass
    except OSError:
        pass


class Conn:
    """A worker's end of one authenticated connection; ``send`` is thread-safe."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._lock = threading.Lock()
        self.closed = False

    def send(self, msg: dict[str, Any], blob: bytes = b"") -> None:
        data = pack(msg, blob)
        with self._lock:
            if self.closed:
                return
            try:
                self.sock.sendall(data)
            except OSError:
                self.closed = True


class Peers:
    """Authenticated connections to other workers' control ports (worker to worker: a prefill worker's ``kv``
    notes to decode workers), opened on first use. Nothing is expected back on them, so each is drained: when
    the peer closes it the connection is marked closed and the next :meth:`get` opens a new one, instead of the
    next note vanishing into a socket the peer no longer reads."""

    def __init__(self, token: str) -> None:
        self.token = token
        self._conns: dict[tuple[str, int], Conn] = {}
        self._lock = threading.Lock()

    def get(self, host: str, port: int) -> Conn:
        with self._lock:
            conn = self._conns.get((host, port))
            if conn is None or conn.closed:
                conn = self._conns[(host, port)] = Conn(connect_blocking(host, port, self.token))
                threading.Thread(target=self._drain, args=(conn,), daemon=True, name="peer-drain").start()
            return conn

    @staticmethod
    def _drain(conn: Conn) -> None:
        drain(conn.sock)
        with conn._lock:
            conn.closed = True
        try:
            conn.sock.close()
        except OSError:
            pass


def serve_blocking(host: str, token: str, on_message: Callable[[Conn, dict[str, Any], bytes], None],
                   on_close: Callable[[Conn], None] | None = None) -> tuple[socket.socket, int]:
    """Listen on ``host:0``; one reader thread per connection. Returns the socket and its port."""
    srv = socket.create_server((host, 0))
    port = srv.getsockname()[1]

    def reader(sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = Conn(sock)
        try:
            sock.settimeout(10.0)  # the answer must come promptly
            n, ask = challenge.ask()
            conn.send(ask)
            hello, _ = recv_frame(sock)
            if not challenge.proven(token, n, hello, "hello"):
                conn.send({"op": "error", "error": "unauthorized"})
                return
            sock.settimeout(None)
            conn.send({"op": "welcome"})
            while True:
                msg, blob = recv_frame(sock)
                on_message(conn, msg, blob)
        except (ConnectionError, OSError, ValueError):
            pass
        finally:
            conn.closed = True
            try:
                sock.close()
            except OSError:
                pass
            if on_close is not None:
                on_close(conn)

    def acceptor() -> None:
        while True:
            try:
                sock, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=reader, args=(sock,), daemon=True).start()

    threading.Thread(target=acceptor, daemon=True, name="ipc-accept").start()
    return srv, port


# ---------------------------------------------------------------- asyncio side (router)

async def read_frame(reader: asyncio.StreamReader) -> tuple[dict[str, Any], bytes]:
    jlen, blen = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    _check_lengths(jlen, blen)
    msg = json.loads(await reader.readexactly(jlen))
    blob = await reader.readexactly(blen) if blen else b""
    return msg, blob


async def open_authenticated(host: str, port: int, token: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
    try:
        msg, _ = await asyncio.wait_for(read_frame(reader), 10.0)
        writer.write(pack(_answer(msg, token, host, port)))
        await writer.drain()
        msg, _ = await asyncio.wait_for(read_frame(reader), 10.0)
    except BaseException:
        writer.close()
        raise
    if msg.get("op") != "welcome":
        writer.close()
        raise AuthError(f"worker at {host}:{port} refused the connection: {msg.get('error')}")
    return reader, writer


def connect_blocking(host: str, port: int, token: str, timeout_s: float = 10.0) -> socket.socket:
    """A blocking, authenticated connection to a worker's control port (worker to worker)."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        msg, _ = recv_frame(sock)
        sock.sendall(pack(_answer(msg, token, host, port)))
        msg, _ = recv_frame(sock)
        if msg.get("op") != "welcome":
            raise AuthError(f"worker at {host}:{port} refused the connection: {msg.get('error')}")
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    return sock


def _answer(msg: dict[str, Any], token: str, host: str, port: int) -> dict[str, Any]:
    hello = challenge.answer(token, msg)
    if hello is None:
        raise AuthError(f"worker at {host}:{port} sent no challenge: {msg.get('op')!r}")
    return hello
