"""Mooncake Store behind the shared-KV-store interface (reference_server/kv/mooncake.py), against a real
``mooncake_master`` and ``mooncake_client`` started here: the same round trip, namespacing and checksum rules
as the built-in store (tests/test_kv_store.py), across processes, and every failure a miss, never an error.
Skipped (with the reason) only where the package cannot be imported."""

from __future__ import annotations

import multiprocessing as mp
import os

import numpy as np
import pytest

from mooncake_fixture import mooncake_or_skip
from reference_server.engine.base import ModelShape, VirtualKV
from reference_server.kv.block_manager import BlockManager

pytestmark = pytest.mark.mooncake
mooncake_or_skip()

from reference_server.kv.mooncake import MooncakeStore, MooncakeUnavailable  # noqa: E402
from reference_server.kv.mooncake_service import MooncakeService  # noqa: E402

SHAPE = ModelShape("tiny", "v1", layers=2, kv_heads=2, head_dim=8, vocab_size=100, kv_dtype="float32")
BS = 16


def hashes(tenant: str, n: int, seed: int = 0, namespace: str = "tiny@v1/bs16") -> list[bytes]:
    bm = BlockManager(4, BS, namespace)
    rng = np.random.default_rng(seed)
    return bm.lookup(tenant, rng.integers(0, 1000, n * BS + 1).tolist())[1]


def kv_for(hs: list[bytes]) -> np.ndarray:
    out = np.empty((SHAPE.layers, 2, len(hs), BS, SHAPE.kv_heads, SHAPE.head_dim), np.float32)
    for i, h in enumerate(hs):
        out[:, :, i] = np.random.default_rng(int.from_bytes(h[:8], "little")).standard_normal(out.shape[:2] + out.shape[3:])
    return out


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    svc = MooncakeService(None, 32 << 20, tmp_path_factory.mktemp("mc"))
    yield svc
    svc.stop()


@pytest.fixture
def store(service):
    s = MooncakeStore(service.client_addr, SHAPE, BS, virtual=False, capacity_bytes=service.segment_bytes)
    yield s
    s.close()


def test_put_get_roundtrip_runs_and_tenants(store):
    hs = hashes("a", 6, seed=1)
    assert store.missing(hs) == list(range(6))
    assert store.put(hs[:4], kv_for(hs[:4])) == 4
    assert store.missing(hs) == [4, 5] and store.run_length(hs) == 4 and store.run_length(hs, 2) == 2
    n, kv = store.get_run(hs, 1)
    assert n == 3 and np.array_equal(kv, kv_for(hs[1:4]))
    assert store.run_length(hashes("b", 6, seed=1)) == 0                     # another tenant: another key
    assert store.run_length(hashes("a", 6, seed=1, namespace="tiny@v2/bs16")) == 0   # another model version
    st = store.stats()
    assert (st.put_blocks, st.get_blocks, st.corrupt, st.errors) == (4, 3, 0, 0)


def _reader(addr: str, hs: list[bytes], q: mp.Queue) -> None:
    s = MooncakeStore(addr, SHAPE, BS, virtual=False)
    n, kv = s.get_run(hs)
    q.put((n, None if kv is None else kv.tobytes()))


def test_another_process_reads_what_this_one_put(service, store):
    hs = hashes("x", 5, seed=2)
    store.put(hs, kv_for(hs))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_reader, args=(service.client_addr, hs, q))
    p.start()
    n, raw = q.get(timeout=60)
    p.join(30)
    assert n == 5 and raw == kv_for(hs).tobytes()


def test_a_corrupt_value_ends_the_run_is_dropped_and_counted(service, store):
    from mooncake.store import MooncakeDistributedStore

    hs = hashes("c", 4, seed=3)
    store.put(hs[:2], kv_for(hs[:2]))
    # block 2 arrives torn: right size, bytes that do not match their checksum (a writer that died mid-put,
    # or a foreign writer); block 3 is fine but lies behind it
    raw = MooncakeDistributedStore()
    assert raw.setup_dummy(8 << 20, 1 << 20, service.client_addr) == 0
    assert raw.put(store._key(hs[2]), b"\x01" * store.slot) == 0
    store.put(hs[3:], kv_for(hs[3:]))
    n, kv = store.get_run(hs)
    assert n == 2 and np.array_equal(kv, kv_for(hs[:2]))               # never the bad block, never past it
    assert store.stats().corrupt == 1
    assert store.missing(hs) == [2]                                     # dropped: the next writer puts it again
    assert store.put(hs[2:3], kv_for(hs[2:3])) == 1 and store.get_run(hs)[0] == 4


def test_virtual_blocks_keep_declared_bytes(service):
    s = MooncakeStore(service.client_addr, SHAPE, BS, virtual=True)
    hs = hashes("v", 3, seed=4)
    assert s.put(hs, VirtualKV(3, 3 * s.block_nbytes)) == 3
    n, kv = s.get_run(hs)
    assert n == 3 and kv.nbytes == 3 * SHAPE.kv_bytes_per_token() * BS


