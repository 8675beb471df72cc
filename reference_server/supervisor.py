"""Worker supervision: start the worker processes, watch them, replace the ones that die or hang.

Routing (:mod:`reference_server.router`) only asks which workers are up; this module owns their
processes and control connections:

* **start**: spawn each worker (multiprocessing *spawn*, tethered so it dies with the router however
  the router ends: :mod:`paas_common.lifetime`), wait for its ready report, open its authenticated
  control connection;
* **heartbeat**: every ``heartbeat_interval_s`` a ``ping`` that the worker's reader thread answers. A
  worker whose process exited, whose connection closed, or which has not answered within
  ``heartbeat_timeout_s`` (SIGSTOP, a wedged process) is declared *down*, so detection takes at most
  ``heartbeat_interval_s + heartbeat_timeout_s``;
* **down**: each of its in-flight requests gets an ``error`` event marked ``worker_lost`` at once (the
  router fails a lost prefill over to the decode worker, or ends the request with a clear error), and
  the process is killed (a stopped process cannot be asked to leave);
* **restart**: a new process for the same role and index, with back-off doubling while it keeps dying
  young; once it answers it takes the old one's place in its pool (re-registration), after the
  ``on_ready`` hooks ran for it: what the router told the first incarnation, it tells the new one.

``health()`` sums it up: ``ok`` (every worker up), ``degraded`` (some down or restarting, requests still
served), ``unavailable`` (no decode worker up).
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import os
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from paas_common.lifetime import tether
from reference_server.config import INTERNAL_HOST, ServerConfig, WorkerSpec
from reference_server.ipc import open_authenticated, pack, read_frame

_ids = itertools.count(1)
BACKOFF_MAX_S = 30.0
STABLE_S = 30.0          # a worker that lived this long is healthy again: back-off starts over


@dataclass
class WorkerHandle:
    """One worker process and its control connection, as the router sees it."""

    spec: WorkerSpec
    process: Any
    port: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    reader: asyncio.StreamReader | None = None
    writer: asyncio.StreamWriter | None = None
    inflight: int = 0
    streams: dict[str, asyncio.Queue] = field(default_factory=dict)
    replies: dict[int, asyncio.Future] = field(default_factory=dict)
    task: asyncio.Task | None = None
    dead: bool = False                  # down: route around it until its replacement is up
    down_reason: str = ""
    started_at: float = field(default_factory=time.monotonic)
    last_seen: float = field(default_factory=time.monotonic)   # when its last frame arrived

    @property
    def name(self) -> str:
        return self.spec.name

    def send(self, msg: dict[str, Any], blob: bytes = b"") -> None:
        if self.dead or self.writer is None:
            return                       # its requests were failed when it went down
        self.writer.write(pack(msg, blob))

    async def call(self, msg: dict[str, Any], blob: bytes = b"", timeout: float = 10.0) -> dict[str, Any]:
        if self.dead:
            raise ConnectionError(f"worker {self.name} is down ({self.down_reason})")
        msg["id"] = cid = next(_ids)
        fut = asyncio.get_running_loop().create_future()
        self.replies[cid] = fut
        self.send(msg, blob)
        try:
            return await asyncio.wait_for(fut, max(0.0, timeout))
        finally:
            self.replies.pop(cid, None)

    async def pump(self) -> None:
        """Dispatch worker frames until the connection closes: replies to their futures, events to their
        request's queue."""
        assert self.reader is not None
        try:
            while True:
                msg, _ = await read_frame(self.reader)
                self.last_seen = time.monotonic()
                if msg.get("op") == "reply":
                    fut = self.replies.get(msg["id"])
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
                    continue
                q = self.streams.get(msg.get("rid", ""))
                if q is not None:
                    q.put_nowait((self, msg))
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass


Hook = Callable[[WorkerHandle], Awaitable[None]]


