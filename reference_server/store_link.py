"""The router's side of the shared KV store: make it, attach every worker to it, re-attach them when a part of
the store was restarted, and keep the store counters of workers that are gone.

* **Attach.** Once the workers are up the router creates the store (``--kv-store``, ``--kv-store-gb``;
  :func:`reference_server.kv.backend.open_owner`) and sends each worker a ``store`` message naming it; a
  restarted worker gets it before it rejoins its pool, one joining from another host before it reports
  ready. A store is best effort, so a worker that cannot open it is not failed for it: it serves without
  a store (every lookup a miss), the failure is logged once, and the attach is tried again.
* **Re-attach.** Mooncake's master and memory owner are supervised (:mod:`reference_server.kv.mooncake_service`):
  each restart bumps the store's ``generation``. Every ``--heartbeat-interval`` this module sends the
  ``store`` message again to each worker whose handle is of an older generation (or that has none), so that
  every worker holds a handle on the store as it is now, within a heartbeat of its restart.
* **Counters.** Mooncake keeps no counters of its own: each worker's handle counts its calls. A worker that
  goes down takes them with it, so the supervisor hands its last counters (they come with every heartbeat
  answer) to :meth:`StoreLink.retire`, and ``/metrics`` adds those of every worker gone to those of the live
  ones: the server's counters never go back (a worker re-attaching carries its old handle's counters itself).
"""

from __future__ import annotations

import asyncio
from typing import Any

from reference_server.config import ServerConfig
from reference_server.kv.store import StoreStats
from reference_server.supervisor import Supervisor, WorkerHandle

COUNTERS = ("lookups", "hits", "put_blocks", "put_bytes", "get_blocks", "get_bytes", "corrupt", "duplicates",
            "errors", "timeouts")
ATTACH_TIMEOUT_S = 30.0


class StoreLink:
    def __init__(self, cfg: ServerConfig, sup: Supervisor) -> None:
        self.cfg = cfg
        self.sup = sup
        self.owner: Any = None                  # reference_server.kv.backend.StoreOwner, or None: no store
        self.retired: dict[str, int] = dict.fromkeys(COUNTERS, 0)   # counters of workers gone
        self._attaching: set[str] = set()
        self._failed: dict[str, str] = {}       # worker name -> why its last attach failed (logged once)
        self._task: asyncio.Task | None = None

    async def open(self) -> None:
        """Create the store and attach every worker (on the main thread: a Mooncake master and memory owner
        started here are tethered to it). With no local worker (all of them join) Mooncake still starts:
        the joining workers need its master; the built-in store, this host's shared memory, is not made."""
        from reference_server.kv.backend import open_owner

        workers = self.sup.workers
        self.owner = owner = open_owner(self.cfg, workers[0].info if workers else None)
        if owner is None:
            return
        self.sup.join_store = owner.join_msg()      # a joining worker starts its host's part of the store first
        self.sup.on_down.append(self.retire)
        await asyncio.gather(*(self.attach(h) for h in workers))
        self.sup.on_ready.append(self.attach)
        self._task = asyncio.create_task(self._watch())

    async def attach(self, h: WorkerHandle) -> None:
        """Send ``h`` the ``store`` message of the store's current generation; a failure is logged (once per
        cause) and retried by the watch, never raised: the worker serves without a store meanwhile."""
        owner = self.owner
        if await self.down():        # a part is down: the watch attaches it once the store is back
            return
        msg = owner.attach_msg()
        if h.joined:   # another host: the built-in store is this host's shared memory (no store there);
            if not h.info.get("store_client"):       # Mooncake: the memory owner that host started
                h.store_generation = msg.get("generation", 0)
                return
            msg["client"] = h.info["store_client"]
        self._attaching.add(h.name)
        try:
            r = await h.call({"op": "store", **msg}, timeout=ATTACH_TIMEOUT_S)
            error = r.get("error")
        except (asyncio.TimeoutError, ConnectionError, OSError) as exc:
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        finally:
            self._attaching.discard(h.name)
        if error:
            if self._failed.get(h.name) != error:
                print(f"reference_server: worker {h.name} could not open the {owner.backend} KV store ({error}); "
                      "it serves without it (every lookup a miss) and is attached again when the store answers",
                      flush=True)
            self._failed[h.name] = error
            return
        gen = msg.get("generation", 0)
        if h.name in self._failed or 0 <= h.store_generation != gen:
            print(f"reference_server: worker {h.name} attached to the {owner.backend} KV store again "
                  f"(store generation {gen})", flush=True)
            self._failed.pop(h.name, None)
        h.store_generation = gen

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_interval_s)
            gen = self.owner.generation
            if await self.down():          # nothing to attach to yet (a restart is under way, or given up)
                continue
            for h in self.sup.workers:
                if not h.dead and h.store_generation != gen and h.name not in self._attaching:
                    asyncio.ensure_future(self.attach(h))

    def retire(self, h: WorkerHandle) -> None:
        """``h`` went down: keep its last store counters in the server's total."""
        last = h.store_counts or {}
        for k in COUNTERS:
            self.retired[k] += int(last.get(k, 0))
        h.store_counts = None

    async def report(self, workers: list[dict[str, Any]]) -> StoreStats | None:
        """The store's counters for /metrics: the live workers' (their ``stats`` replies) and the retired ones
        (the master's gauges are read by its watch, off the loop)."""
        if self.owner is None:
            return None
        parts = [w["store"] for w in workers if w.get("store")]
        if parts:
            parts.append({**parts[0], **self.retired, "published": 0})
        return await asyncio.to_thread(self.owner.stats, parts)

    async def down(self) -> list[str]:
        return [] if self.owner is None else await asyncio.to_thread(self.owner.down)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.owner is not None:
            self.owner.close()
            self.owner = None
