"""KV transports between real processes: real bytes arrive intact, corruption and bad tokens are
refused, VirtualKV waits its modeled wire time, and no shared-memory segment outlives its transfer."""

import asyncio
import multiprocessing as mp
import os
import time

import numpy as np
import pytest

from reference_server.engine.base import ModelShape, VirtualKV
from reference_server.kv.codec import TransferMeta
from reference_server.kv.transport import KVAuthError, KVReceiver, KVSender, Link, ShmRef, ShmSender, shm_receive
from reference_server.kv.transport.shm import MAPPINGS

SHAPE = ModelShape("tiny", "v1", layers=4, kv_heads=4, head_dim=64, vocab_size=1000, kv_dtype="float32")
BS = 64
N_BLOCKS = 16                      # 4*2*16*64*4*64*4 bytes = 8 MiB of KV per message


def make_kv(seed):
    return np.random.default_rng(seed).standard_normal((4, 2, N_BLOCKS, BS, 4, 64), dtype=np.float32)


def make_meta(rid, dtype=None):
    return TransferMeta.for_shape(rid, SHAPE, block_size=BS, n_blocks=N_BLOCKS, num_tokens=N_BLOCKS * BS - 5, dtype=dtype)


def shm_exists(name):
    return os.path.exists(f"/dev/shm/{name}")


# ---- child processes (module level: spawned children import them) ---------------------------------

def shm_child(refs, go_on):
    sender = ShmSender()
    refs.put(sender.send(make_meta("raw"), make_kv(1))[0].to_dict())
    refs.put(sender.send(make_meta("fp8", "fp8_e4m3"), make_kv(2))[0].to_dict())
    refs.put(sender.send(make_meta("bad"), make_kv(3), flip_byte=12345)[0].to_dict())
    refs.put(sender.send(make_meta("orphan"), make_kv(4))[0].to_dict())     # nobody will take this one
    go_on.wait(60)
    refs.put((sender.outstanding(), sender.segments()))
    sender.close()


def tcp_child(host, port, token, results):
    out = {}
    with KVSender(host, port, token=token) as tx:
        for rid, dtype, seed, flip in [("raw", None, 1, None), ("fp8", "fp8_e4m3", 2, None), ("bad", None, 3, 999)]:
            st = tx.send(make_meta(rid, dtype), make_kv(seed), flip_byte=flip)
            out[rid] = (st.error, st.payload_bytes, st.elapsed_s)
    try:
        KVSender(host, port, token="wrong").send(make_meta("x"), make_kv(5))
        out["auth"] = "accepted"
    except KVAuthError:
        out["auth"] = "refused"
    results.put(out)


# ---- tests ---------------------------------------------------------------------------------------

def test_shm_between_processes_moves_real_bytes_and_leaks_nothing():
    ctx = mp.get_context("spawn")
    refs, go_on = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=shm_child, args=(refs, go_on))
    child.start()
    try:
        got = [ShmRef.from_dict(refs.get(timeout=60)) for _ in range(4)]
        assert all(r.pooled and shm_exists(r.name) for r in got)
        assert len({r.name for r in got}) == 4                    # none given back yet: no reuse
        raw = shm_receive(got[0], expect=SHAPE, block_size=BS)
        assert raw.ok and np.array_equal(raw.kv, make_kv(1))
        assert raw.stats.payload_bytes == 8 * 2**20 and raw.stats.elapsed_s > 0
        fp8 = shm_receive(got[1], expect=SHAPE, block_size=BS)
        assert fp8.ok and got[1].nbytes < got[0].nbytes / 3.8 and fp8.stats.payload_bytes < 2.1 * 2**20
        assert np.sqrt(np.mean((fp8.kv - make_kv(2)) ** 2)) < 0.05
        bad = shm_receive(got[2], expect=SHAPE)
        assert not bad.ok and bad.error.reason == "checksum" and bad.kv is None
        go_on.set()
        outstanding, segments = refs.get(timeout=60)
        assert outstanding == [got[3].name]                       # given back, even the bad one
        assert sorted(segments) == sorted(r.name for r in got)
    finally:
        go_on.set()
        child.join(60)
        MAPPINGS.close()
    assert child.exitcode == 0
    assert not any(shm_exists(r.name) for r in got)               # sender's close() unlinked all


