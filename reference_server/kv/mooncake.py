"""Mooncake Store as the shared KV store (``--kv-store mooncake[://MASTER]``): the store the article's
"Prefill-as-a-Service" puts between prefill and decode machines, behind the same interface as the built-in
store (:class:`reference_server.kv.backend.BlockStore`).

Layout on one host (the one that moved blocks at memcpy speed here; docs/kv.md has the figures):

* ``mooncake_master`` keeps the index (which key lives where) and evicts. ``--kv-store mooncake`` starts
  one (on a free port of the workers' address: 127.0.0.1, or ``--host`` with ``--join-port``; tethered to
  the server); ``mooncake://HOST:PORT`` uses an existing one. Metadata goes peer to peer (``P2PHANDSHAKE``): no etcd, no metadata server.
* ``mooncake_client`` owns the store's memory (``--kv-store-gb``): the server starts it, tethered, and
  mounts it on the master. With another host's master, that host's clients' memory is in the store too.
* Each worker is a thin client of that local ``mooncake_client`` (``setup_dummy``): it stages blocks in
  three buffers allocated from the client's shared memory pool and registered (``alloc_from_mem_pool`` +
  ``register_buffer``): put, get, and stage, which an engine gathers a finished sequence's blocks into
  straight from its pool (:meth:`MooncakeStore.stage`: one copy before the move, not two). It moves them
  with ``batch_put_from`` / ``batch_get_into`` (no Python bytes, no ``local_buffer_size`` limit on an object).

The guarantees of docs/kv.md, on a store that gives fewer:

* **Keys.** ``pkv/<block bytes>/<chained block hash hex>``: the hash names the prefix, the tenant and the
  model version, the byte count keeps a store shared by different engines apart. Mooncake keeps the first
  value of a key, which is right here: equal keys have equal values.
* **Checksums.** A value is the block's bytes and their xxh3_64 (8 bytes, little-endian). A read verifies
  every block; a mismatch or a wrong size ends the run there, the key is removed and counted ``corrupt``:
  the worker computes the rest, never installs bad KV. (The sim engine's virtual KV stores the 8-byte sum
  of key and declared size only.)
* **Failures are misses.** ``get`` cannot tell a missing key from a dead master; the batch calls can: a
  code of ``OBJECT_NOT_FOUND`` is a miss, any other negative code is an error (``errors``), and both end
  the run. A put that fails is dropped. Nothing here raises into a request.
* **Bounded waits.** ``setup`` blocks forever without a master: the master's and client's ports are
  probed first and the setup itself runs in a thread the caller stops waiting for after
  :data:`SETUP_TIMEOUT_S`.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import xxhash

from paas_common.lifetime import native_popen_kwargs
from reference_server.engine.base import ModelShape, VirtualKV
from reference_server.kv.store import StoreStats, _block_layout
from reference_server.ports import free_port

SETUP_TIMEOUT_S = 15.0      # a client's setup (25-60 ms measured) or a child's first listen (~1.3 s)
PROBE_TIMEOUT_S = 0.5       # one TCP connect to the master or the memory owner
ARENA_BYTES = 16 << 20      # each staging buffer (put, get, stage); a batch moves at most this much
SEGMENT_ALIGN = 16 << 20    # Mooncake refuses smaller segments
OBJECT_NOT_FOUND = -704     # mooncake-store/include/types.h ErrorCode
_CSUM = 8


class MooncakeUnavailable(RuntimeError):
    """The package, the master or the memory owner cannot be reached."""


def package_dir() -> Path:
    """Where the ``mooncake-transfer-engine-non-cuda`` wheel keeps its binaries (ImportError without it)."""
    import mooncake

    return Path(mooncake.__file__).parent


def port_open(addr: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    host, _, port = addr.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout).close()
        return True
    except OSError:
        return False


@dataclass
class _Child:
    name: str
    proc: subprocess.Popen
    addr: str                   # HOST:PORT it serves on
    log: Path

    def tail(self) -> str:
        try:
            return " | ".join(self.log.read_text(errors="replace").splitlines()[-3:])
        except OSError:
            return ""


def _spawn(name: str, argv: list[str], addr: str, log_dir: Path) -> _Child:
    """Start a native Mooncake program tethered to this process and wait until ``addr`` accepts."""
    log = log_dir / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                **native_popen_kwargs())
    child = _Child(name, proc, addr, log)
    deadline = time.monotonic() + SETUP_TIMEOUT_S
    while not port_open(addr, 0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise MooncakeUnavailable(f"{name} did not listen on {addr} within {SETUP_TIMEOUT_S:.0f} s "
                                      f"(exit {proc.returncode}): {child.tail()}")
        time.sleep(0.05)
    return child


def start_master(log_dir: Path, host: str = "127.0.0.1") -> tuple[_Child, int]:
    """``mooncake_master`` on free ports of ``host`` (loopback unless workers join from other hosts), tethered
    to this process: (the child, its metrics port, on loopback). Peer-to-peer metadata: no etcd or HTTP
    metadata server."""
    port, metrics_port = free_port(host), free_port()
    return _spawn("mooncake_master", [str(package_dir() / "mooncake_master"), f"--rpc_port={port}",
                                      f"--rpc_address={host}", f"--metrics_port={metrics_port}"],
                  f"{host}:{port}", log_dir), metrics_port


class MooncakeService:
    """One host's side: the master (unless one is given) and the memory owner, both tethered children. The
    router's host starts both; a host a worker joined from starts only its memory owner, mounted on the
    router's master. ``host``: the address they listen on and that the other hosts reach."""

    def __init__(self, master: str | None, segment_bytes: int, log_dir: Path, host: str = "127.0.0.1") -> None:
        bin_dir = package_dir()
        self.children: list[_Child] = []
        self.metrics_port: int | None = None
        seg = max(SEGMENT_ALIGN, -(-segment_bytes // SEGMENT_ALIGN) * SEGMENT_ALIGN)
        short = memory_shortfall(seg)
        if short:
            raise MooncakeUnavailable(short)
        try:
            if master is None:
                child, self.metrics_port = start_master(log_dir, host)
                self.children.append(child)
                master = child.addr
            elif not port_open(master):
                raise MooncakeUnavailable(f"no Mooncake master answers at {master}")
            self.master = master
            self.client_addr = f"{host}:{free_port(host)}"
            self.children.append(_spawn("mooncake_client", [
                str(bin_dir / "mooncake_client"), f"--host={host}", f"--port={self.client_addr.rpartition(':')[2]}",
                f"--master_server_address={master}", "--metadata_server=P2PHANDSHAKE", "--protocol=tcp",
                f"--global_segment_size={seg}"], self.client_addr, log_dir))
            self.segment_bytes = seg
        except BaseException:
            self.stop()
            raise

    def alive(self) -> dict[str, bool]:
        """Each part answers now (a TCP connect: the master may be another host's)."""
        return {"master": port_open(self.master), "client": port_open(self.client_addr)}

    def master_gauges(self) -> dict[str, float]:
        """The master's own Prometheus gauges (our master only; {} when it cannot answer)."""
        if self.metrics_port is None:
            return {}
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=1.0) as r:
                text = r.read().decode()
        except OSError:
            return {}
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name.startswith("master_") and "{" not in name:
                try:
                    out[name] = float(value)
                except ValueError:
                    pass
        return out

    def kill_master(self) -> None:
        """Test hook: the master dies as a crash would (SIGKILL)."""
        for c in self.children:
            if c.name == "mooncake_master":
                c.proc.kill()
                c.proc.wait()

    def stop(self) -> None:
        for c in reversed(self.children):
            if c.proc.poll() is None:
                c.proc.terminate()
        for c in self.children:
            try:
                c.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
        self.children = []


class MooncakeOwner(MooncakeService):
    """The router's side (:class:`~reference_server.kv.backend.StoreOwner`): the service, reported as one store.
    It needs no worker's block layout (a router may have none of its own: every worker joins); ``capacity_bytes``
    is the KV the store models (``--kv-store-gb``), ``segment_bytes`` the memory it takes (:func:`segment_bytes`)."""

    backend = "mooncake"

    def __init__(self, master: str | None, capacity_bytes: int, segment_bytes: int, *, virtual: bool,
                 host: str = "127.0.0.1") -> None:
        self.logs = log_dir()
        super().__init__(master, segment_bytes, self.logs, host)
        self.capacity_bytes, self.virtual = capacity_bytes, virtual

    def attach_msg(self) -> dict[str, Any]:
        return {"backend": self.backend, "client": self.client_addr, "capacity": self.capacity_bytes,
                "virtual": self.virtual, "master": self.master}

    def join_msg(self) -> dict[str, Any]:
        """What a worker joining from another host needs first (in the router's ``welcome``): the master its
        own memory owner mounts on, and how much memory that host adds (as much as this one)."""
        return {"backend": self.backend, "master": self.master, "segment": self.segment_bytes}

    def stats(self, workers: list[dict[str, Any]]) -> StoreStats:
        parts = [StoreStats(**w["store"]) for w in workers if w.get("store")]
        layout = parts[0] if parts else StoreStats(0, 0, *[0] * 10)    # every worker's the same: one engine
        return sum_stats(parts, layout.capacity_blocks, layout.block_nbytes, self.master_gauges())

    def down(self) -> list[str]:
        return [f"mooncake {part}" for part, up in self.alive().items() if not up]

    def close(self) -> None:
        """A clean stop: the children go, and their logs with them (a crash leaves them for a post-mortem)."""
        self.stop()
        shutil.rmtree(self.logs, ignore_errors=True)


def _bounded(fn: Any, what: str, timeout: float = SETUP_TIMEOUT_S) -> Any:
    """``fn()`` in a daemon thread; MooncakeUnavailable when it has not returned within ``timeout`` (the thread
    is left blocked: Mooncake's setup has no timeout of its own)."""
    box: list[Any] = []
    t = threading.Thread(target=lambda: box.append(fn()), daemon=True, name=f"mooncake-{what}")
    t.start()
    t.join(timeout)
    if not box:
        raise MooncakeUnavailable(f"Mooncake {what} did not return within {timeout:.0f} s")
    return box[0]


class _Arena:
    """One staging buffer in the memory owner's shared pool, registered for zero-copy batch calls."""

    def __init__(self, client: Any, nbytes: int) -> None:
        ptr = client.alloc_from_mem_pool(nbytes)
        if not ptr or client.register_buffer(ptr, nbytes) != 0:
            raise MooncakeUnavailable(f"could not allocate and register a {nbytes}-byte staging buffer")
        self.ptr = int(ptr)
        self.buf = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(self.ptr))
        self.lock = threading.Lock()


