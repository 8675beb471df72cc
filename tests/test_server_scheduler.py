"""The decode worker's scheduler installing remote-prefilled KV, without processes (sim engine, no sleeps)."""

from __future__ import annotations

from types import SimpleNamespace

from reference_server.decode_worker import DecodeRole
from reference_server.engine import create_engine
from reference_server.engine.base import VirtualKV
from reference_server.kv.block_manager import BlockManager
from reference_server.scheduler import Scheduler, Seq

BS = 16


def _sched() -> Scheduler:
    eng = create_engine("sim", block_size=BS, num_blocks=64, model="tiny", time_scale=0)
    return Scheduler(eng, BlockManager(64, BS, "ns"), policy="chunked", chunk_tokens=256, max_num_seqs=4,
                     eos_token_id=-1)


def _remote_seq(prompt: list[int], kv_from: int, eng) -> Seq:
    seq = Seq(rid="r", tenant="t", prompt=prompt, max_tokens=3, ignore_eos=True)
    n = -(-len(prompt) // BS) - kv_from // BS
    seq.remote_kv = (VirtualKV(n, n * eng.block_nbytes), kv_from, 7)
    return seq


def _run(s: Scheduler) -> None:
    for _ in range(20):
        if not s.has_work():
            return
        s.step()


def test_remote_kv_installed_when_the_prefix_is_still_cached():
    s = _sched()
    prompt = list(range(100, 180))
    warm = Seq(rid="w", tenant="t", prompt=prompt[:64] + [1], max_tokens=1, ignore_eos=True)
    s.add(warm)
    _run(s)
    s.release(warm)
    seq = _remote_seq(prompt, 64, s.engine)
    s.add(seq)
    _run(s)
    assert seq.cached == 64 and seq.output[0] == 7 and not seq.remote_gap
    assert seq.prefill_s == 0.0        # nothing prefilled here: the KV was installed


def test_evicted_prefix_is_a_recompute_and_reports_the_local_hit():
    # The decode worker's hit (kv_from) was evicted between routing and admission: the shipped KV has a
    # gap, the prompt is prefilled here, and the final report must say so, or the router would
    # report the prefill worker's cached_tokens for a prefill this worker actually did.
    s = _sched()
    seq = _remote_seq(list(range(100, 180)), 64, s.engine)
    s.add(seq)
    _run(s)
    assert seq.cached == 0 and seq.prefill_s > 0 and seq.remote_gap
    role = SimpleNamespace(info={"r": {"kv_recomputed": False}})
    t = DecodeRole.extra_timings(role, seq)  # type: ignore[arg-type]
    assert t["kv_recomputed"] is True and t["kv_error"] == "evicted"


def test_kv_receiver_survives_an_unexpected_receive_error(monkeypatch):
    # An exception other than a KV integrity error (e.g. the segment cannot be mapped) must turn that
    # request into a local prefill, not kill the receiver thread and strand every later remote request.
    import queue
    import threading

    import reference_server.decode_worker as dw

    def boom(*a, **k):
        raise PermissionError("cannot map")

    monkeypatch.setattr(dw, "shm_receive", boom)
    eng = create_engine("sim", block_size=BS, num_blocks=8, model="tiny", time_scale=0)
    role = DecodeRole.__new__(DecodeRole)
    role.w = SimpleNamespace(engine=eng, blocks=SimpleNamespace(block_size=BS), inbox=queue.Queue(), counters={})
    role.incoming, role.link, role.aborted = queue.Queue(), None, {}
    failed: list[tuple[str, str]] = []
    role.failed = lambda rid, err: failed.append((rid, err))  # type: ignore[method-assign]
    threading.Thread(target=role._recv_loop, daemon=True).start()
    for rid in ("a", "b"):
        role.incoming.put({"rid": rid, "shm": {"request_id": rid, "name": "pkv-none", "nbytes": 64}})
    for _ in range(2):
        role.w.inbox.get(timeout=5)()
    assert [r for r, _ in failed] == ["a", "b"] and "PermissionError" in failed[0][1]


def test_kv_for_the_wrong_block_range_is_a_recompute_of_that_request_only():
    # A transfer carrying one block fewer than [kv_from, end of prompt): before, installing it raised
    # inside admission and the worker failed every running and waiting sequence.
    eng = create_engine("cpu", block_size=BS, num_blocks=64, model="tiny")
    s = Scheduler(eng, BlockManager(64, BS, "ns"), policy="chunked", chunk_tokens=256, max_num_seqs=4,
                  eos_token_id=-1)
    other = Seq(rid="o", tenant="t", prompt=list(range(300, 340)), max_tokens=3, ignore_eos=True)
    s.add(other)
    s.step()                                                  # running when the bad transfer arrives
    bad = Seq(rid="r", tenant="t", prompt=list(range(100, 180)), max_tokens=3, ignore_eos=True)
    kv = eng.read_blocks(list(range(4)))                      # 4 blocks; [0, 80) needs 5
    bad.remote_kv = (kv, 0, 7)
    s.add(bad)
    for _ in range(20):
        if not s.has_work():
            break
        res, rejected = s.step()
        assert not rejected
    assert bad.remote_gap == "range" and bad.prefill_s > 0 and len(bad.output) == 3 and bad.output[0] != 7
    assert len(other.output) == 3 and other.finish_reason == "length"
    role = SimpleNamespace(info={"r": {"kv_recomputed": False}})
    assert DecodeRole.extra_timings(role, bad) == {"kv_recomputed": True, "kv_error": "range"}  # type: ignore[arg-type]


def test_kv_announced_for_other_positions_is_never_installed():
    # Right block count, wrong start: installing it would put other positions' KV under this prompt.
    from reference_server.kv.codec import TransferMeta
    from reference_server.kv.transport.common import Received, TransferStats

    added: list[Seq] = []
    role = DecodeRole.__new__(DecodeRole)
    role.w = SimpleNamespace(blocks=SimpleNamespace(block_size=BS), sched=SimpleNamespace(add=added.append))
    role.pending, role.info, role.aborted, role.link = {}, {}, {}, None
    eng = create_engine("sim", block_size=BS, num_blocks=64, model="tiny", time_scale=0)
    seq = Seq(rid="r", tenant="t", prompt=list(range(100, 180)), max_tokens=3, ignore_eos=True)
    meta = TransferMeta.for_shape("r", eng.shape, block_size=BS, n_blocks=1, num_tokens=80, start_block=0)
    rec = Received("r", meta, VirtualKV(1, eng.block_nbytes), TransferStats("r", "shm", 0, 1, 0.0))
    role.pending["r"] = {"t": 0.0, "seq": seq, "rec": rec, "first": 7, "kv_from": 64}   # expects block 4 on
    role._maybe_start("r")
    assert added == [seq] and seq.remote_kv is None                  # admitted, to prefill locally
    assert role.info["r"] == {"kv_recomputed": True, "kv_error": "range"}


def test_abort_drops_a_sequence_wherever_it_is_and_frees_its_blocks():
    # A client that left (docs/faults.md, "Clients that leave"): its sequence goes from the queue, from a
    # prefill between two chunks, from the decode batch, and from a remote install whose first token is
    # due at the next step (before: that token was still emitted, for a request nobody waited for).
    eng = create_engine("sim", block_size=BS, num_blocks=64, model="tiny", time_scale=0)
    s = Scheduler(eng, BlockManager(64, BS, "ns"), policy="chunked", chunk_tokens=32, max_num_seqs=1,
                  eos_token_id=-1)
    long = Seq(rid="long", tenant="t", prompt=list(range(100, 200)), max_tokens=4, ignore_eos=True)
    queued = Seq(rid="queued", tenant="t", prompt=list(range(300, 310)), max_tokens=4, ignore_eos=True)
    s.add(long)
    s.add(queued)
    s.step()                                   # one 32-token chunk of the long prompt; max_num_seqs 1 queues the other
    assert long.computed == 32 and s.blocks.usage() > 0
    assert s.abort("queued") == "queued"
    assert s.abort("long") == "prefill"        # between two chunks: the rest is never computed
    assert s.abort("long") is None and not s.has_work() and s.blocks.usage() == 0

    dec = Seq(rid="dec", tenant="t", prompt=list(range(400, 410)), max_tokens=10, ignore_eos=True)
    s.add(dec)
    s.step()
    s.step()
    assert len(dec.output) == 2 and s.abort("dec") == "decode" and s.blocks.usage() == 0

    r = _remote_seq(list(range(500, 580)), 0, eng)
    s.add(r)
    s._admit()                                 # its KV installed; its first token goes out with the next step
    assert s.abort("r") == "decode"
    res, _ = s.step()
    assert res.emitted == [] and not s.has_work() and s.blocks.usage() == 0


def test_a_request_failed_in_the_scheduler_leaves_nothing_in_its_role():
    """A request the scheduler rejects (a prompt that never fits the KV budget) or an engine error fails goes
    through Worker.fail. Before, a decode worker kept the KV timings its admission recorded for it, and a prefill
    worker its shipping job, for good: one entry per such request, for the worker's life."""
    from reference_server.prefill_worker import PrefillRole
    from reference_server.worker import Worker

    sent: list = []
    decode = DecodeRole.__new__(DecodeRole)
    decode.info = {"r1": {"kv_recomputed": False, "kv_transfer_ms": 1.5}, "r2": {"kv_recomputed": True}}
    prefill = PrefillRole.__new__(PrefillRole)
    prefill.jobs = {"r1": {"kv_from": 0, "dest": "decode-0"}}
    for role in (decode, prefill):
        w = SimpleNamespace(send=lambda rid, msg: sent.append(msg), owner={"r1": "conn"}, role_helper=role)
        seq = Seq(rid="r1", tenant="t", prompt=[1, 2, 3], max_tokens=3, ignore_eos=True)
        Worker.fail(w, seq, "error:prompt does not fit the KV budget")  # type: ignore[arg-type]
        assert w.owner == {}
    assert list(decode.info) == ["r2"] and prefill.jobs == {}
    assert [m["op"] for m in sent] == ["error", "error"]
