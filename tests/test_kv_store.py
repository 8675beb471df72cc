"""The host's shared KV store: put/get of real bytes, LRU eviction (prefix tails first), tenant and
model namespacing, checksums, and one writer racing readers in other processes."""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np
import pytest

from reference_server.engine.base import ModelShape, VirtualKV
from reference_server.kv.block_manager import BlockManager
from reference_server.kv.store import KVStore, StoreShapeError, _split

SHAPE = ModelShape("tiny", "v1", layers=2, kv_heads=2, head_dim=8, vocab_size=1000, kv_dtype="float32")
BS = 16
BLOCK = BS * SHAPE.kv_bytes_per_token()          # 4096 bytes


def hashes(tenant: str, n: int, seed: int = 0, namespace: str = "tiny@v1/bs16") -> list[bytes]:
    toks = list(range(seed * 10_000, seed * 10_000 + n * BS + 1))
    return BlockManager(4, BS, namespace).hashes(tenant, toks)


def block_of(h: bytes) -> np.ndarray:
    """Deterministic KV of one block, a function of its hash (what any writer would compute)."""
    rng = np.random.default_rng(int.from_bytes(h[:8], "little"))
    return rng.standard_normal((2, 2, BS, 2, 8), dtype=np.float32)


def kv_for(hs: list[bytes]) -> np.ndarray:
    return np.stack([block_of(h) for h in hs], axis=2)


@pytest.fixture
def store():
    s = KVStore.create(8 * BLOCK, SHAPE, BS, virtual=False)
    yield s
    s.unlink()
    s.close()


def test_put_get_roundtrip_and_runs(store):
    a = hashes("t", 5)
    assert store.capacity_blocks == 8 and store.run_length(a) == 0
    assert store.put(a[:3], kv_for(a[:3])) == 3
    assert store.put(a[:3], kv_for(a[:3])) == 0                     # already there: nothing new
    assert store.run_length(a) == 3 and store.run_length(a, 1) == 2 and store.missing(a) == [3, 4]
    n, kv = store.get_run(a, 1)
    assert n == 2 and np.array_equal(kv, kv_for(a[1:3]))
    st = store.stats()
    assert (st.put_blocks, st.put_bytes, st.get_blocks, st.get_bytes, st.published) == (3, 3 * BLOCK, 2, 2 * BLOCK, 3)
    assert store.get_run(hashes("t", 2, seed=9)) == (0, None)


def test_lru_evicts_least_recent_and_prefix_tails_first(store):
    a, b, c = hashes("t", 4, 1), hashes("t", 4, 2), hashes("t", 2, 3)
    store.put(a, kv_for(a))
    store.put(b, kv_for(b))                                          # full: 8 of 8
    assert store.get_run(a)[0] == 4                                  # a is now more recent than b
    store.put(c, kv_for(c))
    assert store.run_length(a) == 4                                  # a survives
    assert store.run_length(b) == 2                                  # b lost its two deepest blocks, not its head
    assert store.stats().evictions == 2 and store.stats().occupancy == 1.0
    # a put longer than what is free never evicts its own head to fit its tail
    d = hashes("t", 12, 4)
    assert store.put(d, kv_for(d)) == 8 and store.run_length(d) == 8


def test_namespaced_by_tenant_and_model_version(store):
    a = hashes("alice", 3)
    store.put(a, kv_for(a))
    assert store.run_length(hashes("alice", 3)) == 3
    assert store.run_length(hashes("bob", 3)) == 0
    assert store.run_length(hashes("alice", 3, namespace="tiny@v2/bs16")) == 0


def test_checksum_mismatch_ends_the_run_and_drops_the_block(store):
    a = hashes("t", 4)
    store.put(a, kv_for(a))
    slot = store._find(*_split(a[2]))
    store._payload[slot][100] ^= 1                                   # a bit flips in memory
    n, kv = store.get_run(a)
    assert n == 2 and np.array_equal(kv, kv_for(a[:2]))
    assert store.stats().corrupt == 1 and store.run_length(a) == 2   # dropped: the next reader computes it


def test_virtual_store_counts_declared_bytes():
    s = KVStore.create(10 * BLOCK, SHAPE, BS, virtual=True)
    try:
        a = hashes("t", 4)
        assert s.put(a, VirtualKV(4, 4 * BLOCK)) == 4
        n, kv = s.get_run(a, 1)
        assert n == 3 and kv == VirtualKV(3, 3 * BLOCK)
        assert s.stats().put_bytes == 4 * BLOCK and s.stats().get_bytes == 3 * BLOCK
        with pytest.raises(ValueError):
            s.put(a, kv_for(a))
    finally:
        s.unlink()
        s.close()


