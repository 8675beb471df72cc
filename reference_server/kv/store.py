"""The host's shared KV store: every worker process puts the blocks it computed and onboards the
blocks another worker computed (the role of Mooncake Store, LMCache, Dynamo KVBM, SGLang HiCache).

One POSIX shared-memory segment per server (the router creates it, every worker attaches), keyed by
the block manager's chained block hashes. A block hash names the whole prefix up to that block for
one model version and one tenant (``block_manager.chain_hashes``), so the store needs no other key:
another tenant or model version never hits, and a value never changes once published (the key is a
function of the value, as in Mooncake Store). Capacity is a number of blocks; when full, a put
evicts the least recently used unpinned blocks; within one put or get the deeper blocks of a prefix
count as older than its head, so eviction eats prefixes from the tail.

Consistency (what a reader may see while a writer writes):

* A put claims free slots (state WRITING: invisible to every lookup), writes the bytes and their
  xxh3_64 checksum outside the lock, and only then publishes the hash in the index (state
  PUBLISHED). A reader therefore never finds a block whose bytes or checksum are incomplete.
* A get pins the blocks it found (one lock hold), copies them out without the lock, and unpins
  them. Eviction never takes a pinned block, so the bytes under a reader never change. The reader
  still verifies every block's checksum; a mismatch ends the run there, and the block is dropped
  from the store (counted in ``corrupt``): the reader computes the rest, never installs bad KV.
* Two writers racing on the same hash both write; the first to publish wins and the other's slot
  is freed (``duplicates``). Values are equal (same prefix, same model), so either is right.
* No read-your-writes across processes: a block put by a decode worker is visible to a prefill
  worker once the put published it (milliseconds after the sequence finished); a get that comes
  earlier misses and the prefill computes it. Eventual, never wrong.
* A process that dies mid-operation cannot wedge the store: the lock is ``flock`` on the segment
  (released by the kernel when its holder dies); a WRITING slot or a pin older than ``STALE_S``
  is reclaimed once the store needs the room.

Cost: a put or get costs what it touches, never the capacity. Free slots are a stack plus a
never-used tail in the header (O(k) to claim k), so the sim's default store -- 1024 GB of modeled
DRAM, 15.6M slots for the tiny profile -- pages in only the slots it uses; only eviction (a full
store) scans, and only the slots ever used.

The ``sim`` engine's KV is virtual: the store then keeps keys and declared byte counts only (no
payload region), so its capacity, hits, bytes and evictions are those of the modeled host memory.
"""

from __future__ import annotations

import _posixshmem
import fcntl
import mmap
import os
import threading
import time
from dataclasses import asdict, dataclass
from multiprocessing import resource_tracker
from typing import Any, Sequence

import numpy as np
import xxhash

from reference_server.engine.base import ModelShape, VirtualKV
from reference_server.kv.transport.shm import PREFIX, _PIDNS, _unlink

MAGIC = b"PKVS"
VERSION = 3
FREE, WRITING, PUBLISHED = 0, 1, 2
STALE_S = 60.0
_HEADER = 4096
_PAGE = 4096
# counters in the header, after 64 bytes of layout fields
_COUNTERS = ("tick", "lookups", "hits", "put_blocks", "put_bytes", "get_blocks", "get_bytes", "evictions",
             "corrupt", "duplicates", "published", "fresh", "nfree")
# fresh: slots [fresh, capacity) were never used (free without being listed); nfree: entries on the free stack


class StoreShapeError(ValueError):
    """The segment was created for another block layout than the attaching worker's engine."""


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Store counters (all processes together). Blocks and bytes; bytes are declared for virtual KV."""

    capacity_blocks: int
    block_nbytes: int
    published: int          # blocks readable now (occupancy)
    lookups: int            # blocks asked for by gets
    hits: int               # blocks a get found
    put_blocks: int
    put_bytes: int          # bytes in
    get_blocks: int
    get_bytes: int          # bytes out
    evictions: int
    corrupt: int            # blocks whose checksum failed on read (dropped)
    duplicates: int         # puts that lost a race to an identical block
    errors: int = 0         # store operations that failed (Mooncake: master or owner unreachable); each a miss
    timeouts: int = 0       # store calls a worker stopped waiting for (--kv-store-timeout), or did not make
                            # while one was unanswered (reference_server/kv/guard.py); each a miss

    @property
    def occupancy(self) -> float:
        return self.published / self.capacity_blocks if self.capacity_blocks else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "occupancy": self.occupancy, "capacity_bytes": self.capacity_blocks * self.block_nbytes,
                "published_bytes": self.published * self.block_nbytes}


def _split(h: bytes) -> tuple[int, int, int, int]:
    """A block hash (up to 256 bits: sha256 or xxh3_128, zero-padded) as four u64 words; all of it is
    the key, so a store hit is as collision-proof as the block manager's own hash."""
    if len(h) > 32:
        raise ValueError(f"block hashes are at most 32 bytes, got {len(h)}")
    b = h.ljust(32, b"\0")
    k0 = int.from_bytes(b[:8], "little") or 1          # 0 never names a key in the index
    return k0, int.from_bytes(b[8:16], "little"), int.from_bytes(b[16:24], "little"), int.from_bytes(b[24:], "little")