class Supervisor:
    def __init__(self, cfg: ServerConfig, token: str) -> None:
        self.cfg = cfg
        self.token = token
        self.prefill: list[WorkerHandle] = []
        self.decode: list[WorkerHandle] = []     # decode or mixed workers
        self.on_ready: list[Hook] = []           # run for every restarted worker (re-registration)
        self.restarts = 0
        self._backoff: dict[str, float] = {}
        self._tasks: set[asyncio.Task] = set()
        self._stopping = False
        self._ctx = mp.get_context("spawn")

    @property
    def workers(self) -> list[WorkerHandle]:
        return self.prefill + self.decode

    # ---- start ----------------------------------------------------------------------------------

    async def start(self, timeout_s: float = 300.0) -> None:
        # Each worker stands for one device: give it an equal share of the cores so one worker's BLAS
        # threads cannot starve another's (a user's explicit setting wins).
        share = str(max(1, (os.cpu_count() or 1) // max(1, sum(self.cfg.pools().values()))))
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(var, share)
        launched = [self._launch(WorkerSpec(role=role, index=i, config=self.cfg, internal_token=self.token))
                    for role, n in self.cfg.pools().items() for i in range(n)]
        handles = await asyncio.gather(*(self._connect(h, pipe, timeout_s) for h, pipe in launched))
        for h in handles:
            (self.prefill if h.spec.role == "prefill" else self.decode).append(h)
        self._spawn_task(self._heartbeat())

    def _launch(self, spec: WorkerSpec) -> tuple[WorkerHandle, Any]:
        from reference_server.worker import worker_main

        if spec.config.engine == "vllm":   # the same protocol, a vLLM instance behind it
            from reference_server.vllm_worker import vllm_worker_main as worker_main
        parent, child = self._ctx.Pipe(duplex=False)
        p = self._ctx.Process(target=worker_main, args=(spec, child, tether()), name=f"paasbench-{spec.name}",
                              daemon=True)
        p.start()
        child.close()
        return WorkerHandle(spec, p), parent

    async def _connect(self, h: WorkerHandle, pipe: Any, timeout_s: float) -> WorkerHandle:
        loop = asyncio.get_running_loop()
        if not await loop.run_in_executor(None, pipe.poll, timeout_s):
            h.process.kill()
            raise RuntimeError(f"worker {h.name} did not start within {timeout_s:.0f}s")
        try:
            info = pipe.recv()
        except EOFError:
            raise RuntimeError(f"worker {h.name} exited during start-up (exit code "
                               f"{await loop.run_in_executor(None, _exitcode, h.process)})") from None
        finally:
            pipe.close()
        if not info.get("ok"):
            raise RuntimeError(f"worker {h.name} failed to start: {info.get('error')}\n{info.get('trace', '')}")
        h.info, h.port = info, info["port"]
        h.reader, h.writer = await asyncio.wait_for(open_authenticated(INTERNAL_HOST, h.port, self.token), 30.0)
        h.started_at = time.monotonic()
        h.task = asyncio.create_task(self._pump(h))
        return h

    async def _pump(self, h: WorkerHandle) -> None:
        await h.pump()
        self.down(h, "closed its control connection" if h.process.is_alive() else
                  f"exited (exit code {h.process.exitcode})")

    # ---- heartbeat, down, restart ---------------------------------------------------------------

    async def _heartbeat(self) -> None:
        pinging: dict[int, asyncio.Task] = {}
        while not self._stopping:
            await asyncio.sleep(self.cfg.heartbeat_interval_s)
            for h in self.workers:
                if h.dead:
                    continue
                if not h.process.is_alive():
                    self.down(h, f"exited (exit code {h.process.exitcode})")
                elif id(h) not in pinging or pinging[id(h)].done():
                    pinging[id(h)] = asyncio.create_task(self._ping(h))
            for key in [k for k, t in pinging.items() if t.done()]:
                del pinging[key]

    async def _ping(self, h: WorkerHandle) -> None:
        timeout = self.cfg.heartbeat_timeout_s
        try:
            await h.call({"op": "ping"}, timeout=timeout)
        except asyncio.TimeoutError:
            # If this loop itself was held up, the answer may be read only now: let the pump catch up
            # and count any frame from the worker as a sign of life before declaring it down.
            await asyncio.sleep(0.05)
            if time.monotonic() - h.last_seen > timeout:
                self.down(h, f"missed its heartbeat (no answer in {timeout:g}s)")
        except (ConnectionError, OSError):
            pass          # already down, or its pump is about to say so

    def down(self, h: WorkerHandle, reason: str) -> None:
        """Declare ``h`` down: fail its requests now, kill its process, and restart it."""
        if h.dead:
            return
        h.dead, h.down_reason = True, reason
        error = f"worker {h.name} {reason}"
        for rid, q in h.streams.items():
            q.put_nowait((h, {"op": "error", "rid": rid, "error": error, "worker_lost": True}))
        for fut in h.replies.values():
            if not fut.done():
                fut.set_exception(ConnectionError(error))
        if h.writer is not None:
            h.writer.close()
        if h.process.is_alive():
            h.process.kill()              # SIGKILL reaches a stopped process too
        if not self._stopping:
            print(f"reference_server: {error}; restarting it", flush=True)
            self._spawn_task(self._restart(h))

    async def _restart(self, old: WorkerHandle) -> None:
        lived = time.monotonic() - old.started_at
        delay = 0.0 if lived > STABLE_S else min(BACKOFF_MAX_S, max(0.5, 2 * self._backoff.get(old.name, 0.25)))
        self._backoff[old.name] = delay
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, old.process.join, 5.0)
        while not self._stopping:
            await asyncio.sleep(delay)
            try:
                h = await self._connect(*self._launch(old.spec), timeout_s=300.0)
                for hook in self.on_ready:
                    await hook(h)
            except Exception as exc:  # noqa: BLE001 - a failed restart is retried, later
                print(f"reference_server: restarting worker {old.name} failed: {exc}", flush=True)
                delay = self._backoff[old.name] = min(BACKOFF_MAX_S, max(0.5, 2 * delay))
                continue
            if self._stopping:
                h.process.kill()
                return
            pool = self.prefill if old.spec.role == "prefill" else self.decode
            pool[pool.index(old)] = h
            if old.process.exitcode is not None:
                old.process.close()       # out of every pool now; else its sentinel pipe stays open for good
            self.restarts += 1
            print(f"reference_server: worker {h.name} restarted (pid {h.process.pid})", flush=True)
            return

    def _spawn_task(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- stop, report ---------------------------------------------------------------------------

    def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        for h in self.workers:
            if h.process.is_alive():
                h.process.terminate()
        for h in self.workers:
            h.process.join(timeout=5)
            if h.process.is_alive():
                h.process.kill()

    def health(self) -> dict[str, Any]:
        down = sorted(h.name for h in self.workers if h.dead)
        if not down:
            status = "ok"
        else:
            status = "degraded" if any(not h.dead for h in self.decode) else "unavailable"
        return {"status": status, "down": down, "restarts": self.restarts}

    def procs(self) -> dict[str, dict[str, Any]]:
        """Worker name -> pid and the ports it listens on: its control port first, then a decode worker's
        TCP KV port."""
        out = {h.name: {"pid": h.process.pid, "ports": [p for p in (h.port, h.info.get("kv_port")) if p]}
               for h in self.workers}
        for h in self.workers:           # --engine vllm: the instance's process group (launched or attached)
            if h.info.get("engine_url"):
                out[h.name]["engine_url"] = h.info["engine_url"]
                out[h.name]["engine_pgid"] = h.info.get("engine_pid")
                out[h.name]["engine_log"] = h.info.get("engine_log")
        return out


def _exitcode(process: Any) -> int | None:
    process.join(5.0)
    return process.exitcode