def test_attach_refuses_another_block_layout(store):
    with pytest.raises(StoreShapeError):
        KVStore.attach(store.name, SHAPE, BS * 2)
    other = KVStore.attach(store.name, SHAPE, BS)
    a = hashes("t", 2)
    other.put(a, kv_for(a))
    assert store.run_length(a) == 2                                   # one store, seen from two handles
    other.close()


# ---- one writer, two readers, three processes ------------------------------------------------------

def _writer(name: str, rounds: int) -> None:
    s = KVStore.attach(name, SHAPE, BS)
    for r in range(rounds):
        hs = hashes("t", 6, seed=r % 7)
        s.put(hs, kv_for(hs))
    s.close()


def _reader(name: str, deadline: float, out: mp.Queue) -> None:
    s = KVStore.attach(name, SHAPE, BS)
    reads = found = 0
    while time.time() < deadline:
        for seed in range(7):
            hs = hashes("t", 6, seed=seed)
            n, kv = s.get_run(hs)
            reads += 1
            found += n
            for j in range(n):                 # every block a reader gets is exactly its writer's bytes
                if not np.array_equal(kv[:, :, j], block_of(hs[j])):
                    out.put(("torn", seed, j))
                    return
    s.close()
    out.put(("ok", reads, found))


def test_concurrent_writer_and_readers_across_processes(store):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    deadline = time.time() + 6.0
    readers = [ctx.Process(target=_reader, args=(store.name, deadline, out)) for _ in range(2)]
    writer = ctx.Process(target=_writer, args=(store.name, 300))
    for p in readers + [writer]:
        p.start()
    results = [out.get(timeout=60) for _ in readers]
    for p in readers + [writer]:
        p.join(timeout=30)
    assert all(r[0] == "ok" for r in results), results
    assert sum(r[2] for r in results) > 0                              # they did read while it wrote
    st = store.stats()
    assert st.evictions > 0 and st.corrupt == 0                        # 7 x 6 blocks through 8 slots
    assert st.published <= store.capacity_blocks


def _resident_bytes(name: str) -> int:
    """Resident bytes of the store's mapping in this process (/proc/self/smaps), all mappings of it."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        if line[0] in "0123456789abcdef" and " " in line and "-" in line.split(" ", 1)[0]:
            inside = line.rstrip().endswith(name)
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def test_a_put_costs_what_it_writes_not_the_store_capacity():
    """The sim's default store models 1024 GB of host DRAM: 15.6M block slots for the tiny profile. A put that
    scanned every slot's state (and paged in its metadata) held the store's cross-process lock for seconds, long
    enough for a worker waiting on it to miss the supervisor's 3 s heartbeat (seen in CI: decode-0 restarted after
    the first request of the twin probe, 7 of 8 requests failed, prefix hit 0.0). Here a virtual store of 16M slots
    takes 200 puts, gets and an eviction-free run of lookups while touching only the pages those blocks use."""
    s = KVStore.create(16_000_000 * BLOCK, SHAPE, BS, virtual=True)
    try:
        assert s.capacity_blocks == 16_000_000
        for seed in range(200):
            a = hashes("t", 8, seed=seed)
            assert s.put(a, VirtualKV(8, 8 * BLOCK)) == 8
            assert s.get_run(a)[0] == 8
        assert s.stats().published == 1600
        # 16M slots of metadata is ~1.1 GB; 1,600 blocks touch a few pages of each array and of the index.
        assert _resident_bytes(s.name) < 32 << 20, _resident_bytes(s.name)
    finally:
        s.unlink()
        s.close()


def test_freed_slots_are_reused_before_fresh_ones():
    """Slots freed by eviction or by a lost race go back to the free list, so a full store keeps taking puts and its
    occupancy never exceeds its capacity."""
    s = KVStore.create(8 * BLOCK, SHAPE, BS, virtual=True)
    try:
        for seed in range(10):
            a = hashes("t", 4, seed=seed)
            assert s.put(a, VirtualKV(4, 4 * BLOCK)) == 4
            assert s.run_length(a) == 4           # the newest sequence is always readable
        st = s.stats()
        assert st.published == 8 and st.evictions == 32
    finally:
        s.unlink()
        s.close()
