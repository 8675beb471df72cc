"""One worker process: engine + prefix cache + scheduler, driven by control messages from the router.

Threads: the main thread runs the engine loop (steps block: real compute or the sim's modeled
sleep); one reader thread per control connection turns frames into inbox items; role helpers
(:mod:`prefill_worker`, :mod:`decode_worker`) add a KV sender or receiver thread. The inbox is the
only way into the engine loop, so the scheduler and the block manager are touched by one thread.

Control messages in: ``generate`` (decode / mixed), ``prefill`` (prefill pool), ``match`` (prefix-hit
query for the routing rule), ``stats`` (for /metrics), ``abort``, ``ping`` (the supervisor's heartbeat,
answered by the reader thread). Events out, on the connection
that sent the request: ``tokens``, ``done``, ``prefilled``, ``error``.
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import asdict
from typing import Any, Callable

from paas_common.lifetime import Tether, die_with_parent
from reference_server.config import WorkerSpec
from reference_server.ipc import Conn, blob_tokens, serve_blocking
from reference_server.kv.transport.common import sim_link
from reference_server.routing import PrefillEstimator
from reference_server.scheduler import Policy, Scheduler, Seq


SHM_BYTES_PER_S = 1.4e9     # KV over shared memory end to end, 128 MiB, this machine (docs/kv.md figures)


def build_engine(spec: WorkerSpec):
    """Engine and block manager sized from the KV budget (``--kv-budget-mb``)."""
    from reference_server.engine import create_engine
    from reference_server.kv.block_manager import BlockManager, blocks_for_budget

    cfg = spec.config
    if cfg.engine == "cpu":   # a real model: its pool is sized by the engine (budget, or the device's free memory)
        from reference_server.devices import worker_device

        engine = create_engine("cpu", block_size=cfg.block_size, num_blocks=None, model=cfg.model,
                               backend=cfg.backend, device=worker_device(cfg, spec.role, spec.slot), seed=cfg.seed,
                               dtype=cfg.dtype, kv_dtype=cfg.kv_dtype, gpu_memory_utilization=cfg.gpu_memory_utilization,
                               kv_budget_bytes=None if cfg.kv_budget_mb is None else int(cfg.kv_budget_mb * 2**20),
                               step_slowdown=cfg.debug_step_slowdown)
        namespace = f"{engine.shape.name}@{engine.shape.version}/bs{cfg.block_size}"
        return engine, BlockManager(engine.num_blocks, cfg.block_size, namespace, cfg.block_hash,
                                    reuse_shortfall=cfg.debug_reuse_shortfall)
    kw: dict[str, Any] = dict(block_size=cfg.block_size, model=cfg.model, backend=cfg.backend, device=cfg.device,
                              model_profile=cfg.model_profile, device_profile=cfg.device_profile, seed=cfg.seed,
                              step_slowdown=cfg.debug_step_slowdown)
    if cfg.engine == "sim":
        from reference_server.hardware import role_profiles

        kw["model_profile"], kw["device_profile"], cards = role_profiles(cfg, spec.role)
        kw.update(time_scale=cfg.sim_time_scale, cards=cards)
    probe = create_engine(cfg.engine, num_blocks=1, **kw)
    if cfg.kv_budget_mb is None and cfg.engine == "sim":
        # VirtualKV allocates nothing: size the pool like the modeled instance's (HBM left after weights).
        from reference_server.sim.roofline import kv_capacity_tokens

        num_blocks = kv_capacity_tokens(probe.model, probe.device, probe.tp) // cfg.block_size  # type: ignore[attr-defined]
    else:
        budget = 256.0 if cfg.kv_budget_mb is None else cfg.kv_budget_mb
        num_blocks = blocks_for_budget(int(budget * 2**20), probe.shape, cfg.block_size)
    num_blocks = max(2, num_blocks)
    engine = create_engine(cfg.engine, num_blocks=num_blocks, **kw)
    namespace = f"{engine.shape.name}@{engine.shape.version}/bs{cfg.block_size}"
    return engine, BlockManager(num_blocks, cfg.block_size, namespace, cfg.block_hash,
                                reuse_shortfall=cfg.debug_reuse_shortfall)


def chunk_tokens_for(spec: WorkerSpec, engine: Any) -> int:
    """Prefill tokens per step: prefill-only workers run compute-bound chunks (:func:`hardware.prefill_chunk`)."""
    if spec.role != "prefill":
        return spec.config.prefill_chunk_tokens
    from reference_server.hardware import prefill_chunk

    if spec.config.engine != "sim":
        return prefill_chunk(spec.config)
    return prefill_chunk(spec.config, engine.model, engine.device, engine.tp)


def policy_for(spec: WorkerSpec) -> Policy:
    if spec.role == "prefill":
        return "prefill"
    if spec.role == "mixed" and spec.config.mode == "colocated":
        return "colocated"
    return "chunked"


class BusyClock:
    """Busy-time fraction over a sliding window (pool utilization), plus the lifetime total.

    Spans that ended before the window are dropped as new ones come, not only when the fraction is read: a decode
    worker adds a span per engine step, and one that nobody asked for /metrics kept every span it ever added (a
    30-minute soak read /health only: the decode worker's private RSS grew 141 -> 156 MiB, prefill's stayed flat;
    tracemalloc named ``_spans.append``)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.total_s = 0.0
        self._spans: deque[tuple[float, float]] = deque()
        self._lock = threading.Lock()
        self.t_start = time.monotonic()

    def add(self, t0: float, t1: float) -> None:
        with self._lock:
            self.total_s += t1 - t0
            self._spans.append((t0, t1))
            self._drop_before(t1 - self.window_s)

    def _drop_before(self, lo: float) -> None:
        while self._spans and self._spans[0][1] < lo:
            self._spans.popleft()

    def utilization(self) -> float:
        now = time.monotonic()
        lo = max(now - self.window_s, self.t_start)
        with self._lock:
            self._drop_before(lo)
            busy = sum(min(b, now) - max(a, lo) for a, b in self._spans if b > lo)
        return busy / max(1e-9, now - lo)


class Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        from reference_server.engine.vocab import eos_id, get_vocab

        self.spec = spec
        self.cfg = spec.config
        self.engine, self.blocks = build_engine(spec)
        self.sched = Scheduler(self.engine, self.blocks, policy=policy_for(spec),
                               chunk_tokens=chunk_tokens_for(spec, self.engine), max_num_seqs=self.cfg.max_num_seqs,
                               eos_token_id=get_vocab(self.cfg.model).eos_ids if self.cfg.engine == "cpu" else eos_id())
        self.inbox: queue.Queue[Callable[[], None]] = queue.Queue()
        self.owner: dict[str, Conn] = {}
        self.pending_out: dict[str, list[int]] = {}     # tokens held back to fill a multi-token chunk
        self.clock = BusyClock(self.cfg.util_window_s)
        # Routing estimates are in real seconds: the sim's modeled ones times sim_time_scale (unscaled at
        # 0, where nothing sleeps); KV bandwidth between workers and from the store is the sim's network
        # link, else the same-host shared-memory rate measured in docs/kv.md.
        scale = self.cfg.sim_time_scale if self.cfg.engine == "sim" and self.cfg.sim_time_scale > 0 else 1.0
        self.wire_bytes_per_s = SHM_BYTES_PER_S
        if self.cfg.engine == "sim":
            dev = self.engine.device
            self.wire_bytes_per_s = (dev.network_gbps or dev.interconnect_gbps) * 1e9 / scale
        self.estimator = PrefillEstimator(self.engine, self.sched.chunk_tokens, scale)
        self.counters: dict[str, float] = {"kv_checksum_failures": 0, "kv_recomputes": 0,
                                           "kv_transfers": 0, "kv_bytes": 0, "kv_discarded": 0}
        self.aborted: dict[str, int] = {}  # requests aborted here, by the stage they were in
        self.role_helper: Any = None
        self.store_io: Any = None          # StoreIO once the router hands over the host's KV store
        self.store_msg: dict[str, Any] | None = None
        self._store_lock = threading.Lock()

    def attach_store(self, msg: dict[str, Any]) -> None:
        """Open the store ``msg`` names (the router's ``store`` message) behind its deadlines; a second one (the
        store's master or memory owner was restarted) replaces the handle, its counters carried over."""
        from reference_server.kv.backend import open_store
        from reference_server.kv.guard import GuardedStore
        from reference_server.store_io import StoreIO

        with self._store_lock:            # one open at a time: the router's and a joined host's own
            store = GuardedStore(open_store(msg, self.engine.shape, self.blocks.block_size),
                                 self.cfg.kv_store_timeout_s, self.spec.name)
            self.store_msg = msg
            if self.store_io is None:
                self.store_io = StoreIO(self, store, sim_link(self.cfg, self.engine))
            else:
                self.store_io.replace(store)

    def reattach_store(self) -> None:
        """Open the store named last again (a joined host restarted its own memory owner)."""
        if self.store_msg is not None:
            self.attach_store(self.store_msg)

    def _open_store(self, conn: Conn, msg: dict[str, Any]) -> None:
        try:
            self.attach_store(msg)
        except Exception as exc:  # noqa: BLE001 - the router reports it (a store it cannot reach)
            conn.send({"op": "reply", "id": msg["id"], "error": f"{type(exc).__name__}: {exc}"})
            return
        conn.send({"op": "reply", "id": msg["id"]})

    def store_counts(self) -> dict[str, Any] | None:
        """This worker's store counters (every handle it had), or None without a store."""
        return asdict(self.store_io.store.stats()) if self.store_io is not None else None

    # ---- control plane (reader threads) --------------------------------------------------------

    def on_message(self, conn: Conn, msg: dict[str, Any], blob: bytes) -> None:
        op = msg.get("op")
        if op == "ping":                 # the supervisor's heartbeat: answered here, off the engine loop; it
            # carries the store counters, which the router keeps when this worker goes down
            conn.send({"op": "reply", "id": msg["id"], "store": self.store_counts()})
        elif op == "match":
            conn.send({"op": "reply", "id": msg["id"], **self.offer(msg["tenant"], blob_tokens(blob))})
        elif op == "store":              # the router created the shared KV store: open it, off this thread
            # (opening Mooncake takes seconds on a busy host; heartbeats are answered on this thread meanwhile)
            threading.Thread(target=self._open_store, args=(conn, msg), daemon=True, name="store-open").start()
        elif op == "stats":
            conn.send({"op": "reply", "id": msg["id"], "stats": self.stats()})
        elif op in ("generate", "prefill"):
            seq = Seq(rid=msg["rid"], tenant=msg["tenant"], prompt=blob_tokens(blob),
                      max_tokens=int(msg.get("max_tokens", 16)), ignore_eos=bool(msg.get("ignore_eos", False)),
                      prefill_only=(op == "prefill"))
            self.owner[seq.rid] = conn
            if msg.get("remote"):          # its KV comes from a prefill worker
                self.inbox.put(lambda: self.role_helper.expect(seq, msg))
                return
            hand = (lambda: self.role_helper.accept(seq, msg)) if op == "prefill" else (lambda: self.sched.add(seq))

            def admit() -> None:            # engine thread; an abort that came first leaves nothing to admit
                if seq.rid in self.owner:
                    hand()
            # prefilled here: onboard the store's blocks first, unless the router's match found none
            if self.store_io is not None and msg.get("onboard", True):
                self.store_io.onboard(seq, admit)
            else:
                self.inbox.put(admit)
        elif op == "kv":                 # a prefill worker announces a request's KV (decode role)
            self.role_helper.on_kv(msg)
        elif op == "kv_failed":          # the router: that prefill worker failed, prefill locally
            rid, err = msg["rid"], str(msg.get("error"))
            self.inbox.put(lambda: self.role_helper.failed(rid, err))
        elif op == "abort":
            rid = msg["rid"]
            self.inbox.put(lambda: self._abort(rid))

    def offer(self, tenant: str, prompt: list[int]) -> dict[str, Any]:
        """What prefilling ``prompt`` here would cost (reader thread; :mod:`reference_server.routing`):
        its local prefix hit, the store's run right after it, and the estimated seconds of the rest."""
        bs = self.blocks.block_size
        store_hit, onboard_s = 0, 0.0
        if self.store_io is None:
            hit = self.blocks.match_prefix(tenant, prompt)
        else:
            hit, hashes = self.blocks.lookup(tenant, prompt)
            store_hit = self.store_io.store.run_length(hashes, hit // bs) * bs
            onboard_s = store_hit * self.engine.shape.kv_bytes_per_token() / self.wire_bytes_per_s
        running = sum(1 for s in list(self.sched.running) if not s.prefilling)
        return {"hit": hit, "store_hit": store_hit, "onboard_s": onboard_s, "running": running,
                "prefill_s": self.estimator.prefill_s(len(prompt) - hit - store_hit, hit + store_hit)}

    def _abort(self, rid: str) -> None:
        """Engine thread: the router gave up on ``rid`` (its client left, or the server is stopping).
        Drop it wherever it is — queued, prefilling (it stops at this chunk boundary), decoding, or
        (role helper) waiting for / shipping its KV — and free its blocks; count the stage it was in."""
        stage = self.sched.abort(rid)
        if self.role_helper is not None:
            stage = self.role_helper.abort(rid) or stage
        if stage is None and self.owner.get(rid) is not None:
            stage = "queued"               # still onboarding from the host KV store: never admitted
        if stage is not None:
            self.aborted[stage] = self.aborted.get(stage, 0) + 1
        self.owner.pop(rid, None)
        self.pending_out.pop(rid, None)

    def close(self) -> None:
        if self.role_helper is not None:
            self.role_helper.close()

    def stats(self) -> dict[str, Any]:
        s = self.blocks.stats
        return {
            "role": self.spec.role, "index": self.spec.index,
            "utilization": self.clock.utilization(), "busy_s": self.clock.total_s,
            "uptime_s": time.monotonic() - self.clock.t_start,
            "kv_usage": self.blocks.usage(), "num_blocks": self.blocks.num_blocks,
            "cache": {"queries": s.queries, "hits": s.hits, "misses": s.misses, "query_tokens": s.query_tokens,
                      "hit_tokens": s.hit_tokens, "evictions": s.evictions},
            "running": len(self.sched.running), "waiting": len(self.sched.waiting)
            + (self.role_helper.waiting() if hasattr(self.role_helper, "waiting") else 0),
            "aborted": dict(self.aborted),
            **({"host_bound_s": self.engine.host_bound_seconds_total}    # sim: steps past their modeled length
               if hasattr(self.engine, "host_bound_seconds_total") else {}),
            # this process's store counters (Mooncake keeps none of its own; the built-in store's are global)
            "store": self.store_counts(),
            **self.counters,
        }

    # ---- events out ----------------------------------------------------------------------------

    def send(self, rid: str, msg: dict[str, Any], blob: bytes = b"") -> None:
        conn = self.owner.get(rid)
        if conn is not None:
            conn.send(msg, blob)

    def emit(self, seq: Seq, tokens: list[int], final: bool) -> None:
        first = seq.rid not in self.pending_out   # the first output token goes out alone, at once
        buf = self.pending_out.setdefault(seq.rid, [])
        buf.extend(tokens)
        if buf and (final or first or len(buf) >= self.cfg.tokens_per_chunk):
            self.send(seq.rid, {"op": "tokens", "rid": seq.rid, "ids": buf})
            self.pending_out[seq.rid] = []

    def finish(self, seq: Seq, extra: dict[str, Any] | None = None) -> None:
        self.sched.release(seq, self.store_io.offer if self.store_io is not None else None)
        self.pending_out.pop(seq.rid, None)
        timings = seq.timings()
        timings.update(extra or {})
        self.send(seq.rid, {"op": "done", "rid": seq.rid, "finish_reason": seq.finish_reason,
                            "prompt_tokens": len(seq.prompt), "cached_tokens": seq.cached,
                            "completion_tokens": len(seq.output), "timings": timings})
        self.owner.pop(seq.rid, None)

    def fail(self, seq: Seq, error: str) -> None:
        self.send(seq.rid, {"op": "error", "rid": seq.rid, "error": error})
        self.owner.pop(seq.rid, None)
        if self.role_helper is not None:    # what the role kept for it (a decode worker's KV timings) goes too
            self.role_helper.forget(seq.rid)

    # ---- engine loop (main thread) -------------------------------------------------------------

    def loop(self) -> None:
        idle = getattr(self.engine, "idle", None)    # sim: host time after a wait is not overlapped
        while True:
            block = not self.sched.has_work()
            if block and idle is not None:
                idle()
            try:
                item = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
                item()
                while True:
                    self.inbox.get_nowait()()
            except queue.Empty:
                pass
            if not self.sched.has_work():
                continue
            t0 = time.monotonic()
            try:
                res, rejected = self.sched.step()
            except Exception as exc:  # noqa: BLE001 - an engine error fails the batch, not the worker
                traceback.print_exc()
                for seq in self.sched.running + list(self.sched.waiting):
                    self.sched.abort(seq.rid)
                    self.pending_out.pop(seq.rid, None)
                    self.fail(seq, f"engine error: {type(exc).__name__}: {exc}")
                continue
            if res.step_s:
                busy = getattr(self.engine, "last_busy_s", 0.0) or res.step_s   # sim: overlapped host time counts
                self.clock.add(t0 + res.step_s - busy, t0 + res.step_s)
                self.estimator.observe(res.step_s, res.prefill_tokens)
            elif idle is not None:          # nothing ran (e.g. waiting for remote KV): the engine idles
                idle()
            for seq in rejected:
                self.fail(seq, seq.finish_reason or "rejected")
            finished = {id(s) for s in res.finished}
            for seq, toks in res.emitted:
                self.emit(seq, toks, id(seq) in finished)
            for seq in res.prefilled:
                self.role_helper.ship(seq)
            for seq in res.finished:
                self.finish(seq, self.role_helper.extra_timings(seq) if self.role_helper else None)


def start_worker(spec: WorkerSpec) -> tuple[Worker, dict[str, Any]]:
    """Build the worker of ``spec`` and open its control port (and a decode worker's KV port) on ``spec.host``;
    returns it with its ready report: what the router needs to reach and size it. Shared by a child worker
    (:func:`worker_main`) and a worker joining from another host (:mod:`reference_server.join`)."""
    w = Worker(spec)
    if spec.role == "prefill":
        from reference_server.prefill_worker import PrefillRole

        w.role_helper = PrefillRole(w)
    elif spec.role == "decode":
        from reference_server.decode_worker import DecodeRole

        w.role_helper = DecodeRole(w)
    _, port = serve_blocking(spec.host, spec.internal_token, w.on_message)
    info = {"port": port, "num_blocks": w.blocks.num_blocks, "block_size": w.blocks.block_size,
            "shape": asdict(w.engine.shape), "virtual_kv": spec.config.engine == "sim",
            "wire_bytes_per_s": w.wire_bytes_per_s}
    if w.role_helper is not None:
        info.update(w.role_helper.address())
    return w, info


def run_worker(w: Worker) -> None:
    """The engine loop until SIGTERM (:func:`_stop`): then release what others could see and exit at once."""
    try:
        w.loop()
    except SystemExit:
        w.close()
        exit_now()


def exit_now() -> None:
    """Leave the process at once: what others could see is already released; tearing down the interpreter
    takes seconds."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


M_ARENA_MAX = -8       # glibc mallopt parameter (malloc.h)
WORKER_ARENAS = 2      # malloc arenas a worker process keeps at most


def cap_malloc_arenas(arenas: int = WORKER_ARENAS) -> bool:
    """Cap this process's glibc malloc arenas (``mallopt(M_ARENA_MAX)``); False where the C library has no
    ``mallopt`` (not glibc). Why: glibc gives a thread that first allocates while the other arenas are in use an
    arena of its own, up to 8 per core, and keeps each arena's freed memory for reuse. A worker starts threads
    for life (store calls, KV transfer) and again each time its store is re-attached (a Mooncake client's
    threads, a new call pool), so its private RSS grew in steps of 2-5 MiB after store faults: +4.8% and +5.4%
    over two 30-minute soaks with a store fault every 120 s, against +0.4% with 2 arenas
    (reports/soak/, docs/faults.md "Soak"). A worker's hot allocations are its engine thread's (numpy
    arrays), which keeps the main arena."""
    try:
        return ctypes.CDLL(None).mallopt(M_ARENA_MAX, arenas) == 1
    except (OSError, AttributeError):
        return False


def worker_process(ready: Any, router: Tether, start: Callable[[], tuple[Any, dict[str, Any]]],
                   run: Callable[[Any], None]) -> None:
    """The shape of every worker process the router spawns: tethered to the router, its malloc arenas capped
    (:func:`cap_malloc_arenas`) before its threads start, ``start()`` (the worker and its ready report) reported
    on ``ready`` -- or why it failed -- then ``run(worker)`` until SIGTERM."""
    cap_malloc_arenas()
    die_with_parent(router)
    # The router stops its workers with SIGTERM: leave the engine loop at the next step boundary and
    # unlink what this process created, so no segment is left for the resource tracker to warn about.
    # Ctrl-C reaches the whole process group; the router alone handles it (it stops us in order).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _stop)
    try:
        w, info = start()
        ready.send({"ok": True, **info})
    except Exception as exc:  # noqa: BLE001 - report startup failures to the router, which exits non-zero
        ready.send({"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})
        return
    run(w)


def worker_main(spec: WorkerSpec, ready: Any, router: Tether) -> None:
    """Process entry point (multiprocessing spawn): report ``ready`` then run the engine loop forever.
    A worker never outlives its router, however the router ends (``router`` is its tether)."""
    worker_process(ready, router, lambda: start_worker(spec), run_worker)


def _stop(signum: int, frame: Any) -> None:
    raise SystemExit(0)
