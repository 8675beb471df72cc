"""Decode-pool role: accept remote-prefilled requests and install their KV.

A ``generate(remote)`` request waits here until its KV arrives from a prefill worker (a ``kv``
control message naming a shared-memory segment — or, with ``--kv-transport tcp``, announcing bytes
already verified by this worker's TCP receiver — plus the first token). A receiver thread maps and
verifies the segment (checksums, model, shape and dtype: :mod:`reference_server.kv.codec`); the
engine thread installs the KV when it admits the request. Any integrity failure — or a prefill
worker that reports an error — turns the request into a local prefill on this worker: slower,
never wrong, and counted (``kv_checksum_failures``).

The sim engine's ``VirtualKV`` carries no bytes; the receiver waits the modeled wire time of the
declared byte count on a link sized from the device profile's interconnect.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

from reference_server.kv.transport.common import Received, sim_link
from reference_server.kv.transport.shm import ShmRef, shm_receive, shm_release
from reference_server.kv.transport.tcp import KVReceiver
from reference_server.scheduler import Seq

STALE_S = 120.0


class DecodeRole:
    def __init__(self, worker: Any) -> None:
        self.w = worker
        self.pending: dict[str, dict[str, Any]] = {}   # rid -> {"seq", "rec", "first", "kv_from", "t"}
        self.info: dict[str, dict[str, Any]] = {}      # rid -> extra timings for the final report
        self.aborted: dict[str, float] = {}            # rid -> abort time
        self.incoming: queue.Queue = queue.Queue()
        self.link = sim_link(worker.cfg, worker.engine)
        self.tcp: KVReceiver | None = None
        if worker.cfg.kv_transport == "tcp":
            self.tcp = KVReceiver(worker.engine.shape, block_size=worker.blocks.block_size, host=worker.spec.host,
                                  token=worker.spec.internal_token, link=self.link).start()
        threading.Thread(target=self._recv_loop, daemon=True, name="kv-receiver").start()

    def address(self) -> dict[str, Any]:
        # KV announcements arrive on the control port; TCP KV bytes on their own authenticated port.
        return {"kv_port": self.tcp.address[1]} if self.tcp is not None else {}

    def waiting(self) -> int:
        return len(self.pending)

    # ---- reader thread: a prefill worker announced KV ------------------------------------------

    def on_kv(self, msg: dict[str, Any]) -> None:
        self.incoming.put(msg)

    def _recv_loop(self) -> None:
        eng, bs = self.w.engine, self.w.blocks.block_size
        while True:
            msg = self.incoming.get()
            if msg["rid"] in self.aborted:    # its request was aborted: free the transfer unread
                self._discard(msg)
                continue
            try:
                if "shm" in msg:
                    rec = shm_receive(ShmRef.from_dict(msg["shm"]), expect=eng.shape, block_size=bs, link=self.link)
                else:   # TCP: the sender announces only after our receiver verified (and acked) the bytes
                    rec = self.tcp.wait(msg["rid"], timeout=60.0)  # type: ignore[union-attr]
            except Exception as exc:  # noqa: BLE001 - lost or unreadable transfer: prefill locally
                # (and keep this thread alive: if it died, every later remote request would wait forever)
                rid, err = msg["rid"], f"KV never arrived: {type(exc).__name__}: {exc}"
                self.w.inbox.put(lambda rid=rid, err=err: self.failed(rid, err))
                continue
            self.w.counters["kv_transfers"] += 1
            self.w.counters["kv_bytes"] += rec.stats.payload_bytes
            if not rec.ok:
                self.w.counters["kv_checksum_failures"] += 1
            rid = msg["rid"]
            self.w.inbox.put(lambda rid=rid, rec=rec, msg=msg: self._arrived(rid, rec, msg))

    def _discard(self, msg: dict[str, Any]) -> None:
        try:
            if "shm" in msg:
                shm_release(ShmRef.from_dict(msg["shm"]))
            else:              # TCP: the bytes already sit in the receiver's mailbox; take them out
                self.tcp.wait(msg["rid"], timeout=60.0)  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 - nothing left to free
            pass
        self.w.counters["kv_discarded"] += 1

    # ---- engine thread --------------------------------------------------------------------------

    def expect(self, seq: Seq, msg: dict[str, Any]) -> None:
        self._entry(seq.rid)["seq"] = seq
        self._maybe_start(seq.rid)

    def _arrived(self, rid: str, rec: Received, msg: dict[str, Any]) -> None:
        if self.aborted.pop(rid, None) is not None:
            return
        e = self._entry(rid)
        e.update(rec=rec, first=int(msg["first"]), kv_from=int(msg["kv_from"]))
        self._maybe_start(rid)

    def failed(self, rid: str, error: str) -> None:
        """The prefill worker could not deliver: prefill locally."""
        if rid in self.aborted:
            return
        e = self._entry(rid)
        e["error"] = error
        self._maybe_start(rid)

    def abort(self, rid: str) -> str | None:
        """Engine thread. Returns ``awaiting_kv`` if the request was waiting here for its KV (the
        scheduler does not hold it yet). Its KV may still be on the way: it is freed unread on arrival."""
        e = self.pending.pop(rid, None)
        self.info.pop(rid, None)
        self.aborted[rid] = time.monotonic()
        return "awaiting_kv" if e is not None and "seq" in e else None

    def close(self) -> None:
        if self.tcp is not None:
            self.tcp.close()

    def _entry(self, rid: str) -> dict[str, Any]:
        now = time.monotonic()
        for old in [r for r, e in self.pending.items() if "seq" not in e and now - e["t"] > STALE_S]:
            del self.pending[old]      # KV for a request that was aborted before it got here
        for old in [r for r, t in self.aborted.items() if now - t > STALE_S]:
            del self.aborted[old]
        return self.pending.setdefault(rid, {"t": now})

    def _maybe_start(self, rid: str) -> None:
        e = self.pending.get(rid)
        if e is None or "seq" not in e or ("rec" not in e and "error" not in e):
            return
        del self.pending[rid]
        seq: Seq = e["seq"]
        rec: Received | None = e.get("rec")
        info: dict[str, Any] = {"kv_recomputed": False}
        bs = self.w.blocks.block_size
        if rec is not None and rec.ok and rec.meta is not None and rec.meta.start_block * bs != e["kv_from"]:
            # KV for other positions than the ones this request expects: never install it
            info["kv_recomputed"], info["kv_error"] = True, "range"
        elif rec is not None and rec.ok:
            seq.remote_kv = (rec.kv, e["kv_from"], e["first"])
            info["kv_transfer_ms"] = 1e3 * rec.stats.elapsed_s   # map + verify + copy out (+ modeled wire)
            if self.link is not None:
                info["kv_transfer_modeled_ms"] = 1e3 * rec.stats.modeled_s / self.w.cfg.sim_time_scale
        else:
            info["kv_recomputed"] = True
            info["kv_error"] = rec.stats.error if rec is not None else e.get("error")
        self.info[rid] = info
        self.w.sched.add(seq)

    def forget(self, rid: str) -> None:
        """Engine thread: ``rid`` failed in the scheduler (a prompt that never fits, an engine error); the timings
        its admission kept for the final report are dropped (before, each such request left them for good)."""
        self.info.pop(rid, None)

    def extra_timings(self, seq: Seq) -> dict[str, Any]:
        info = self.info.pop(seq.rid, {})
        if seq.remote_gap:   # the KV arrived intact but could not be installed here: we prefilled it
            info.update(kv_recomputed=True, kv_error=seq.remote_gap)
        return info