@dataclass
class Staged:
    """Blocks gathered straight from an engine's pool into registered memory (:meth:`MooncakeStore.stage`),
    waiting for their ``put``: ``kv`` is a ``[layers, 2, n, B, kv_heads, head_dim]`` view over the value rows
    (each row a block's bytes, then room for its checksum). Holds the staging buffer until ``put`` (or
    :meth:`release`) gives it back."""

    kv: np.ndarray
    n: int
    arena: _Arena

    def release(self) -> None:
        self.arena.lock.release()


class MooncakeStore:
    """A worker's handle on Mooncake Store (:class:`~reference_server.kv.backend.BlockStore`). Counters are
    this process's; the router sums every worker's."""

    def __init__(self, client_addr: str, shape: ModelShape, block_size: int, *, virtual: bool,
                 capacity_bytes: int = 0) -> None:
        if not port_open(client_addr):
            raise MooncakeUnavailable(f"no mooncake_client answers at {client_addr}")
        from mooncake.store import MooncakeDistributedStore

        self.virtual = virtual
        self.block_size = block_size
        self.block_nbytes = block_size * (shape.kv_bytes_per_token() if virtual else shape.host_bytes_per_token())
        self.layout = _block_layout(shape, block_size)
        self.dtype = None if virtual else shape.host_dtype()
        self.capacity_blocks = capacity_bytes // self.block_nbytes
        self.slot = _CSUM if virtual else self.block_nbytes + _CSUM      # one value: bytes + checksum
        self.per_batch = max(1, ARENA_BYTES // self.slot)
        arena = self.per_batch * self.slot
        self._c = MooncakeDistributedStore()
        rc = _bounded(lambda: self._c.setup_dummy(3 * arena + (1 << 20), 1 << 20, client_addr), "setup")
        if rc != 0:
            raise MooncakeUnavailable(f"Mooncake setup_dummy({client_addr}) failed: code {rc}")
        self._put, self._get, self._stage = (_Arena(self._c, arena) for _ in range(3))
        self._n = dict.fromkeys(("lookups", "hits", "put_blocks", "put_bytes", "get_blocks", "get_bytes",
                                 "corrupt", "duplicates", "errors"), 0)
        self._nlock = threading.Lock()

    def _key(self, h: bytes) -> str:
        return f"pkv/{self.block_nbytes}/{h.hex()}"

    def _bump(self, **by: int) -> None:
        with self._nlock:
            for k, v in by.items():
                self._n[k] += v

    # ---- queries --------------------------------------------------------------------------------

    def _exist(self, hashes: Sequence[bytes]) -> list[int]:
        try:
            codes = list(self._c.batch_is_exist([self._key(h) for h in hashes])) if hashes else []
        except Exception:  # noqa: BLE001 - the client's own failure is a store error, never the request's
            codes = [-1] * len(hashes)
        if any(c < 0 for c in codes):
            self._bump(errors=1)
        return codes

    def run_length(self, hashes: Sequence[bytes], start: int = 0) -> int:
        n = 0
        for c in self._exist(hashes[start:]):
            if c != 1:
                break
            n += 1
        return n

    def missing(self, hashes: Sequence[bytes]) -> list[int]:
        codes = self._exist(hashes)
        if any(c < 0 for c in codes):
            return []          # the store is unreachable: a put would fail too
        return [i for i, c in enumerate(codes) if c != 1]

    # ---- put ------------------------------------------------------------------------------------

    def stage(self, n: int) -> Staged | None:
        """Registered memory for ``n`` blocks an engine gathers into straight from its pool
        (``Engine.read_blocks_into``), so that a put copies the bytes once before the move instead of twice
        (pool -> array -> staging buffer). None, never a wait (the caller is the engine thread): virtual
        KV, more blocks than one batch, or the staging buffer still held by an earlier put."""
        if self.virtual or not 0 < n <= self.per_batch or not self._stage.lock.acquire(blocking=False):
            return None
        rows = self._stage.buf[:n * self.slot].reshape(n, self.slot)[:, :self.block_nbytes]
        kv = np.moveaxis(rows.view(self.dtype).reshape((n,) + self.layout), 0, 2)
        return Staged(kv, n, self._stage)

    def put(self, hashes: Sequence[bytes], kv: Any) -> int:
        if isinstance(kv, Staged):
            try:
                if kv.n != len(hashes):
                    raise ValueError(f"{len(hashes)} hashes for {kv.n} blocks")
                for j in range(kv.n):
                    self._seal(kv.arena, j)
                return self._move(hashes, kv.arena)
            finally:
                kv.release()
        n_kv = kv.n_blocks if isinstance(kv, VirtualKV) else kv.shape[2]
        if n_kv != len(hashes):
            raise ValueError(f"{len(hashes)} hashes for {n_kv} blocks")
        if isinstance(kv, VirtualKV) != self.virtual:
            raise ValueError(f"a {'virtual' if self.virtual else 'real'} store cannot take {type(kv).__name__}")
        published = 0
        a = self._put
        for lo in range(0, len(hashes), self.per_batch):
            part = hashes[lo:lo + self.per_batch]
            with a.lock:
                for j, h in enumerate(part):
                    row = a.buf[j * self.slot:(j + 1) * self.slot]
                    if self.virtual:
                        row[:] = np.frombuffer(_virtual_sum(h, self.block_nbytes).to_bytes(8, "little"), np.uint8)
                        continue
                    body = row[:self.block_nbytes].view(kv.dtype).reshape(kv.shape[:2] + kv.shape[3:])
                    np.copyto(body, kv[:, :, lo + j])
                    self._seal(a, j)
                published += self._move(part, a)
        return published

    def _seal(self, a: _Arena, j: int) -> None:
        """Row ``j``'s checksum: the xxh3_64 of its block bytes, in its last 8 bytes."""
        row = a.buf[j * self.slot:(j + 1) * self.slot]
        row[self.block_nbytes:] = np.frombuffer(
            xxhash.xxh3_64_intdigest(row[:self.block_nbytes]).to_bytes(8, "little"), np.uint8)

    def _move(self, part: Sequence[bytes], a: _Arena) -> int:
        """``batch_put_from`` of the first ``len(part)`` rows of ``a`` under those keys: how many landed."""
        try:
            codes = list(self._c.batch_put_from([self._key(h) for h in part],
                                                [a.ptr + j * self.slot for j in range(len(part))],
                                                [self.slot] * len(part)))
        except Exception:  # noqa: BLE001 - a failed put is a later miss
            codes = [-1] * len(part)
        ok = sum(1 for c in codes if c == 0)
        self._bump(put_blocks=ok, put_bytes=ok * self.block_nbytes, errors=int(ok < len(part)))
        return ok

    # ---- get ------------------------------------------------------------------------------------

    def get_run(self, hashes: Sequence[bytes], start: int = 0) -> tuple[int, Any]:
        want = list(hashes[start:])
        good, bad, error = 0, None, False
        out = None if self.virtual or not want else np.empty(self.layout[:2] + (len(want),) + self.layout[2:], self.dtype)
        a = self._get
        while good < len(want) and bad is None and not error:
            part = want[good:good + self.per_batch]
            with a.lock:
                try:
                    codes = list(self._c.batch_get_into([self._key(h) for h in part],
                                                        [a.ptr + j * self.slot for j in range(len(part))],
                                                        [self.slot] * len(part)))
                except Exception:  # noqa: BLE001 - a failed read is a miss
                    codes = [-1] * len(part)
                n = 0
                for j, c in enumerate(codes):
                    if c == self.slot and self._intact(part[j], a.buf[j * self.slot:(j + 1) * self.slot]):
                        n += 1
                        continue
                    if c == OBJECT_NOT_FOUND:
                        pass
                    elif c < 0:
                        error = True
                    else:                       # wrong size or checksum: torn, corrupt, another layout
                        bad = part[j]
                    break
                if n and out is not None:       # verified rows [n, L, 2, B, H, D] -> out[L, 2, good:good+n, B, H, D]
                    rows = a.buf[:n * self.slot].reshape(n, self.slot)[:, :self.block_nbytes]
                    out[:, :, good:good + n] = np.moveaxis(rows.view(self.dtype).reshape((n,) + self.layout), 0, 2)
            good += n
            if n < len(part):
                break
        if bad is not None:
            try:
                self._c.remove(self._key(bad), True)    # past its read lease: a corrupt block must go
            except Exception:  # noqa: BLE001
                pass
        self._bump(lookups=len(want), hits=good + (bad is not None), get_blocks=good,
                   get_bytes=good * self.block_nbytes, corrupt=int(bad is not None), errors=int(error))
        if not good:
            return 0, None
        if self.virtual:
            return good, VirtualKV(good, good * self.block_nbytes)
        return good, out[:, :, :good]

    def _intact(self, h: bytes, row: np.ndarray) -> bool:
        if self.virtual:
            return int.from_bytes(row.tobytes(), "little") == _virtual_sum(h, self.block_nbytes)
        return xxhash.xxh3_64_intdigest(row[:self.block_nbytes]) == int.from_bytes(
            row[self.block_nbytes:].tobytes(), "little")

    def stats(self) -> StoreStats:
        with self._nlock:
            n = dict(self._n)
        return StoreStats(self.capacity_blocks, self.block_nbytes, 0, n["lookups"], n["hits"], n["put_blocks"],
                          n["put_bytes"], n["get_blocks"], n["get_bytes"], 0, n["corrupt"], n["duplicates"],
                          n["errors"])

    def close(self) -> None:
        try:
            self._c.close()
        except Exception:  # noqa: BLE001
            pass


def _virtual_sum(h: bytes, nbytes: int) -> int:
    return xxhash.xxh3_64_intdigest(h + nbytes.to_bytes(8, "little"))


def sum_stats(parts: Sequence[StoreStats], capacity_blocks: int, block_nbytes: int,
              gauges: dict[str, float]) -> StoreStats:
    """The store's counters as the router reports them: every worker's, plus the master's occupancy and
    evictions when it is ours."""
    tot = {f: sum(getattr(p, f) for p in parts) for f in ("lookups", "hits", "put_blocks", "put_bytes",
                                                          "get_blocks", "get_bytes", "corrupt", "duplicates",
                                                          "errors")}
    return StoreStats(capacity_blocks, block_nbytes, int(gauges.get("master_key_count", 0)), tot["lookups"],
                      tot["hits"], tot["put_blocks"], tot["put_bytes"], tot["get_blocks"], tot["get_bytes"],
                      int(gauges.get("master_evicted_key_count", 0)), tot["corrupt"], tot["duplicates"],
                      tot["errors"])


def segment_bytes(cfg: Any) -> int:
    """The memory a host's memory owner gives the store for ``--kv-store-gb`` (``cfg``: the server's
    :class:`~reference_server.config.ServerConfig`). Real KV: those bytes. The sim engine's virtual KV: a block's
    value is its 8-byte sum, so room for as many values as ``--kv-store-gb`` holds blocks, as the built-in store
    keeps keys only for the same modeled capacity (by default 1,024 GB of modeled host DRAM: tens of MB here,
    where the modeled bytes themselves would be refused). Mooncake's allocator takes a value's bytes exactly
    (the master's ``master_allocated_bytes`` grows by 8 per such value); the owner rounds up to its 16 MiB."""
    capacity = cfg.store_bytes()
    if cfg.engine != "sim":
        return capacity
    from reference_server.sim.profiles import load_model_profile

    model = load_model_profile(cfg.model_profile or cfg.model, cfg.model_set)    # as the sim worker loads it
    return capacity // (cfg.block_size * model.kv_bytes_per_token()) * _CSUM


def memory_shortfall(nbytes: int) -> str | None:
    """Why this host cannot give the store ``nbytes`` now (more than its available memory), or None.
    Mooncake's memory owner would abort at start (``Failed to allocate segment memory``)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            avail = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None                       # not Linux: the memory owner's own error stands
    if nbytes <= avail:
        return None
    return (f"the Mooncake store's memory on this host would be {nbytes / 1e9:.2f} GB (--kv-store-gb) and this "
            f"host has {avail / 1e9:.2f} GB available: give a smaller --kv-store-gb")


def log_dir() -> Path:
    """Where the master's and memory owner's logs go (they log a line per connection)."""
    d = Path(os.environ.get("TMPDIR", "/tmp")) / f"paasbench-mooncake-{os.getpid()}"
    d.mkdir(parents=True, exist_ok=True)
    return d
