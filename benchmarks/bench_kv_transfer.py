"""KV transfer bandwidth: shared memory, loopback TCP and the shared KV stores against memcpy and a raw socket.

Everything is measured in this one run, on the same payloads (float32 KV, 0.5 MiB per block):

* ``memcpy``   numpy ``copyto`` into a preallocated array: the ceiling for any same-host move;
* ``raw tcp``  ``sendall`` of the same bytes over a loopback socket into a preallocated buffer, acked:
  the ceiling for a TCP transport;
* ``shm``      ``ShmSender.send`` (encode + xxh3 checksum + write into a new segment) then
  ``shm_receive`` (map + verify + copy into a preallocated pool array + unlink): a whole request;
* ``tcp``      ``KVSender.send`` to a ``KVReceiver`` (authenticated), receiver verifies and copies into
  the pool, sender waits for the ack: a whole request;
* ``shm fp8`` / ``tcp fp8`` the same with FP8 e4m3 on the wire (a quarter of the bytes, plus quantize
  and dequantize compute);
* ``store put`` / ``store get``  the built-in shared KV store (reference_server/kv/store.py): ``put`` of new
  blocks (copy into the segment + xxh3 per block + publish), ``get_run`` of them (pin + verify + copy out);
* ``mooncake put`` / ``mooncake get``  the same calls on Mooncake Store (``--kv-store mooncake``): a master and
  a ``mooncake_client`` owning the memory, started by this run; this process is a ``setup_dummy`` client
  (a worker's layout), so every byte crosses to the memory owner's process and back. Skipped, with the
  reason, where ``paasbench[mooncake]`` is not installed;
* ``mc put copy`` / ``xxh3`` / ``move``: the stages of a Mooncake put, each timed alone over the payload;
* ``mc worker copy-out`` / ``staged``: a worker's put from its engine's KV pool by block ids, before
  (``read_blocks`` into a new array, then ``put``: two copies before the move) and now (``stage`` +
  ``read_blocks_into`` straight into the registered buffer, then ``put``: one copy);
* cost breakdown: xxh3_64 alone, ``encode`` (float32: checksum only, no copy; fp8: quantize + checksum),
  ``decode`` (verify; fp8: dequantize);
* FP8 accuracy on real KV: the ``cpu`` engine's tiny model prefills a prompt; its KV goes through FP8
  into other blocks; we report the KV's relative RMS error, the first decode step's logit error, and
  whether greedy decoding from the FP8 copy emits the same tokens as from the exact KV.

GB/s = payload bytes (the float32 KV size, 1e9 bytes per GB) / seconds: the median of ``--repeat`` runs,
and the best run (``best``); ratios use medians. The TCP receiver runs in ``borrow`` mode, installing
into the pool from its reused buffer, as ``shm_receive(consume=...)`` does from the segment.
Senders and receivers are threads of this process (sockets and copies release the GIL).

Each put writes new keys (both stores keep a key's first value); the store sizes hold every repeat. The
Mooncake rows run on a warm segment (a first pass of puts, then ``remove_all`` before each group of rows),
as a store in use is: on a fresh segment each first write to a page faults in the memory owner's process.

Run: ``python benchmarks/bench_kv_transfer.py [--sizes 1,16,128] [--repeat 5] [--fp8-prompt 1000] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import threading
import time
from typing import Callable

import numpy as np
import xxhash

from reference_server.engine.base import ModelShape
from reference_server.kv.codec import TransferMeta, decode, encode, frames_nbytes
from reference_server.kv.store import KVStore
from reference_server.kv.transport import KVReceiver, KVSender, ShmSender, shm_receive

SHAPE = ModelShape("bench", "1", layers=4, kv_heads=4, head_dim=64, vocab_size=1000, kv_dtype="float32")
BLOCK = 64                                   # tokens; 4 layers x K,V x 64 x 4 heads x 64 dims x 4 B = 0.5 MiB
BLOCK_BYTES = BLOCK * SHAPE.kv_bytes_per_token()


def median_s(fn: Callable[[], None], repeat: int) -> tuple[float, float]:
    """(median, best) seconds: the median is the honest figure, the best what the code can do when
    the other tenants of a shared machine leave it alone."""
    fn()                                     # warm: page faults, connections, imports
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


class RawTCP:
    """The baseline transport: one connection, length known in advance, recv_into, 1-byte ack."""

    def __init__(self, nbytes: int) -> None:
        self.buf = memoryview(bytearray(nbytes))
        srv = socket.create_server(("127.0.0.1", 0))
        self.tx = socket.create_connection(srv.getsockname()[:2])
        self.rx, _ = srv.accept()
        srv.close()
        for s in (self.tx, self.rx):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._go = threading.Semaphore(0)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            self._go.acquire()
            got, n = 0, len(self.buf)
            while got < n:
                got += self.rx.recv_into(self.buf[got:], n - got)
            self.rx.sendall(b"k")

    def send(self, payload: memoryview) -> None:
        self._go.release()
        self.tx.sendall(payload)
        self.tx.recv(1)

    def close(self) -> None:
        self.tx.close()
        self.rx.close()


def store_rows(store, kv, repeat: int) -> list[tuple[str, tuple[float, float], int]]:
    """``put`` of fresh blocks, then ``get_run`` of one stored run, on one :class:`BlockStore`."""
    n = kv.shape[2]

    def fresh() -> list[bytes]:
        return [os.urandom(16) for _ in range(n)]

    def put() -> None:
        assert store.put(fresh(), kv) == n, "the store refused blocks: make it bigger"
    keys = fresh()
    assert store.put(keys, kv) == n

    def get() -> None:
        got, out = store.get_run(keys)
        assert got == n and out.shape == kv.shape, got
    return [("put", median_s(put, repeat), kv.nbytes), ("get", median_s(get, repeat), kv.nbytes)]


def mooncake_put_stages(mc, kv, repeat: int) -> list[tuple[str, tuple[float, float]]]:
    """Where a Mooncake put's time goes, each stage over the whole payload batch by batch as ``put`` runs it:
    ``copy`` (each block into its row of the registered staging buffer), ``xxh3`` (each row's checksum) and
    ``move`` (``batch_put_from`` of the staged rows: the memory owner's process copies them into its
    segment), on fresh keys."""
    n, a = kv.shape[2], mc._put
    parts = [(lo, min(n, lo + mc.per_batch)) for lo in range(0, n, mc.per_batch)]

    def rows(j: int) -> np.ndarray:
        return a.buf[j * mc.slot:(j + 1) * mc.slot]

    def copy() -> None:
        for lo, hi in parts:
            for j in range(hi - lo):
                np.copyto(rows(j)[:mc.block_nbytes].view(kv.dtype).reshape(kv.shape[:2] + kv.shape[3:]), kv[:, :, lo + j])

    def xxh3() -> None:
        for lo, hi in parts:
            for j in range(hi - lo):
                xxhash.xxh3_64_intdigest(rows(j)[:mc.block_nbytes])

    def move() -> None:
        for lo, hi in parts:
            codes = mc._c.batch_put_from([mc._key(os.urandom(16)) for _ in range(hi - lo)],
                                         [a.ptr + j * mc.slot for j in range(hi - lo)], [mc.slot] * (hi - lo))
            assert all(c == 0 for c in codes), codes
    return [("copy", median_s(copy, repeat)), ("xxh3", median_s(xxh3, repeat)), ("move", median_s(move, repeat))]


def mooncake_worker_puts(mc, kv, repeat: int) -> list[tuple[str, tuple[float, float]]]:
    """A worker's put as reference_server/store_io.py runs it, from an engine's KV pool (the cpu engine's
    numpy ``KVPool`` holding the payload's blocks) by block ids in shuffled order, one sequence per batch
    (``per_batch`` blocks): ``copy-out`` (``KVPool.read`` into a new array, then ``put`` copies it into the
    staging buffer, checksums, moves: two copies before the move; what a worker did before ``stage``) and
    ``staged`` (``stage``, ``KVPool.read_into`` gathers straight into the registered rows, ``put`` checksums
    and moves: one copy)."""
    from reference_server.engine.backend import get_backend
    from reference_server.engine.paged import KVPool

    n = kv.shape[2]
    pool = KVPool(get_backend("numpy"), (kv.shape[0], n) + kv.shape[3:], "float32")
    pool.data[...] = kv
    order = np.random.default_rng(1).permutation(n).tolist()
    seqs = [order[lo:lo + mc.per_batch] for lo in range(0, n, mc.per_batch)]

    def fresh(k: int) -> list[bytes]:
        return [os.urandom(16) for _ in range(k)]

    def copy_out() -> None:
        for ids in seqs:
            assert mc.put(fresh(len(ids)), pool.read(ids)) == len(ids)

    def staged() -> None:
        for ids in seqs:
            st = mc.stage(len(ids))
            pool.read_into(ids, st.kv)
            assert mc.put(fresh(len(ids)), st) == len(ids)
    out = [("copy-out", median_s(copy_out, repeat))]
    mc._c.remove_all()                       # each from the same (warm) segment
    return out + [("staged", median_s(staged, repeat))]


def bench_size(mb: int, repeat: int, mooncake: object) -> list[dict]:
    n_blocks = max(1, mb * 2**20 // BLOCK_BYTES)
    kv = np.random.default_rng(0).standard_normal((SHAPE.layers, 2, n_blocks, BLOCK, SHAPE.kv_heads, SHAPE.head_dim),
                                                   dtype=np.float32)
    nbytes = kv.nbytes
    pool = np.empty_like(kv)                 # the receiver's engine pool (write_blocks target)
    raw = memoryview(kv).cast("B")
    meta32 = TransferMeta.for_shape("r", SHAPE, block_size=BLOCK, n_blocks=n_blocks, num_tokens=n_blocks * BLOCK)
    meta8 = TransferMeta.for_shape("r", SHAPE, block_size=BLOCK, n_blocks=n_blocks, num_tokens=n_blocks * BLOCK,
                                   dtype="fp8_e4m3")
    rows: list[tuple[str, tuple[float, float], int]] = []   # (what, (median s, best s), wire bytes)

    rows.append(("memcpy", median_s(lambda: np.copyto(pool, kv), repeat), nbytes))
    rawtcp = RawTCP(nbytes)
    rows.append(("raw tcp", median_s(lambda: rawtcp.send(raw), repeat), nbytes))
    rawtcp.close()

    def install(meta, arr):
        np.copyto(pool, arr)

    sender = ShmSender()
    for label, meta in (("shm", meta32), ("shm fp8", meta8)):
        wire = frames_nbytes(encode(meta, kv))

        def shm_once(meta=meta):
            ref, _ = sender.send(meta, kv)
            r = shm_receive(ref, expect=SHAPE, block_size=BLOCK, consume=install)
            assert r.ok, r.error
        rows.append((label, median_s(shm_once, repeat), wire))
    sender.close()

    with KVReceiver(SHAPE, block_size=BLOCK, token="t", on_receive=lambda r: install(r.meta, r.kv), borrow=True) as rx, \
            KVSender(*rx.address, token="t") as tx:
        for label, meta in (("tcp", meta32), ("tcp fp8", meta8)):
            wire = frames_nbytes(encode(meta, kv))

            def tcp_once(meta=meta):
                st = tx.send(meta, kv)
                assert st.error is None, st.error
            rows.append((label, median_s(tcp_once, repeat), wire))

    store = KVStore.create((repeat + 3) * nbytes, SHAPE, BLOCK, virtual=False)
    try:
        rows += [(f"store {what}", t, w) for what, t, w in store_rows(store, kv, repeat)]
    finally:
        store.unlink()
        store.close()
    if mooncake is not None:
        from reference_server.kv.mooncake import MooncakeStore

        mc = MooncakeStore(mooncake.client_addr, SHAPE, BLOCK, virtual=False)
        try:
            # Every group of rows writes into segment memory the memory owner has already faulted in, as a store
            # in use does (a first write to a page costs a fault in its process): one pass of the puts a group
            # makes, then each group after a remove_all.
            for _ in range(2 * (repeat + 2)):        # the most a group writes: the worker rows, two puts a repeat
                assert mc.put([os.urandom(16) for _ in range(kv.shape[2])], kv) == kv.shape[2]
            mc._c.remove_all()
            rows += [(f"mooncake {what}", t, w) for what, t, w in store_rows(mc, kv, repeat)]
            mc._c.remove_all()
            rows += [(f"  mc put {what}", t, nbytes) for what, t in mooncake_put_stages(mc, kv, repeat)]
            mc._c.remove_all()
            rows += [(f"mc worker {what}", t, nbytes) for what, t in mooncake_worker_puts(mc, kv, repeat)]
            mc._c.remove_all()
        finally:
            mc.close()

    msg32 = b"".join(bytes(f) for f in encode(meta32, kv))
    msg8 = b"".join(bytes(f) for f in encode(meta8, kv))
    rows.append(("  xxh3_64 only", median_s(lambda: xxhash.xxh3_64_intdigest(raw), repeat), nbytes))
    rows.append(("  encode f32", median_s(lambda: encode(meta32, kv), repeat), nbytes))
    rows.append(("  decode f32", median_s(lambda: decode(msg32, expect=SHAPE), repeat), nbytes))
    rows.append(("  encode fp8", median_s(lambda: encode(meta8, kv), repeat), len(msg8)))
    rows.append(("  decode fp8", median_s(lambda: decode(msg8, expect=SHAPE), repeat), len(msg8)))

    base = {what: s for what, (s, _), _ in rows}
    return [{"size_mb": mb, "what": what.strip(), "ms": s * 1e3, "gbps": nbytes / s / 1e9, "best_gbps": nbytes / b / 1e9,
             "wire_bytes": wire, "vs_memcpy": base["memcpy"] / s, "vs_raw_tcp": base["raw tcp"] / s}
            for what, (s, b), wire in rows]


def fp8_on_real_kv(prompt_len: int, decode_tokens: int) -> dict:
    from reference_server.engine.base import SeqStep
    from reference_server.engine.cpu import CpuEngine
    from reference_server.kv import fp8

    bs = 64
    n = -(-(prompt_len + decode_tokens) // bs)
    eng = CpuEngine(block_size=bs, num_blocks=2 * n, model="tiny")
    prompt = np.random.default_rng(0).integers(100, 5000, prompt_len).tolist()
    exact, copy = list(range(n)), list(range(n, 2 * n))
    first = eng.step([SeqStep("exact", prompt, 0, exact)])[0]
    used = -(-prompt_len // bs)
    kv = eng.read_blocks(exact[:used])
    codes, scales = fp8.quantize(kv)
    eng.write_blocks(copy[:used], fp8.dequantize(codes, scales))
    la, lb = (eng.forward([SeqStep(sid, [first], prompt_len, t)])[0] for sid, t in (("exact", exact), ("copy", copy)))
    finite = np.isfinite(la) & np.isfinite(lb)
    out = {"exact": [first], "fp8": [first]}
    for sid, table in (("exact", exact), ("fp8", copy)):
        for i in range(decode_tokens):
            out[sid].append(eng.step([SeqStep(sid, [out[sid][-1]], prompt_len + i, table)])[0])
    same = next((i for i, (a, b) in enumerate(zip(out["exact"], out["fp8"])) if a != b), len(out["exact"]))
    return {"prompt_tokens": prompt_len, "kv_rel_rms": float(np.sqrt(np.mean((fp8.dequantize(codes, scales) - kv) ** 2)
                                                                     / np.mean(kv ** 2))),
            "logit_max_abs_err": float(np.abs(la[finite] - lb[finite]).max()), "logit_range": float(np.ptp(la[finite])),
            "same_argmax": bool(np.argmax(np.where(finite, la, -np.inf)) == np.argmax(np.where(finite, lb, -np.inf))),
            "greedy_tokens_equal": same, "greedy_tokens": len(out["exact"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,16,128", help="payload sizes in MiB")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--fp8-prompt", type=int, default=1000, help="prompt tokens for the FP8 accuracy check (0: skip)")
    ap.add_argument("--fp8-decode", type=int, default=32)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    out = []
    sizes = [int(s) for s in args.sizes.split(",")]
    mooncake = None
    try:
        from reference_server.kv.mooncake_service import MooncakeService, log_dir

        # twice what the puts write (the store rows and the put stages' moves; the worker puts after a remove_all):
        # the master evicts only above its
        # high watermark, and a block read is leased 10 s
        mooncake = MooncakeService(None, 2 * (2 * args.repeat + 4) * max(sizes) * 2**20, log_dir())
    except ImportError as exc:
        print(f"Mooncake rows skipped: {exc} (pip install '.[mooncake]')")
    print(f"{'MiB':>5} {'what':<15} {'ms':>9} {'GB/s':>7} {'best':>7} {'wire MiB':>9} {'x memcpy':>9} {'x raw tcp':>10}")
    for mb in sizes:
        for r in bench_size(mb, args.repeat, mooncake):
            out.append(r)
            print(f"{mb:>5} {r['what']:<15} {r['ms']:>9.2f} {r['gbps']:>7.2f} {r['best_gbps']:>7.2f} {r['wire_bytes'] / 2**20:>9.2f} "
                  f"{r['vs_memcpy']:>9.3f} {r['vs_raw_tcp']:>10.3f}")
    if mooncake is not None:
        mooncake.stop()
    acc = fp8_on_real_kv(args.fp8_prompt, args.fp8_decode) if args.fp8_prompt else None
    if acc:
        print(f"FP8 on real KV (cpu engine, tiny, {acc['prompt_tokens']} prompt tokens): KV rel RMS error "
              f"{acc['kv_rel_rms']:.4f}; first-step logits max abs error {acc['logit_max_abs_err']:.4f} "
              f"(logit range {acc['logit_range']:.2f}), same argmax: {acc['same_argmax']}; greedy tokens equal "
              f"for {acc['greedy_tokens_equal']} of {acc['greedy_tokens']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": out, "fp8_accuracy": acc}, f, indent=1)


if __name__ == "__main__":
    main()