def test_shm_pool_reuses_one_segment_and_one_shot_segments_are_unlinked():
    sender = ShmSender()
    names = set()
    for i in range(3):
        ref, _ = sender.send(make_meta(f"r{i}"), make_kv(i))
        names.add(ref.name)
        assert shm_receive(ref, expect=SHAPE).ok
    assert len(names) == 1 and sender.outstanding() == []
    sender.close()
    assert not shm_exists(names.pop())

    one_shot = ShmSender(pool_bytes=0)
    ref, _ = one_shot.send(make_meta("o"), make_kv(1))
    assert not ref.pooled and shm_exists(ref.name)
    r = shm_receive(ref, expect=SHAPE)
    assert r.ok and np.array_equal(r.kv, make_kv(1)) and not shm_exists(ref.name)
    one_shot.close()
    MAPPINGS.close()


def test_shm_reclaims_what_no_receiver_took():
    for pool_bytes in (0, 64 << 20):
        sender = ShmSender(pool_bytes=pool_bytes, ttl_s=0.0)
        ref, _ = sender.send(make_meta("a"), make_kv(7))
        time.sleep(0.01)
        assert sender.reap() == 1 and sender.outstanding() == []
        if not ref.pooled:
            assert shm_receive(ref, expect=SHAPE).error.reason == "truncated"
        sender.close()
        assert not shm_exists(ref.name)


def test_shm_consume_callback_gets_a_view_before_give_back():
    sender = ShmSender()
    ref, _ = sender.send(make_meta("a"), make_kv(7))
    seen = []
    r = shm_receive(ref, expect=SHAPE, consume=lambda meta, kv: seen.append(float(kv.sum())))
    assert r.ok and r.kv is None and seen == [pytest.approx(float(make_kv(7).sum()), rel=1e-5)]
    sender.close()
    MAPPINGS.close()


def test_tcp_between_processes_with_token():
    rx = KVReceiver(SHAPE, block_size=BS, token="s3cret").start()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=tcp_child, args=(*rx.address, "s3cret", results))
    child.start()
    try:
        raw = rx.wait("raw", 60)
        assert raw.ok and np.array_equal(raw.kv, make_kv(1)) and raw.stats.payload_bytes == 8 * 2**20
        fp8 = rx.wait("fp8", 60)
        assert fp8.ok and fp8.stats.wire_bytes < raw.stats.wire_bytes / 3.8
        assert np.allclose(fp8.kv, make_kv(2), atol=0.3) and np.sqrt(np.mean((fp8.kv - make_kv(2)) ** 2)) < 0.05
        bad = rx.wait("bad", 60)
        assert bad.error.reason == "checksum"
        out = results.get(timeout=60)
    finally:
        child.join(60)
        rx.close()
    assert child.exitcode == 0
    assert out["raw"][0] is None and out["fp8"][0] is None and out["bad"][0] == "checksum"
    assert out["raw"][1] == 8 * 2**20 and out["raw"][2] > 0
    assert out["auth"] == "refused" and rx.auth_failures == 1 and rx.received == 2 and rx.rejected == {"checksum": 1}


def test_virtual_kv_waits_modeled_wire_time_on_a_shared_link():
    link = Link(bandwidth_bytes_per_s=50e6)
    vkv = VirtualKV(N_BLOCKS, N_BLOCKS * BS * SHAPE.kv_bytes_per_token())   # 8 MiB at 50 MB/s: 168 ms
    with KVReceiver(SHAPE, link=link) as rx, KVSender(*rx.address) as tx:
        st = tx.send(make_meta("v"), vkv)
        got = rx.wait("v", 5)
    assert st.virtual and st.wire_bytes < 200 and st.payload_bytes == vkv.nbytes
    assert 0.16 <= st.elapsed_s < 1.0 and got.stats.modeled_s == pytest.approx(vkv.nbytes / 50e6, abs=0.02)
    assert got.kv == vkv
    # The link is FIFO: a second transfer starting at the same instant finishes after both.
    t = time.perf_counter() + 10
    assert link.reserve(100_000_000, t) == pytest.approx(t + 2)
    assert link.reserve(100_000_000, t) == pytest.approx(t + 4)


