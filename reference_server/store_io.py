"""What one worker does with the host's shared KV store (:mod:`reference_server.kv.store`).

* **Put** what it committed. When a sequence finishes, the engine thread takes the chain hashes of
  its committed blocks (prompt and generated tokens), asks the store which it lacks, copies only
  those out of the pool (into the store's own staging memory when it offers some: Mooncake's registered
  buffer, so the bytes are copied once before they move), and hands the copy to a putter thread, which
  checksums and publishes it.
  A prefill worker also puts the prompt blocks it has just copied out for the decode worker (no
  second copy). The sim engine's KV is virtual: nothing is copied, the store counts the blocks.
* **Onboard** before admission. A request that will be prefilled here goes through an onboarding
  thread first: after the worker's own prefix match, it reads the store's run of blocks from there
  (pinned, checksum-verified) and attaches it to the sequence; the scheduler installs it after its
  local allocation, so the prefill computes only what neither cache held. For the sim, the read
  waits the modeled wire time of the declared bytes (the device profile's network bandwidth).

The store is best effort on both paths: a put that fails is dropped, a get that fails is a miss, and every
call has a deadline (:mod:`reference_server.kv.guard`): a store that does not answer is a miss at once, on the
engine thread, the onboarding thread and the reader thread that answers the router's ``match`` and the
supervisor's heartbeat alike. Puts wait in a bounded queue (``PUT_QUEUE``; beyond it a put is dropped). When
the router sends a new ``store`` message (a part of the store was restarted) :meth:`StoreIO.replace` swaps
the handle: later calls use the new one; a put staged in the old one's memory is dropped, not moved.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from typing import Any, Callable

from reference_server.kv.guard import GuardedStore, release_staged
from reference_server.kv.transport.common import Link
from reference_server.scheduler import Seq, slice_blocks


PUT_QUEUE = 256     # puts waiting for the putter thread; more are dropped (the store is behind)


class StoreIO:
    def __init__(self, worker: Any, store: GuardedStore, link: Link | None) -> None:
        self.w = worker
        self.store = store
        self.link = link
        self._puts: queue.Queue = queue.Queue(PUT_QUEUE)
        self._onboards: queue.Queue = queue.Queue()
        threading.Thread(target=self._put_loop, daemon=True, name="kv-store-put").start()
        threading.Thread(target=self._onboard_loop, daemon=True, name="kv-store-onboard").start()

    # ---- put ------------------------------------------------------------------------------------

    def offer(self, seq: Seq) -> None:
        """Engine thread, after commit and before free: queue the committed blocks the store lacks."""
        hashes, ids = self.w.blocks.committed(seq.rid)
        if not hashes:
            return
        store = self.store
        if store.virtual:                   # nothing to copy: the putter skips what is present
            self._queue(store, hashes, self.w.engine.read_blocks(ids))
            return
        miss = store.missing(hashes)
        if miss:
            self._queue(store, [hashes[i] for i in miss], self._copy_out(store, [ids[i] for i in miss]))

    def _queue(self, store: GuardedStore, hashes: list[bytes], kv: Any) -> None:
        try:
            self._puts.put_nowait((store, hashes, kv))
        except queue.Full:                  # the putter is behind: this put is dropped (a later miss)
            release_staged(kv)

    def replace(self, store: GuardedStore) -> None:
        """A new handle on the store (re-attached): counters carried over, the old one closed."""
        old = self.store
        store.carry_from(old)
        self.store = store
        old.close()

    def _copy_out(self, store: GuardedStore, ids: list[int]) -> Any:
        """The blocks' KV out of the pool before it frees them: gathered straight into the store's staging
        memory when the store offers it (Mooncake: one copy before the move, not two), else a new array."""
        staged = store.stage(len(ids))
        if staged is None:
            return self.w.engine.read_blocks(ids)
        try:
            self.w.engine.read_blocks_into(ids, staged.kv)
        except BaseException:
            staged.release()
            raise
        return staged

    def offer_copy(self, hashes: list[bytes], kv: Any) -> None:
        """Blocks already copied out of the pool (a prefill worker's transfer): put them as they are."""
        if hashes:
            self._queue(self.store, hashes, slice_blocks(kv, 0, len(hashes)))

    def _put_loop(self) -> None:
        while True:
            store, hashes, kv = self._puts.get()
            if store is not self.store and hasattr(kv, "release"):
                release_staged(kv)          # staged in the memory of a handle since replaced: dropped
                continue
            try:
                self.store.put(hashes, kv)
            except Exception:  # noqa: BLE001 - best effort: a failed put is a later miss, never an error
                traceback.print_exc()

    # ---- onboard --------------------------------------------------------------------------------

    def onboard(self, seq: Seq, then: Callable[[], None]) -> None:
        """Reader thread: fetch the store's blocks for ``seq`` off the engine thread, then run ``then``
        (which hands the sequence to the engine loop)."""
        self._onboards.put((seq, then))

    def _onboard_loop(self) -> None:
        while True:
            seq, then = self._onboards.get()
            if seq.rid not in self.w.owner:   # aborted before its turn: nothing to read
                continue
            try:
                self._fetch(seq)
            except Exception:  # noqa: BLE001 - a failed read is a miss: the prefill computes the blocks
                traceback.print_exc()
                seq.store_kv = None
            if seq.rid in self.w.owner:       # not aborted meanwhile
                self.w.inbox.put(then)

    def _fetch(self, seq: Seq) -> None:
        t0 = time.perf_counter()
        bm = self.w.blocks
        local, hashes = bm.lookup(seq.tenant, seq.prompt)
        local //= bm.block_size
        if local >= len(hashes):
            return
        n, kv = self.store.get_run(hashes, local)
        if n:
            if self.link is not None:
                self.link.wait(kv.nbytes, t0)
            seq.store_kv = (kv, local)
        seq.onboard_s = time.perf_counter() - t0
