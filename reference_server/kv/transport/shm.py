"""Same-host KV transfer through POSIX shared memory: one segment per request.

The sender writes the encoded frames into a fresh segment and hands the receiver a :class:`ShmRef`
(name + length, small enough for any control message). The receiver maps it, verifies and decodes,
copies the KV out (or lets a ``consume`` callback copy it straight into the engine pool), and unlinks
it. One copy in, one copy out, no socket.

Leak policy. Ownership of a segment passes to the receiver at ``send``: the sender drops it from
Python's resource tracker (otherwise the tracker would unlink a segment still in flight when the
sender exits, or warn about one the receiver already unlinked). The sender still remembers what it
created: :meth:`ShmSender.reap` unlinks segments older than ``ttl_s`` that no receiver took (a
crashed or cancelled receiver), and :meth:`ShmSender.close` unlinks all of them.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any, Callable

import numpy as np

from reference_server.engine.base import ModelShape, VirtualKV
from reference_server.kv.codec import KVIntegrityError, TransferMeta, corrupt, decode, encode, frames_nbytes, payload_len
from reference_server.kv.transport.common import Link, Received, TransferStats


@dataclass(frozen=True, slots=True)
class ShmRef:
    request_id: str
    name: str
    nbytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "name": self.name, "nbytes": self.nbytes}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ShmRef":
        return cls(str(d["request_id"]), str(d["name"]), int(d["nbytes"]))


def _unlink(name: str) -> bool:
    """Unlink a segment by name if it still exists (attach + unlink keeps the tracker balanced)."""
    try:
        seg = SharedMemory(name=name)
    except FileNotFoundError:
        return False
    seg.close()
    seg.unlink()
    return True


def _unlink_all(names: dict[str, float]) -> None:
    for name in list(names):
        _unlink(name)
    names.clear()


class ShmSender:
    def __init__(self, ttl_s: float = 120.0) -> None:
        self.ttl_s = ttl_s
        self._created: dict[str, float] = {}      # name -> creation time (perf_counter)
        self._finalizer = weakref.finalize(self, _unlink_all, self._created)

    def send(self, meta: TransferMeta, kv: np.ndarray | VirtualKV, *, flip_byte: int | None = None) -> tuple[ShmRef, TransferStats]:
        """Encode ``kv`` into a new segment. ``flip_byte`` corrupts one payload byte (fault injection)."""
        t0 = time.perf_counter()
        self.reap()
        frames = encode(meta, kv)
        if flip_byte is not None:
            frames = corrupt(frames, flip_byte)
        n = frames_nbytes(frames)
        seg = SharedMemory(create=True, size=n)
        try:
            resource_tracker.unregister(seg._name, "shared_memory")  # ownership passes to the receiver
            self._created[seg.name] = t0
            off = 0
            for f in frames:
                m = memoryview(f).cast("B")
                seg.buf[off:off + m.nbytes] = m
                off += m.nbytes
        finally:
            seg.close()
        virtual = isinstance(kv, VirtualKV)
        payload = payload_len(frames[0])
        return ShmRef(meta.request_id, seg.name, n), TransferStats(
            meta.request_id, "shm", payload, n, time.perf_counter() - t0, virtual=virtual)

    def discard(self, ref: ShmRef) -> None:
        """The transfer was cancelled: free its segment if the receiver has not."""
        self._created.pop(ref.name, None)
        _unlink(ref.name)

    def reap(self) -> int:
        """Unlink segments no receiver took within ``ttl_s``; returns how many were still there."""
        cutoff = time.perf_counter() - self.ttl_s
        stale = [name for name, t in self._created.items() if t < cutoff]
        for name in stale:
            del self._created[name]
        return sum(_unlink(name) for name in stale)

    def outstanding(self) -> list[str]:
        return list(self._created)

    def close(self) -> None:
        self._finalizer()


def shm_receive(ref: ShmRef, *, expect: ModelShape, block_size: int | None = None, link: Link | None = None,
                consume: Callable[[TransferMeta, Any], None] | None = None) -> Received:
    """Map, verify, hand over and unlink one segment; never raises for bad KV (see ``Received.error``).

    With ``consume``, it is called with a view into the segment (install it into the pool there, e.g.
    ``engine.write_blocks``) and ``Received.kv`` is None; without, ``Received.kv`` is an owned copy.
    """
    t0 = time.perf_counter()
    stats = TransferStats(ref.request_id, "shm", 0, ref.nbytes, 0.0)
    meta = kv = err = None
    try:
        seg = SharedMemory(name=ref.name)
    except FileNotFoundError:
        err = KVIntegrityError("truncated", f"shared memory segment {ref.name} is gone")
    else:
        buf = seg.buf[:ref.nbytes]
        try:
            meta, kv = decode(buf, expect=expect, block_size=block_size)
            if meta.request_id != ref.request_id:
                raise KVIntegrityError("format", f"segment holds {meta.request_id!r}, expected {ref.request_id!r}")
            stats.virtual = isinstance(kv, VirtualKV)
            stats.payload_bytes = payload_len(buf)
            if link is not None:
                stats.modeled_s = link.wait(stats.payload_bytes, t0)
            if consume is not None:
                consume(meta, kv)
                kv = None
            elif isinstance(kv, np.ndarray) and np.shares_memory(kv, np.frombuffer(buf, np.uint8)):
                kv = kv.copy()
        except KVIntegrityError as e:
            err, kv = e.with_traceback(None), None   # the traceback would pin views into the segment
        finally:
            try:
                buf.release()
                seg.close()
            except BufferError:       # a consume callback kept a view: the mapping lives until it dies
                pass
            seg.unlink()
    stats.elapsed_s = time.perf_counter() - t0
    stats.error = err.reason if err else None
    return Received(ref.request_id, meta, kv, stats, err)