def test_no_master_is_a_bounded_error_not_a_hang(tmp_path):
    from reference_server.ports import free_port

    with pytest.raises(MooncakeUnavailable, match="no Mooncake master"):
        MooncakeService(f"127.0.0.1:{free_port()}", 32 << 20, tmp_path)
    with pytest.raises(MooncakeUnavailable, match="no mooncake_client"):
        MooncakeStore(f"127.0.0.1:{free_port()}", SHAPE, BS, virtual=False)


def test_master_gone_means_misses_and_counted_errors(tmp_path):
    svc = MooncakeService(None, 32 << 20, tmp_path)
    try:
        s = MooncakeStore(svc.client_addr, SHAPE, BS, virtual=False)
        hs = hashes("m", 3, seed=5)
        assert s.put(hs, kv_for(hs)) == 3
        svc.kill_master()
        assert svc.alive()["master"] is False
        assert s.get_run(hs) == (0, None) and s.run_length(hs) == 0 and s.missing(hs) == []
        assert s.put(hashes("m2", 2), kv_for(hashes("m2", 2))) == 0
        assert s.stats().errors >= 3
    finally:
        svc.stop()


def test_memory_owner_gone_means_misses_and_counted_errors(tmp_path):
    svc = MooncakeService(None, 32 << 20, tmp_path)
    try:
        s = MooncakeStore(svc.client_addr, SHAPE, BS, virtual=False)
        hs = hashes("o", 3, seed=6)
        assert s.put(hs, kv_for(hs)) == 3
        owner = next(c for c in svc.children if c.name == "mooncake_client")
        owner.proc.kill()
        owner.proc.wait()
        assert svc.alive() == {"master": True, "client": False}
        assert s.get_run(hs) == (0, None)                  # its blocks went with it: a miss, not an exception
        assert s.stats().errors >= 1
    finally:
        svc.stop()


def test_a_worker_put_gathers_from_the_pool_straight_into_registered_memory(service):
    """A worker's put (reference_server/store_io.py): the cpu engine's pool gathers the blocks straight into the
    store's registered staging rows, the put checksums them there and moves them: one copy before the move.
    A reader gets those blocks, verified. Before, the pool was copied into a new array and that array into the
    staging buffer (``stage`` did not exist). The engine thread never waits for the buffer: while a staged put
    holds it, or for more blocks than one batch, ``stage`` answers None (the caller copies out as before)."""
    from reference_server.engine.cpu import CpuEngine

    eng = CpuEngine(block_size=BS, num_blocks=8, model="tiny")
    eng.write_blocks(list(range(8)), np.random.default_rng(3).standard_normal(
        (eng.shape.layers, 2, 8, BS, eng.shape.kv_heads, eng.shape.head_dim)).astype(np.float32))
    s = MooncakeStore(service.client_addr, eng.shape, BS, virtual=False, capacity_bytes=service.segment_bytes)
    try:
        ids, hs = [5, 1, 6], hashes("staged", 3, seed=11)
        staged = s.stage(len(ids))
        assert staged is not None and np.shares_memory(staged.kv, s._stage.buf)
        assert s.stage(1) is None                       # held until its put
        eng.read_blocks_into(ids, staged.kv)
        assert s.put(hs, staged) == 3
        n, kv = s.get_run(hs)
        assert n == 3 and np.array_equal(kv, eng.read_blocks(ids))
        assert s.stage(s.per_batch + 1) is None
        again = s.stage(1)                              # released by the put
        assert again is not None
        again.release()
    finally:
        s.close()


def _memfds() -> int:
    """This process's open memfds (each of Mooncake's staging buffers is one)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
        except OSError:
            pass
    return n


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts fds in /proc (Linux)")
def test_a_closed_handle_leaves_no_fd(service):
    """A worker opens a new handle each time the store's memory owner restarts (reference_server/store_io.py).
    Mooncake's ``close`` leaves the memfd of each of a handle's three staging buffers open, for good: before
    MooncakeStore.close closed them, every handle opened and closed here left 3 fds (a 30-minute soak's decode
    worker: fds 40 -> 63 over 15 store faults). Every handle after the first must still register its buffers and
    round-trip blocks (the transfer engine's registry is the process's)."""
    base = _memfds()
    for k in range(4):
        s = MooncakeStore(service.client_addr, SHAPE, BS, virtual=False, capacity_bytes=service.segment_bytes)
        hs = hashes(f"reopen{k}", 3, seed=20 + k)
        assert s.put(hs, kv_for(hs)) == 3
        n, kv = s.get_run(hs)
        assert n == 3 and np.array_equal(kv, kv_for(hs))
        s.close()
        assert _memfds() == base, (k, base, _memfds())
