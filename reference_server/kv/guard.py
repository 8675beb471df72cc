"""A worker's KV store behind deadlines: a store that stops answering is a miss, never a stall.

Why: a store call can block for seconds in native code when a part of the store dies (Mooncake: the
memory owner's RPC to a killed master held ``batch_is_exist`` 4.3 s here before it failed). A worker calls
the store from its control connection's reader thread (the ``match`` a routing decision waits for, on the
same thread that answers the supervisor's heartbeat), from the engine thread (which blocks a put's copy
out) and from its onboarding thread (which every prefilled request passes through). Called there
directly, one such call made a worker miss its heartbeat and be restarted (issue 30: all four workers of a
2P + 2D server when the master was killed, 190 of 250 requests failed).

So every call goes through :class:`GuardedStore`:

* it runs on a store-call thread and the caller waits at most ``timeout_s`` (``--kv-store-timeout``);
  past it the caller gets a miss (0 blocks found, nothing put, nothing missing to put), counted in
  ``timeouts``;
* while a call that ran past its deadline has not returned, the store is *not answering*: every call is a
  miss at once, without being tried (so threads never pile up behind a hung call), counted too;
* a store that answers with a failure (Mooncake's error codes: ``errors``) or raises is a miss as well;
* each outage is logged once, with its cause, when it starts, and once when the store answers again (a call
  that succeeds ``QUIET_S`` after the last failure: a store whose puts fail while its lookups answer, as on a
  memory owner restarted under an old handle, is one outage, not one per call).

The handle also carries a worker's counters across the store handles it has had (a re-attach after the
store's master or memory owner was restarted opens a new one, whose own counters start at 0).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import fields, replace
from typing import Any, Callable, Sequence, TypeVar

from reference_server.kv.backend import BlockStore
from reference_server.kv.store import StoreStats

T = TypeVar("T")
CALL_THREADS = 3            # a query, a put and an onboarding read can run at once
QUIET_S = 2.0               # an outage ends at a call that succeeds this long after the last failure
CLOSE_WAIT_S = 60.0         # a replaced handle is closed once its calls returned, or left open after this
COUNTED = tuple(f.name for f in fields(StoreStats) if f.name not in ("capacity_blocks", "block_nbytes", "published"))


class GuardedStore:
    """``store`` (a :class:`~reference_server.kv.backend.BlockStore`) with a deadline on every call; the same
    interface. ``name`` and ``log`` say who logs an outage (the worker's name; ``print`` to its stderr)."""

    def __init__(self, store: BlockStore, timeout_s: float, name: str,
                 log: Callable[[str], None] | None = None) -> None:
        self.store = store
        self.virtual = store.virtual
        self.block_nbytes = store.block_nbytes
        self.timeout_s = timeout_s
        self.name = name
        self._log = log or (lambda line: print(line, flush=True))
        self._pool = ThreadPoolExecutor(CALL_THREADS, thread_name_prefix="kv-store-call")
        self._lock = threading.Lock()
        self._hung: set[Future] = set()     # calls past their deadline that have not returned
        self._outage: str | None = None     # why the store is not answering, while it is not
        self._since = 0.0
        self._missed = 0                    # calls that were misses during this outage
        self._inflight = 0                  # calls submitted and not returned (or cancelled)
        self._last_failure = 0.0
        self.timeouts = 0
        self.base: dict[str, int] = {}      # counters of the handles this worker had before this one
        self.closed = False

    # ---- the BlockStore interface ---------------------------------------------------------------

    def run_length(self, hashes: Sequence[bytes], start: int = 0) -> int:
        return self._call("lookup", lambda: self.store.run_length(hashes, start), 0)

    def missing(self, hashes: Sequence[bytes]) -> list[int]:
        return self._call("lookup", lambda: self.store.missing(hashes), [])

    def stage(self, n: int) -> Any:
        return None if self._outage else self.store.stage(n)    # local memory, never waits

    def put(self, hashes: Sequence[bytes], kv: Any) -> int:
        return self._call("put", lambda: self.store.put(hashes, kv), 0, release=kv)

    def get_run(self, hashes: Sequence[bytes], start: int = 0) -> tuple[int, Any]:
        return self._call("read", lambda: self.store.get_run(hashes, start), (0, None))

    def stats(self) -> StoreStats:
        st = self.store.stats()
        add = {k: getattr(st, k) + self.base.get(k, 0) for k in COUNTED}
        add["timeouts"] += self.timeouts
        return replace(st, **add)

    def close(self) -> None:
        """Close the store off the caller's thread, once no call is running in it: closing a Mooncake handle
        while a call of it runs crashed the worker (SIGSEGV). A call that never returns leaves it open."""
        with self._lock:
            self.closed = True

        def close_when_idle() -> None:
            deadline = time.monotonic() + CLOSE_WAIT_S
            while self._inflight and time.monotonic() < deadline:
                time.sleep(0.05)
            if self._inflight:
                self._log(f"reference_server: worker {self.name}: an old KV store handle is left open ({self._inflight} "
                          f"calls still running after {CLOSE_WAIT_S:g} s)")
                return
            self._pool.shutdown(wait=False)
            self.store.close()

        threading.Thread(target=close_when_idle, daemon=True, name="kv-store-close").start()

    # ---- a new handle on the same store ---------------------------------------------------------

    def carry_from(self, old: "GuardedStore") -> None:
        """Take over ``old``'s counters (this worker's, from the handle this one replaces)."""
        st = old.stats()
        self.base = {k: getattr(st, k) for k in COUNTED}

    @property
    def answering(self) -> bool:
        return self._outage is None

    # ---- internals ------------------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[[], T], miss: T, release: Any = None) -> T:
        with self._lock:
            if self._hung or self.closed:
                self._missed += 1
                self.timeouts += 1
                release_staged(release)         # staged memory goes back: this put is dropped
                return miss
            self._inflight += 1
            fut = self._pool.submit(fn)
        fut.add_done_callback(self._done)
        try:
            out = fut.result(self.timeout_s)
        except FutureTimeout:
            cancelled = fut.cancel()            # queued behind a hung call: never run
            with self._lock:
                self.timeouts += 1
                self._start_outage(f"a {what} did not answer within {self.timeout_s:g} s (--kv-store-timeout)")
                if not cancelled:               # running: the store is not answering until it returns
                    self._hung.add(fut)
            if not cancelled:
                fut.add_done_callback(self._returned)    # (at once, outside the lock, if it just returned)
            else:
                release_staged(release)
            return miss
        except Exception as exc:  # noqa: BLE001 - the store's own failure is a miss, never the request's
            with self._lock:
                self._start_outage(f"a {what} failed: {type(exc).__name__}: {exc}")
                self._missed += 1
            return miss
        failing = getattr(self.store, "failing", None)       # Mooncake: the last call's error, None when fine
        with self._lock:
            if failing:
                self._start_outage(failing)
                self._missed += 1
            elif (self._outage is not None and not self._hung
                  and time.monotonic() - self._last_failure >= QUIET_S):
                self._end_outage()
        return out

    def _returned(self, fut: Future) -> None:
        with self._lock:
            self._hung.discard(fut)

    def _done(self, fut: Future) -> None:
        with self._lock:
            self._inflight -= 1

    def _start_outage(self, cause: str) -> None:
        self._last_failure = time.monotonic()
        if self._outage is None:
            self._outage, self._since, self._missed = cause, time.monotonic(), 0
            self._log(f"reference_server: worker {self.name}: the KV store is not answering ({cause}); "
                      "every store call is a miss (recomputed) until it answers again")

    def _end_outage(self) -> None:
        self._log(f"reference_server: worker {self.name}: the KV store answers again after "
                  f"{time.monotonic() - self._since:.1f} s ({self._missed} store calls were misses)")
        self._outage = None


def release_staged(kv: Any) -> None:
    """Give back the store memory a put was staged in (``BlockStore.stage``); a plain array or virtual KV (or
    None) holds none."""
    if hasattr(kv, "release") and not isinstance(kv, memoryview):
        kv.release()