def test_virtual_kv_over_shm_and_async_wait():
    sender = ShmSender()
    ref, st = sender.send(make_meta("v", "fp8_e4m3"), VirtualKV(N_BLOCKS, N_BLOCKS * BS * SHAPE.kv_bytes_per_token()))
    r = shm_receive(ref, expect=SHAPE, link=Link(20e6))
    MAPPINGS.close()
    assert r.ok and r.stats.virtual and ref.nbytes < 200
    assert r.stats.payload_bytes == st.payload_bytes < 2.1 * 2**20 and r.stats.elapsed_s >= 2**21 / 20e6

    async def early_waiter():
        with KVReceiver(SHAPE) as rx, KVSender(*rx.address) as tx:
            waiting = asyncio.ensure_future(rx.wait_async("late", 10))
            await asyncio.sleep(0.05)
            await tx.send_async(make_meta("late"), make_kv(9))
            got = await waiting
            with pytest.raises(TimeoutError):
                await rx.wait_async("never", 0.05)
            return got

    got = asyncio.run(early_waiter())
    assert got.ok and np.array_equal(got.kv, make_kv(9))
    sender.close()


def test_receiver_refuses_another_model_version():
    other = ModelShape("tiny", "v2", 4, 4, 64, 1000, "float32")
    with KVReceiver(other) as rx, KVSender(*rx.address) as tx:
        st = tx.send(make_meta("m"), make_kv(1))
        assert st.error == "model" and rx.wait("m", 5).error.reason == "model"


def _start_holder():
    """A sender process (own session) holding one un-received pooled segment; prints its name."""
    import subprocess
    import sys
    code = ("import sys, numpy as np\n"
            "from reference_server.engine.base import ModelShape\n"
            "from reference_server.kv.codec import TransferMeta\n"
            "from reference_server.kv.transport import ShmSender\n"
            "s = ModelShape('t', 'v', 1, 1, 8, 10, 'float32')\n"
            "snd = ShmSender()\n"
            "ref, _ = snd.send(TransferMeta.for_shape('r', s, block_size=4, n_blocks=1, num_tokens=4),"
            " np.ones((1, 2, 1, 4, 1, 8), np.float32))\n"
            "print(ref.name, flush=True)\n"
            "sys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    return proc, proc.stdout.readline().strip()


def _gone_within(name, seconds):
    deadline = time.monotonic() + seconds
    while shm_exists(name) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not shm_exists(name)


def test_killed_sender_segment_is_unlinked_by_the_resource_tracker():
    import signal
    proc, name = _start_holder()
    try:
        assert name.startswith("pkv") and shm_exists(name)
    finally:
        proc.send_signal(signal.SIGKILL)              # the sender only: its tracker survives and cleans up
        proc.wait(10)
        proc.stdin.close()
        proc.stdout.close()
    assert _gone_within(name, 10)


def test_sigkilled_process_group_segment_is_swept_by_the_next_sender():
    import signal
    proc, name = _start_holder()
    os.killpg(proc.pid, signal.SIGKILL)               # sender and its tracker: nothing left to clean up
    proc.wait(10)
    proc.stdin.close()
    proc.stdout.close()
    time.sleep(0.2)
    assert shm_exists(name)
    ShmSender().close()                               # a new sender sweeps orphans of dead pids
    assert not shm_exists(name)


def test_tcp_borrow_mode_reuses_one_buffer_without_mixing_messages():
    copies = {}
    with KVReceiver(SHAPE, on_receive=lambda r: copies.__setitem__(r.request_id, r.kv.copy()), borrow=True) as rx, \
            KVSender(*rx.address) as tx:
        for i in range(3):
            assert tx.send(make_meta(f"b{i}"), make_kv(10 + i)).error is None
    assert all(np.array_equal(copies[f"b{i}"], make_kv(10 + i)) for i in range(3))
    with pytest.raises(ValueError):
        KVReceiver(SHAPE, borrow=True)


def test_mailbox_bounds_unclaimed_items_and_discard():
    from reference_server.kv.transport import Mailbox, Received, TransferStats

    box = Mailbox(max_pending=2)
    for rid in ("a", "b", "c"):
        box.put(Received(rid, None, None, TransferStats(rid, "tcp", 0, 0, 0.0)))
    with pytest.raises(TimeoutError):
        box.get("a", 0.01)                          # oldest dropped: that request will recompute
    box.discard("b")
    with pytest.raises(TimeoutError):
        box.get("b", 0.01)
    assert box.get("c", 0.01).request_id == "c"


def test_shm_discard_gives_a_cancelled_transfer_back():
    sender = ShmSender()
    ref, _ = sender.send(make_meta("x"), make_kv(1))
    assert sender.outstanding() == [ref.name]
    sender.discard(ref)
    assert sender.outstanding() == []
    ref2, _ = sender.send(make_meta("y"), make_kv(2))
    assert ref2.name == ref.name                    # the freed segment is reused
    assert shm_receive(ref2, expect=SHAPE).ok
    sender.close()
    MAPPINGS.close()
