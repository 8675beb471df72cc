"""What a worker and the router need of the shared KV store, whichever store it is.

Two stores stand behind this one interface: the built-in one (:mod:`reference_server.kv.store`, one
POSIX shared-memory segment on this host, nothing to install: the default) and Mooncake Store
(:mod:`reference_server.kv.mooncake`, a distributed store that other hosts can reach: ``--kv-store
mooncake``). :mod:`reference_server.store_io` (a worker's puts and onboarding reads), the worker's routing
offer and the router's ``/metrics`` use only what is here, so every guarantee of docs/kv.md is stated
once against it: a block is named by its chained block hash (the whole prefix, tenant and model version),
a value never changes once published, a read verifies every block's checksum and ends the run before a
bad or missing one, and a failed operation is a miss (the caller computes), never an error the client sees.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence

from reference_server.config import ServerConfig
from reference_server.engine.base import ModelShape
from reference_server.kv.store import KVStore, StoreStats

BACKENDS = ("builtin", "mooncake")


class BlockStore(Protocol):
    """A handle on the shared KV store in one process (thread-safe)."""

    virtual: bool               # keys and declared byte counts only (the sim engine's KV)
    block_nbytes: int

    def run_length(self, hashes: Sequence[bytes], start: int = 0) -> int:
        """Blocks ``hashes[start:]`` readable now, up to the first miss (no side effects)."""

    def missing(self, hashes: Sequence[bytes]) -> list[int]:
        """Indices of ``hashes`` the store does not hold (what a writer still has to put)."""

    def stage(self, n: int) -> Any:
        """Memory of the store's own to gather ``n`` blocks into before their ``put`` (an object with a
        writable ``kv`` array and ``release()``; ``put`` takes it in place of an array), or None: copy them
        out into an array. Never waits."""

    def put(self, hashes: Sequence[bytes], kv: Any) -> int:
        """Publish blocks (``[layers, 2, len(hashes), ...]``, a ``VirtualKV`` or what ``stage`` gave);
        returns how many."""

    def get_run(self, hashes: Sequence[bytes], start: int = 0) -> tuple[int, Any]:
        """The longest run of ``hashes[start:]`` present and intact, checksums verified: ``(count, kv)``."""

    def stats(self) -> StoreStats:
        """This store's counters (the built-in store: every process's; Mooncake: this process's)."""

    def close(self) -> None: ...


class StoreOwner(Protocol):
    """The router's side of a store: it made the store, tells workers how to reach it, reports it."""

    backend: str

    def attach_msg(self) -> dict[str, Any]:
        """What a worker needs to open the store (sent in the ``store`` control message)."""

    def join_msg(self) -> dict[str, Any] | None:
        """What a worker joining from another host needs before it starts (in the router's ``welcome``);
        None: this store cannot be reached from another host."""

    generation: int             # +1 whenever a part of the store was restarted: workers open a new handle

    def stats(self, workers: list[dict[str, Any]]) -> StoreStats:
        """The store's counters; ``workers``: every worker's ``store`` counters, those of workers (and handles)
        that are gone included (:mod:`reference_server.store_link` keeps them)."""

    def down(self) -> list[str]:
        """Parts of the store that do not answer now ([] when healthy): /health reports ``degraded``."""

    def close(self) -> None: ...


class BuiltinOwner:
    """The built-in store: one shared-memory segment the router creates and every worker attaches."""

    backend = "builtin"
    generation = 0                       # nothing of it can die apart from this process

    def __init__(self, capacity_bytes: int, shape: ModelShape, block_size: int, *, virtual: bool) -> None:
        self.store = KVStore.create(capacity_bytes, shape, block_size, virtual=virtual)

    def attach_msg(self) -> dict[str, Any]:
        return {"backend": self.backend, "name": self.store.name}

    def join_msg(self) -> None:
        return None                      # this host's shared memory: joined workers run without a store

    def stats(self, workers: list[dict[str, Any]]) -> StoreStats:
        # kept in the segment, every process's together; the calls workers gave up on are theirs to count
        st = self.store.stats()
        return dataclasses.replace(st, timeouts=sum(int(w.get("timeouts", 0)) for w in workers if w))

    def down(self) -> list[str]:
        return []                        # this process's own memory

    def close(self) -> None:
        self.store.unlink()
        self.store.close()


def open_owner(cfg: ServerConfig, worker: dict[str, Any] | None) -> StoreOwner | None:
    """The router: create (or reach) the store ``--kv-store`` names, of ``--kv-store-gb``; None without one.
    ``worker``: a local worker's ready report (the block layout the built-in store is made for), or None when
    no worker runs on this host: then the built-in store, this host's shared memory, would serve nobody and
    is not made, while Mooncake is started all the same (the workers that join use it). Call from the main
    thread: a Mooncake master and memory owner started here are tethered to it, listening on the workers'
    address (where workers that join from other hosts reach them)."""
    backend, master = parse_kv_store(cfg.kv_store)
    capacity = cfg.store_bytes()
    if capacity <= 0 or (backend == "builtin" and worker is None):
        return None
    if backend == "builtin":
        return BuiltinOwner(capacity, ModelShape(**worker["shape"]), worker["block_size"],  # type: ignore[index]
                            virtual=worker["virtual_kv"])  # type: ignore[index]
    from reference_server.kv.mooncake_service import MooncakeOwner, segment_bytes

    return MooncakeOwner(master, capacity, segment_bytes(cfg), virtual=cfg.engine == "sim", host=cfg.worker_host)


def open_store(msg: dict[str, Any], shape: ModelShape, block_size: int) -> BlockStore:
    """A worker: open the store the router's ``store`` message names."""
    if msg.get("backend", "builtin") == "builtin":
        return KVStore.attach(msg["name"], shape, block_size)
    from reference_server.kv.mooncake import MooncakeStore

    return MooncakeStore(msg["client"], shape, block_size, virtual=bool(msg["virtual"]),
                         capacity_bytes=int(msg["capacity"]), segment_bytes=int(msg.get("segment", 0)))


def parse_kv_store(value: str) -> tuple[str, str | None]:
    """``--kv-store``: ``builtin``, ``mooncake`` (the server starts its own master) or ``mooncake://HOST:PORT``
    (an existing master's RPC address) -> (backend, master address or None). ValueError names what is wrong."""
    if value in BACKENDS:
        return value, None
    scheme, sep, rest = value.partition("://")
    if scheme != "mooncake" or not sep:
        raise ValueError(f"{value!r}: expected builtin, mooncake or mooncake://HOST:PORT")
    host, colon, port = rest.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{value!r}: the master address must be HOST:PORT with a port in 1..65535")
    return "mooncake", f"{host}:{int(port)}"
