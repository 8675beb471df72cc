"""Cross-host KV transfer over TCP: length-prefixed messages on a persistent, authenticated connection.

Wire protocol (all little-endian)::

    server         b"PKVC" nonce (32 bytes)
    client hello   b"PKVH" HMAC-SHA256(token, nonce)   server: b"OK" | b"NO" (then closes)
    per message    u64 len  u16 rid_len request_id  message (codec.encode frames, len bytes)
    server ack     u8 status (0 ok, 1 rejected) u16 reason_len reason

The token never crosses the wire (:mod:`reference_server.challenge`). The request id travels outside the message so a receiver can name the request even when the
message header itself is corrupt, and the waiting decode worker recomputes at once instead of
timing out. Blocking sockets in threads rather than asyncio streams: ``recv_into`` a preallocated
buffer and ``sendall`` of memoryviews release the GIL and copy each byte once, where StreamReader
would copy it again through its buffer.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from collections import Counter
from typing import Any, Callable

import numpy as np

from reference_server import challenge
from reference_server.engine.base import ModelShape, VirtualKV
from reference_server.kv.codec import KVIntegrityError, TransferMeta, corrupt, encode, frames_nbytes, payload_len
from reference_server.kv.transport.common import Link, Received, TransferStats, verify

HELLO = b"PKVH"
CHALLENGE = b"PKVC"
_ACK = struct.Struct("<BH")
_MIN_RATE = 50e6          # bytes/s a transfer may not fall below before it times out


class KVAuthError(PermissionError):
    """The receiver refused our token."""


def _recv_exact(sock: socket.socket, n: int, into: memoryview | None = None) -> memoryview:
    buf = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(buf[got:], n - got)
        if k == 0:
            raise ConnectionError(f"peer closed after {got} of {n} bytes")
        got += k
    return buf


class Mailbox:
    """Received transfers keyed by request id, for a sync or asyncio consumer that may come first or
    last. Unclaimed items beyond ``max_pending`` drop oldest first (their requests will recompute)."""

    def __init__(self, max_pending: int = 1024) -> None:
        self.max_pending = max_pending
        self._items: dict[str, Received] = {}
        self._futures: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._cond = threading.Condition()

    def put(self, item: Received) -> None:
        with self._cond:
            waiter = self._futures.pop(item.request_id, None)
            if waiter is None:
                self._items[item.request_id] = item
                while len(self._items) > self.max_pending:
                    self._items.pop(next(iter(self._items)))
                self._cond.notify_all()
        if waiter is not None:
            loop, fut = waiter
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(item))

    def get(self, request_id: str, timeout: float | None = None) -> Received:
        with self._cond:
            if not self._cond.wait_for(lambda: request_id in self._items, timeout):
                raise TimeoutError(f"no KV for {request_id} within {timeout}s")
            return self._items.pop(request_id)

    async def aget(self, request_id: str, timeout: float | None = None) -> Received:
        loop = asyncio.get_running_loop()
        with self._cond:
            if request_id in self._items:
                return self._items.pop(request_id)
            fut = loop.create_future()
            self._futures[request_id] = (loop, fut)
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no KV for {request_id} within {timeout}s") from None
        finally:
            with self._cond:
                if self._futures.get(request_id, (None, None))[1] is fut:
                    del self._futures[request_id]

    def discard(self, request_id: str) -> None:
        with self._cond:
            self._items.pop(request_id, None)


class KVReceiver:
    """Accepts KV messages and delivers each as a :class:`Received` to ``on_receive`` (called on the
    connection's thread) or, by default, to a :class:`Mailbox` read with :meth:`wait` / :meth:`wait_async`.

    ``token``: when set, a connection must present it first or is refused (counted in
    ``auth_failures``). ``link``: a modeled wire (sim) that delays delivery and ack.
    ``borrow``: with ``on_receive``, each connection reuses one receive buffer and ``Received.kv`` is
    a view valid only during the callback (install it into the pool there): no page faults on a fresh
    buffer per message. Otherwise every message gets its own buffer, which ``Received.kv`` owns.
    """

    def __init__(self, expect: ModelShape, *, block_size: int | None = None, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, link: Link | None = None,
                 on_receive: Callable[[Received], None] | None = None, borrow: bool = False,
                 max_message_bytes: int = 1 << 36) -> None:
        if borrow and on_receive is None:
            raise ValueError("borrow=True needs an on_receive callback that consumes the KV")
        self.expect, self.block_size, self.link = expect, block_size, link
        self.max_message_bytes = max_message_bytes
        self.mailbox = Mailbox()
        self.on_receive = on_receive or self.mailbox.put
        self.borrow = borrow
        self.received = 0
        self.rejected: Counter[str] = Counter()      # KVIntegrityError reason -> count
        self.auth_failures = 0
        self._token = token or None
        self._sock = socket.create_server((host, port))
        self._sock.settimeout(0.2)
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name="kv-receiver", daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        return self._sock.getsockname()[:2]

    def start(self) -> "KVReceiver":
        self._thread.start()
        return self

    def wait(self, request_id: str, timeout: float | None = None) -> Received:
        return self.mailbox.get(request_id, timeout)

    async def wait_async(self, request_id: str, timeout: float | None = None) -> Received:
        return await self.mailbox.aget(request_id, timeout)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            for c in self._conns:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        if self._thread.is_alive():
            self._thread.join(2)
        self._sock.close()

    def __enter__(self) -> "KVReceiver":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- per connection ------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="kv-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.add(conn)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not self._handshake(conn):
                return
            conn.settimeout(None)
            spare = np.empty(0, np.uint8)
            while not self._closed.is_set():
                spare = self._one_message(conn, spare)
        except (ConnectionError, OSError):
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _handshake(self, conn: socket.socket) -> bool:
        conn.settimeout(10)
        n = challenge.nonce()
        conn.sendall(CHALLENGE + n)
        hello = bytes(_recv_exact(conn, len(HELLO) + challenge.MAC_BYTES))
        mac = hello[len(HELLO):]
        if hello[:4] != HELLO or (self._token is not None and not challenge.verify(self._token, n, mac)):
            with self._lock:
                self.auth_failures += 1
            conn.sendall(b"NO")
            return False
        conn.sendall(b"OK")
        return True

    def _one_message(self, conn: socket.socket, spare: np.ndarray) -> np.ndarray:
        """Receive, verify and deliver one message; returns the buffer to reuse (borrow mode)."""
        n, rid_len = struct.unpack("<QH", _recv_exact(conn, 10))
        t0 = time.perf_counter()
        rid = bytes(_recv_exact(conn, rid_len)).decode()
        if n > self.max_message_bytes:
            raise ConnectionError(f"message of {n} bytes exceeds {self.max_message_bytes}")
        if self.borrow and spare.size < n:
            spare = np.empty(n, np.uint8)
        buf = spare[:n] if self.borrow else np.empty(n, np.uint8)
        conn.settimeout(30 + n / _MIN_RATE)
        _recv_exact(conn, n, memoryview(buf))
        conn.settimeout(None)
        stats = TransferStats(rid, "tcp", 0, n + 10 + rid_len, 0.0)
        meta = kv = err = None
        try:
            meta, kv = verify(buf, rid, stats, t0, expect=self.expect, block_size=self.block_size, link=self.link)
        except KVIntegrityError as e:
            err, kv = e.with_traceback(None), None
        stats.elapsed_s = time.perf_counter() - t0
        stats.error = err.reason if err else None
        with self._lock:
            if err:
                self.rejected[err.reason] += 1
            else:
                self.received += 1
        self.on_receive(Received(rid, meta, kv, stats, err))
        reason = err.reason.encode() if err else b""
        conn.sendall(_ACK.pack(1 if err else 0, len(reason)) + reason)
        return spare


class KVSender:
    """One persistent connection to a :class:`KVReceiver`; sends are serialized (one wire)."""

    def __init__(self, host: str, port: int, *, token: str | None = None, timeout_s: float = 30.0) -> None:
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self._token = token or ""
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def send(self, meta: TransferMeta, kv: np.ndarray | VirtualKV, *, flip_byte: int | None = None) -> TransferStats:
        """Encode and send; returns once the receiver has verified it (``error`` set if it rejected).
        ``flip_byte`` corrupts one payload byte on the way (fault injection)."""
        t0 = time.perf_counter()
        frames = encode(meta, kv)
        if flip_byte is not None:
            frames = corrupt(frames, flip_byte)
        n = frames_nbytes(frames)
        rid = meta.request_id.encode()
        virtual = isinstance(kv, VirtualKV)
        payload = payload_len(frames[0])
        with self._lock:
            for attempt in (0, 1):              # a stale pooled connection gets one fresh retry
                sock = self._connect()
                try:
                    sock.settimeout(self.timeout_s + max(n, payload) / _MIN_RATE)
                    sock.sendall(struct.pack("<QH", n, len(rid)) + rid + bytes(frames[0]))
                    for f in frames[1:]:
                        sock.sendall(f)
                    status, rlen = _ACK.unpack(_recv_exact(sock, _ACK.size))
                    reason = bytes(_recv_exact(sock, rlen)).decode() if rlen else None
                    break
                except TimeoutError:
                    self._drop()
                    raise
                except (ConnectionError, OSError):
                    self._drop()
                    if attempt:
                        raise
        return TransferStats(meta.request_id, "tcp", payload, n + 10 + len(rid), time.perf_counter() - t0,
                             virtual=virtual, error=reason if status else None)

    async def send_async(self, meta: TransferMeta, kv: np.ndarray | VirtualKV, **kw: Any) -> TransferStats:
        return await asyncio.to_thread(self.send, meta, kv, **kw)

    def close(self) -> None:
        with self._lock:
            self._drop()

    def __enter__(self) -> "KVSender":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout_s)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                head = bytes(_recv_exact(sock, len(CHALLENGE) + challenge.NONCE_BYTES))
                if head[:4] != CHALLENGE:
                    raise KVAuthError(f"KV receiver {self.host}:{self.port} sent no challenge")
                sock.sendall(HELLO + challenge.prove(self._token, head[4:]))
                answer = bytes(_recv_exact(sock, 2))
            except BaseException:
                sock.close()
                raise
            if answer != b"OK":
                sock.close()
                raise KVAuthError(f"KV receiver {self.host}:{self.port} refused the token")
            self._sock = sock
        return self._sock

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