def _block_layout(shape: ModelShape, block_size: int) -> tuple[int, ...]:
    return (shape.layers, 2, block_size, shape.kv_heads, shape.head_dim)


class KVStore:
    """A handle on the host's store (create it once with :meth:`create`, attach with :meth:`attach`).

    Thread-safe; one handle per process."""

    def __init__(self, name: str, *, owner: bool) -> None:
        self.name = name
        self.owner = owner
        self._fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        self._mm = mmap.mmap(self._fd, os.fstat(self._fd).st_size)
        head = bytes(self._mm[:64])
        if head[:4] != MAGIC or int.from_bytes(head[4:8], "little") != VERSION:
            raise StoreShapeError(f"shared memory {name!r} is not a KV store (version {VERSION})")
        fields = np.frombuffer(self._mm, np.uint64, 5, 8)
        n, t, self.block_nbytes, self.payload_nbytes, self.block_size = (int(x) for x in fields)
        self.layout: tuple[int, ...] = ()       # one block's KV array shape and dtype (set by create/attach)
        self.dtype: Any = None
        self.capacity_blocks, self.virtual = n, self.payload_nbytes == 0
        self._mask = t - 1
        buf = self._mm
        self._ctr = np.frombuffer(buf, np.uint64, len(_COUNTERS), 64)
        off = _HEADER
        self._state = np.frombuffer(buf, np.uint32, n, off); off += 4 * n
        self._pins = np.frombuffer(buf, np.uint32, n, off); off += 4 * n
        self._k0 = np.frombuffer(buf, np.uint64, n, off); off += 8 * n
        self._k1 = np.frombuffer(buf, np.uint64, n, off); off += 8 * n
        self._k2 = np.frombuffer(buf, np.uint64, n, off); off += 8 * n
        self._k3 = np.frombuffer(buf, np.uint64, n, off); off += 8 * n
        self._tick = np.frombuffer(buf, np.uint64, n, off); off += 8 * n
        self._csum = np.frombuffer(buf, np.uint64, n, off); off += 8 * n
        self._since = np.frombuffer(buf, np.float64, n, off); off += 8 * n   # WRITING start / last pin (wall clock)
        self._free = np.frombuffer(buf, np.uint32, n, off); off += 4 * n     # stack of freed slots (nfree deep)
        self._table = np.frombuffer(buf, np.int32, t, off); off += 4 * t     # slot + 1; 0 = empty
        off = -(-off // _PAGE) * _PAGE
        self._payload = (np.frombuffer(buf, np.uint8, n * self.payload_nbytes, off).reshape(n, self.payload_nbytes)
                         if self.payload_nbytes else None)
        self._tlock = threading.Lock()

    # ---- lifecycle ------------------------------------------------------------------------------

    @classmethod
    def create(cls, capacity_bytes: int, shape: ModelShape, block_size: int, *, virtual: bool) -> "KVStore":
        """A new store of ``capacity_bytes`` (``// block bytes`` blocks). ``virtual``: keep keys and
        declared sizes only (the sim engine's KV). The caller owns it: :meth:`unlink` when done."""
        # real KV: the host arrays read_blocks returns; virtual: the declared (pool) bytes
        block_nbytes = block_size * (shape.kv_bytes_per_token() if virtual else shape.host_bytes_per_token())
        n = max(1, int(capacity_bytes // block_nbytes))
        t = 1 << max(4, (2 * n - 1).bit_length())      # index at most half full
        payload = 0 if virtual else block_nbytes
        meta = _HEADER + (4 + 4 + 8 * 7 + 4) * n + 4 * t
        size = -(-meta // _PAGE) * _PAGE + n * payload
        name = f"{PREFIX}{_PIDNS}_{os.getpid()}_store{os.urandom(4).hex()}"
        fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        try:
            os.ftruncate(fd, size)        # sparse: pages cost memory only once written
            with mmap.mmap(fd, 64) as mm:
                mm[:8] = MAGIC + VERSION.to_bytes(4, "little")
                np.frombuffer(mm, np.uint64, 5, 8)[:] = (n, t, block_nbytes, payload, block_size)
        finally:
            os.close(fd)
        # The resource tracker unlinks it if this process dies without unlink() (SIGTERM, crash); the
        # name carries our pid, so a new ShmSender's sweep_orphans() removes it after a SIGKILL.
        resource_tracker.register("/" + name, "shared_memory")
        return cls(name, owner=True)._typed(shape)

    @classmethod
    def attach(cls, name: str, shape: ModelShape, block_size: int) -> "KVStore":
        """Open the store ``name``; refuses one made for another block layout."""
        s = cls(name, owner=False)
        want = block_size * (shape.kv_bytes_per_token() if s.virtual else shape.host_bytes_per_token())
        if s.block_nbytes != want or s.block_size != block_size:
            s.close()
            raise StoreShapeError(f"store {name!r} holds {s.block_nbytes}-byte blocks of {s.block_size} tokens, "
                                  f"this engine needs {want}-byte blocks of {block_size}")
        return s._typed(shape)

    def _typed(self, shape: ModelShape) -> "KVStore":
        self.layout = _block_layout(shape, self.block_size)
        self.dtype = None if self.virtual else shape.host_dtype()
        return self

    def close(self) -> None:
        for a in ("_ctr", "_state", "_pins", "_k0", "_k1", "_k2", "_k3", "_tick", "_csum", "_since", "_table", "_payload"):
            setattr(self, a, None)
        try:
            self._mm.close()
        except BufferError:
            pass            # a caller still holds a view; the mapping goes with the process
        os.close(self._fd)

    def unlink(self) -> None:
        if _unlink(self.name) and self.owner:
            resource_tracker.unregister("/" + self.name, "shared_memory")

    # ---- queries --------------------------------------------------------------------------------

    def run_length(self, hashes: Sequence[bytes], start: int = 0) -> int:
        """Blocks ``hashes[start:]`` readable now, counted from ``start`` up to the first miss (no
        side effects: the router's estimate)."""
        with self._locked():
            n = 0
            for h in hashes[start:]:
                if self._find(*_split(h)) < 0:
                    break
                n += 1
            return n

    def missing(self, hashes: Sequence[bytes]) -> list[int]:
        """Indices of ``hashes`` the store does not hold (what a writer still has to put)."""
        with self._locked():
            return [i for i, h in enumerate(hashes) if self._find(*_split(h)) < 0]

    def stats(self) -> StoreStats:
        c = dict(zip(_COUNTERS, (int(x) for x in self._ctr)))
        return StoreStats(self.capacity_blocks, self.block_nbytes, c["published"], c["lookups"], c["hits"],
                          c["put_blocks"], c["put_bytes"], c["get_blocks"], c["get_bytes"], c["evictions"],
                          c["corrupt"], c["duplicates"])

    # ---- put ------------------------------------------------------------------------------------

    def stage(self, n: int) -> None:
        """None: a put here copies into slots it claims under the lock (the caller passes an array)."""
        return None

    def put(self, hashes: Sequence[bytes], kv: Any) -> int:
        """Publish blocks: ``kv`` is ``[layers, 2, len(hashes), block_size, kv_heads, head_dim]`` (or a
        :class:`VirtualKV` for a virtual store), block ``i`` named by ``hashes[i]``. Blocks already
        present are skipped. Returns the blocks this call published."""
        n_kv = kv.n_blocks if isinstance(kv, VirtualKV) else kv.shape[2]
        if n_kv != len(hashes):
            raise ValueError(f"{len(hashes)} hashes for {n_kv} blocks")
        if isinstance(kv, VirtualKV) != self.virtual:
            raise ValueError(f"a {'virtual' if self.virtual else 'real'} store cannot take {type(kv).__name__}")
        keys = [_split(h) for h in hashes]
        n = len(keys)
        with self._locked():
            todo, seen, present = [], set(), []
            base = int(self._ctr[0])
            for i, k in enumerate(keys):
                s = self._find(*k)
                if s >= 0:                      # already there: touch it as part of this sequence
                    present.append(s)
                    self._tick[s] = base + n - i
                elif k not in seen:
                    todo.append(i)
                    seen.add(k)
            self._ctr[0] = base + n + 1
            for s in present:                   # never evict this sequence's own head to fit its tail
                self._pins[s] += 1
            slots = self._claim(len(todo))
            for s in present:
                self._pins[s] -= 1
            todo = todo[:len(slots)]           # out of room (everything pinned): keep the prefix head
            now = time.time()
            for i, s in zip(todo, slots):
                self._state[s], self._since[s] = WRITING, now
                self._k0[s], self._k1[s], self._k2[s], self._k3[s] = keys[i]
        # Outside the lock: the claimed slots are invisible to every lookup until published.
        for i, s in zip(todo, slots):
            if self._payload is not None:
                row = self._payload[s].view(kv.dtype).reshape(kv.shape[:2] + kv.shape[3:])
                np.copyto(row, kv[:, :, i])
                self._csum[s] = xxhash.xxh3_64_intdigest(self._payload[s])
            else:
                self._csum[s] = _virtual_sum(keys[i], self.block_nbytes)
        with self._locked():
            published = 0
            for i, s in zip(todo, slots):
                if self._find(*keys[i]) >= 0:      # lost a race to an identical block
                    self._release(s)
                    self._bump("duplicates")
                    continue
                self._insert(s)
                self._state[s] = PUBLISHED
                self._tick[s] = base + n - i       # head newest: eviction eats a prefix from its tail
                published += 1
            self._bump("put_blocks", published)
            self._bump("put_bytes", published * self.block_nbytes)
            self._bump("published", published)
        return published

    # ---- get ------------------------------------------------------------------------------------

    def get_run(self, hashes: Sequence[bytes], start: int = 0) -> tuple[int, Any]:
        """The longest run of blocks ``hashes[start:]`` present and intact: ``(count, kv)`` with ``kv``
        ``[layers, 2, count, block_size, kv_heads, head_dim]`` (a :class:`VirtualKV` for a virtual
        store; None when count is 0). Every block's checksum is verified; the run ends before a bad one."""
        want = hashes[start:]
        slots: list[int] = []
        with self._locked():
            now = time.time()
            base = int(self._ctr[0])
            for h in want:
                s = self._find(*_split(h))
                if s < 0:
                    break
                slots.append(s)
            for rank, s in enumerate(slots):
                self._pins[s] += 1
                self._since[s] = now
                self._tick[s] = base + len(slots) - rank
            self._ctr[0] = base + len(slots) + 1
            self._bump("lookups", len(want))
            self._bump("hits", len(slots))
        good = len(slots)
        out: Any = None
        try:
            if self._payload is None:
                for j, s in enumerate(slots):
                    key = (int(self._k0[s]), int(self._k1[s]), int(self._k2[s]), int(self._k3[s]))
                    if int(self._csum[s]) != _virtual_sum(key, self.block_nbytes):
                        good = j
                        break
                out = VirtualKV(good, good * self.block_nbytes) if good else None
            elif slots:
                # The slots are pinned: their bytes cannot change under us. Verify in place, copy once.
                L, two, B, H, D = self.layout
                out = np.empty((L, two, len(slots), B, H, D), self.dtype)
                for j, s in enumerate(slots):
                    if xxhash.xxh3_64_intdigest(self._payload[s]) != int(self._csum[s]):
                        good = j
                        break
                    out[:, :, j] = self._payload[s].view(self.dtype).reshape(self.layout)
                out = out[:, :, :good] if good else None
        finally:
            with self._locked():
                for s in slots:
                    self._pins[s] -= 1
                if good < len(slots):              # checksum failed: drop it, readers compute instead
                    bad = slots[good]
                    if self._state[bad] == PUBLISHED and self._pins[bad] == 0:
                        self._remove(bad)
                    self._bump("corrupt")
                self._bump("get_blocks", good)
                self._bump("get_bytes", good * self.block_nbytes)
        return good, out

    # ---- internals (caller holds the lock) ------------------------------------------------------

    def _locked(self) -> "_Lock":
        return _Lock(self._tlock, self._fd)

    def _bump(self, name: str, by: int = 1) -> None:
        i = _COUNTERS.index(name)
        self._ctr[i] = int(self._ctr[i]) + by

    def _find(self, k0: int, k1: int, k2: int, k3: int) -> int:
        """Slot of a published key, or -1 (linear probing)."""
        i = k0 & self._mask
        while True:
            e = int(self._table[i])
            if e == 0:
                return -1
            s = e - 1
            if (int(self._k0[s]) == k0 and int(self._k1[s]) == k1 and int(self._k2[s]) == k2
                    and int(self._k3[s]) == k3):
                return s
            i = (i + 1) & self._mask

    def _insert(self, s: int) -> None:
        i = int(self._k0[s]) & self._mask
        while self._table[i]:
            i = (i + 1) & self._mask
        self._table[i] = s + 1

    def _remove(self, s: int) -> None:
        """Unpublish slot ``s`` and free it."""
        self._unpublish(s)
        self._release(s)

    def _release(self, s: int) -> None:
        """Slot ``s`` is free: push it on the free stack."""
        self._state[s] = FREE
        k = int(self._ctr[_NFREE])
        self._free[k] = s
        self._ctr[_NFREE] = k + 1

    def _unpublish(self, s: int) -> None:
        """Take slot ``s`` out of the index (backward-shift deletion: no tombstones, probes stay short)."""
        mask = self._mask
        i = int(self._k0[s]) & mask
        while int(self._table[i]) != s + 1:
            i = (i + 1) & mask
        self._table[i] = 0
        j = i
        while True:
            j = (j + 1) & mask
            e = int(self._table[j])
            if e == 0:
                break
            home = int(self._k0[e - 1]) & mask
            # move e back to the hole at i unless its home lies cyclically in (i, j]
            if (i <= j and (home <= i or home > j)) or (i > j and home <= i and home > j):
                self._table[i], self._table[j] = e, 0
                i = j
        self._bump("published", -1)

    def _claim(self, k: int) -> list[int]:
        """``k`` slots: freed ones (the free stack), then never-used ones, then -- only when the store is
        full -- slots a dead writer left WRITING and the least recently used unpinned published ones.

        The common case costs O(k) and touches only the pages of the slots it returns: the sim's default
        store models 1024 GB of DRAM (15.6M slots for the tiny profile), and a claim that scanned every
        slot held the cross-process lock for seconds, long enough for a worker waiting on it to miss its
        heartbeat. Only eviction scans, and only the slots ever used."""
        if k <= 0:
            return []
        nfree = int(self._ctr[_NFREE])
        take = min(k, nfree)
        free = self._free[nfree - take:nfree][::-1].tolist()
        self._ctr[_NFREE] = nfree - take
        fresh = int(self._ctr[_FRESH])
        more = min(k - len(free), self.capacity_blocks - fresh)
        free += range(fresh, fresh + more)
        self._ctr[_FRESH] = fresh + more
        if len(free) < k:                                # full: reclaim, then evict, among the used slots
            now = time.time()
            used = slice(0, fresh + more)
            stale = np.flatnonzero((self._state[used] == WRITING) & (self._since[used] < now - STALE_S))
            for s in stale[:k - len(free)].tolist():       # a writer died mid-put
                free.append(s)
            evictable = (self._state[used] == PUBLISHED) & ((self._pins[used] == 0)
                                                            | (self._since[used] < now - STALE_S))
            cand = np.flatnonzero(evictable)
            need = min(k - len(free), cand.size)
            if need:
                ticks = self._tick[cand]
                pick = cand[np.argpartition(ticks, need - 1)[:need]] if need < cand.size else cand
                for s in pick.tolist():
                    self._pins[s] = 0
                    self._unpublish(s)
                    self._bump("evictions")
                    free.append(s)
        return free


_FRESH, _NFREE = _COUNTERS.index("fresh"), _COUNTERS.index("nfree")


def _virtual_sum(key: tuple[int, ...], nbytes: int) -> int:
    return xxhash.xxh3_64_intdigest(b"".join(k.to_bytes(8, "little") for k in key) + nbytes.to_bytes(8, "little"))


class _Lock:
    """The store lock: a thread lock (flock is per open file, shared by this process's threads) and an
    exclusive ``flock`` on the segment (between processes; the kernel drops it if the holder dies)."""

    __slots__ = ("t", "fd")

    def __init__(self, t: threading.Lock, fd: int) -> None:
        self.t, self.fd = t, fd

    def __enter__(self) -> None:
        self.t.acquire()
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except BaseException:
            self.t.release()
            raise

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        self.t.release()
