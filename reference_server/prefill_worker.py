"""Prefill-pool role: run the uncached part of a prompt, then hand its KV and first token to a decode
worker.

The engine thread prefills (chunked, with this worker's own prefix cache), copies the blocks the
decode worker lacks out of the pool (``read_blocks``), releases the sequence (its blocks stay in the
prefix cache) and queues the copy. A sender thread encodes and writes it through the KV transport
(shared memory by default), then tells the decode worker over an authenticated control connection
(request id, first token, transport reference) and reports its timings to the router. Sending off
the engine thread lets the next prefill start while the bytes move, as on real hardware. The same
copy's full blocks then go to the host's KV store (:mod:`reference_server.store_io`), so another
prefill worker can onboard them; blocks found in that store were installed before the prefill.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

from reference_server.ipc import Peers
from reference_server.kv.codec import TransferMeta
from reference_server.kv.transport.shm import ShmSender
from reference_server.kv.transport.tcp import KVSender
from reference_server.scheduler import Seq


class PrefillRole:
    def __init__(self, worker: Any) -> None:
        self.w = worker
        self.cfg = worker.cfg
        self.jobs: dict[str, dict[str, Any]] = {}
        self.outbox: queue.Queue = queue.Queue()
        # KV copied out and not yet handed over (queued for, or in, the sender thread), and which of
        # those were aborted meanwhile: the sender skips them (or finishes the one on the wire, which
        # the decode worker then discards unread).
        self._lock = threading.Lock()
        self.shipping: set[str] = set()
        self.cancelled: set[str] = set()
        self.sender = ShmSender()
        self.tcp_senders: dict[tuple[str, int], KVSender] = {}
        self.peers = Peers(worker.spec.internal_token)
        self.transfers = 0
        threading.Thread(target=self._send_loop, daemon=True, name="kv-sender").start()

    def address(self) -> dict[str, Any]:
        return {}

    def _tcp(self, dest: dict[str, Any]) -> KVSender:
        key = (dest["host"], int(dest["kv_port"]))
        sender = self.tcp_senders.get(key)
        if sender is None:
            sender = self.tcp_senders[key] = KVSender(*key, token=self.w.spec.internal_token)
        return sender

    def accept(self, seq: Seq, msg: dict[str, Any]) -> None:
        self.jobs[seq.rid] = {"kv_from": int(msg.get("kv_from", 0)), "dest": msg["dest"], "fault": msg.get("fault"),
                              "fault_seconds": float(msg.get("fault_seconds", 0.0))}
        self.w.sched.add(seq)

    def abort(self, rid: str) -> str | None:
        """Engine thread. Returns ``transfer`` if its KV was already copied out (the scheduler no longer
        holds it); a request still queued or prefilling is the scheduler's to drop."""
        self.jobs.pop(rid, None)
        with self._lock:
            if rid in self.shipping:
                self.cancelled.add(rid)
                return "transfer"
        return None

    def waiting(self) -> int:
        """Requests whose KV was copied out and has not left yet."""
        with self._lock:
            return len(self.shipping)

    def close(self) -> None:
        """Unlink the shared-memory segments this worker created (a clean stop leaves none behind)."""
        self.sender.close()
        for sender in self.tcp_senders.values():
            sender.close()

    def extra_timings(self, seq: Seq) -> dict[str, Any]:
        return {}

    def forget(self, rid: str) -> None:
        """Engine thread: ``rid`` failed in the scheduler; its job (where to ship its KV) goes with it."""
        self.jobs.pop(rid, None)

    def ship(self, seq: Seq) -> None:
        """Engine thread: copy out the blocks the decode worker lacks, then free the sequence."""
        job = self.jobs.pop(seq.rid, None)
        if job is None:           # aborted meanwhile
            self.w.sched.release(seq)
            return
        bs = self.w.blocks.block_size
        t0 = time.perf_counter()
        start = job["kv_from"] // bs
        end = -(-len(seq.prompt) // bs)
        job["store"] = self.w.blocks.committed(seq.rid)[0][start:] if self.w.store_io is not None else []
        label = start
        if job["fault"] == "kv_range":   # injected (reference_server.faults): a range decode did not ask for
            end, label = (end - 1, start) if end - start > 1 else (end, start + 1)
            job["store"] = []
        kv = self.w.engine.read_blocks(seq.block_table[start:end])
        read_s = time.perf_counter() - t0
        self.w.sched.release(seq)
        meta = TransferMeta.for_shape(seq.rid, self.w.engine.shape, block_size=bs, n_blocks=end - start,
                                      num_tokens=min(len(seq.prompt), end * bs) - start * bs, start_block=label,
                                      dtype="fp8_e4m3" if self.cfg.kv_fp8 else None)
        with self._lock:
            self.shipping.add(seq.rid)
        self.outbox.put((seq, job, meta, kv, read_s))

    def _cancelled(self, rid: str) -> bool:
        with self._lock:
            return rid in self.cancelled

    def _send_loop(self) -> None:
        while True:
            seq, job, meta, kv, read_s = self.outbox.get()
            try:
                if not self._cancelled(seq.rid):     # aborted while queued here: nothing goes on the wire
                    self._send(seq, job, meta, kv, read_s)
            except Exception as exc:  # noqa: BLE001 - the router falls back to a local prefill
                self.w.send(seq.rid, {"op": "error", "rid": seq.rid, "error": f"KV send failed: {exc}"})
            finally:
                with self._lock:
                    self.shipping.discard(seq.rid)
                    self.cancelled.discard(seq.rid)
            self.w.owner.pop(seq.rid, None)

    def _send(self, seq: Seq, job: dict[str, Any], meta: TransferMeta, kv: Any, read_s: float) -> None:
        self.transfers += 1
        every = self.cfg.debug_corrupt_kv_every
        corrupt = job["fault"] == "kv_corrupt" or bool(every and self.transfers % every == 0)
        flip = self.transfers * 7919 if corrupt else None
        dest = job["dest"]
        note = {"op": "kv", "rid": seq.rid, "first": seq.output[0], "kv_from": job["kv_from"]}
        t = seq.timings()
        if self.cfg.kv_transport == "tcp":
            st = self._tcp(dest).send(meta, kv, flip_byte=flip)     # returns once the receiver verified it
            # kv_write: copy out of the pool; kv_transfer: encode + wire + verify, as the sender saw it
            t.update({"kv_write_ms": 1e3 * read_s, "kv_transfer_ms": 1e3 * st.elapsed_s})
        else:
            ref, st = self.sender.send(meta, kv, flip_byte=flip)
            note["shm"] = ref.to_dict()
            # kv_write: copy out of the pool + encode into the segment; the decode side times the rest
            t["kv_write_ms"] = 1e3 * (read_s + st.elapsed_s)
        if job["fault"] == "kv_delay":   # injected: the KV is held in flight (a slow link)
            time.sleep(job["fault_seconds"])
        if "shm" in note and self._cancelled(seq.rid):
            self.sender.discard(ref)       # aborted in flight: free the segment, announce nothing
            self.w.counters["kv_discarded"] += 1
            return
        # (TCP: the bytes already sit in the decode worker's mailbox; announced, it takes them out)
        self.peers.get(dest["host"], dest["port"]).send(note)
        t["kv_write_ms"] += 1e3 * seq.kv_write_s       # + installing blocks onboarded from the store
        t.update({"transfer_bytes": st.payload_bytes, "cached_tokens": seq.cached})
        self.w.send(seq.rid, {"op": "prefilled", "rid": seq.rid, "timings": t})
        if job["store"]:     # the same copy feeds the host's store: other prefill workers reuse it
            self.w.store_io.offer_copy(job["store"], kv)
