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
  the process is killed (a stopped process cannot be asked to leave). The log says why, in one line: how
  the process ended (``was killed by signal 9 (SIGKILL)``, ``exited with code 1``), or, for a missed
  heartbeat, how long it had been silent and what it was last sent, its pid, and whether the router killed it;
* **restart**: a new process for the same role and index, with back-off doubling while it keeps dying
  young; once it answers it takes the old one's place in its pool (re-registration), after the
  ``on_ready`` hooks ran for it: what the router told the first incarnation, it tells the new one. An
  attempt that fails (did not start, a hook raised) is killed and reaped before the next one starts, so a
  restart that keeps failing never piles up processes (issue 30: 10 worker processes of 4 configured).

**Joined workers** (``serve --join``, :mod:`reference_server.join`) run on other hosts and are not this
process's children. They register on the join port (``--join-port``): the same challenge on the internal
token as every internal connection (no token, no join; a refusal is logged and counted), then the
router's configuration goes to them and their ready report comes back on that connection, which stays
open as their tether (they leave when it closes). From then on they are watched exactly like a child:
control connection, heartbeats, ``down`` failing their requests over. What differs: the router cannot
kill or restart them, so a joined worker that is down is *dropped* from its pool (``health()`` lists the
latest ``DROPPED_KEPT`` and counts them all) and comes back only by joining again: from the same host and
for the same role it takes the name it had (``prefill-1`` again, not ``prefill-2``), and leaves the list.

``health()`` sums it up: ``ok`` (every worker up), ``degraded`` (some down or restarting, or a pool of this
mode with none up, e.g. the only prefill worker dropped; requests still served), ``unavailable`` (no decode
worker up). The shared KV store's parts are added by the router (``/health``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import multiprocessing as mp
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from paas_common.lifetime import describe_exit, tether
from reference_server import challenge
from reference_server.config import ServerConfig, WorkerSpec
from reference_server.ipc import open_authenticated, pack, read_frame

_ids = itertools.count(1)
BACKOFF_MAX_S = 30.0
STABLE_S = 30.0          # a worker that lived this long is healthy again: back-off starts over
DROPPED_KEPT = 32        # joined workers listed as dropped in /health (the latest; the total is counted)


@dataclass
class WorkerHandle:
    """One worker process and its control connection, as the router sees it."""

    spec: WorkerSpec
    process: Any                        # a child's multiprocessing.Process; None: joined from another host
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
    tie: asyncio.StreamWriter | None = None   # a joined worker's join connection: it leaves when this closes
    last_op: str = ""                   # the last control message sent to it, and when (a down reason names it)
    last_op_at: float = 0.0
    store_generation: int = -1          # the KV store's generation its handle is of (-1: none yet)
    store_counts: dict[str, Any] | None = None   # its store counters, from its last heartbeat answer

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def host(self) -> str:
        return self.spec.host

    @property
    def joined(self) -> bool:
        return self.process is None

    def alive(self) -> bool:
        """A child whose process has not exited (a joined worker's liveness is its heartbeat alone)."""
        return self.joined or self.process.is_alive()

    def exit_reason(self) -> str:
        if self.joined or self.process.is_alive():
            return "closed its control connection"
        return describe_exit(self.process.exitcode)

    def note_store(self, counts: dict[str, Any] | None) -> None:
        """Its store counters as last seen (a heartbeat answer, a ``stats`` reply): each the highest seen, so
        that what the router keeps when it goes down is never below what ``/metrics`` already showed."""
        if counts is None:
            return
        seen = self.store_counts or {}
        self.store_counts = {k: max(v, seen.get(k, v)) if isinstance(v, (int, float)) else v
                             for k, v in counts.items()}

    def silence(self) -> str:
        """How long it has been silent and what it was last sent: what a missed heartbeat came after."""
        now = time.monotonic()
        said = f"its last frame {now - self.last_seen:.1f} s ago"
        if self.last_op:
            said += f", the last message sent to it '{self.last_op}' {now - self.last_op_at:.1f} s ago"
        return said

    def send(self, msg: dict[str, Any], blob: bytes = b"") -> None:
        if self.dead or self.writer is None:
            return                       # its requests were failed when it went down
        if msg.get("op") != "ping":
            self.last_op, self.last_op_at = str(msg.get("op")), time.monotonic()
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
        self.on_down: list[Callable[[WorkerHandle], None]] = []   # run for every worker that goes down
        self.restarts = 0
        # joined workers that went down (name, host, reason): the latest DROPPED_KEPT, and how many in all
        self.dropped: deque[dict[str, str]] = deque(maxlen=DROPPED_KEPT)
        self.dropped_total = 0
        self._free_names: dict[tuple[str, str], list[int]] = {}   # (role, host) -> indices a dropped worker left
        self.refused = 0                         # join attempts refused (wrong internal token, bad hello)
        self._joined = {"prefill": cfg.pools().get("prefill", 0), "decode": cfg.pools().get("decode", 0)}
        self._join_server: asyncio.AbstractServer | None = None
        self.join_store: dict[str, Any] | None = None    # the shared KV store, for joining workers (the router)
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
        launched = [self._launch(WorkerSpec(role=role, index=i, config=self.cfg, internal_token=self.token,
                                            host=self.cfg.worker_host))
                    for role, n in self.cfg.pools().items() for i in range(n)]
        handles = await asyncio.gather(*(self._connect(h, pipe, timeout_s) for h, pipe in launched))
        for h in handles:
            (self.prefill if h.spec.role == "prefill" else self.decode).append(h)
        self._spawn_task(self._heartbeat())

    def _launch(self, spec: WorkerSpec) -> tuple[WorkerHandle, Any]:
        if spec.config.engine == "vllm":   # the same protocol, a vLLM instance behind it
            from reference_server.vllm_worker import vllm_worker_main as target
        else:
            from reference_server.worker import worker_main as target
        parent, child = self._ctx.Pipe(duplex=False)
        p = self._ctx.Process(target=target, args=(spec, child, tether()), name=f"paasbench-{spec.name}",
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
        return await self._open_control(h, info)

    async def _open_control(self, h: WorkerHandle, info: dict[str, Any]) -> WorkerHandle:
        """Open the authenticated control connection to a worker that reported ``info`` (its ready report)."""
        h.info, h.port = info, info["port"]
        h.reader, h.writer = await asyncio.wait_for(open_authenticated(h.host, h.port, self.token), 30.0)
        h.started_at = time.monotonic()
        h.task = asyncio.create_task(self._pump(h))
        return h

    async def _pump(self, h: WorkerHandle) -> None:
        await h.pump()
        if not h.joined and not h.dead and h.process.is_alive():   # closed as it died: say how it ended
            await asyncio.get_running_loop().run_in_executor(None, h.process.join, 1.0)
        self.down(h, h.exit_reason())

    # ---- workers joining from other hosts -------------------------------------------------------

    async def accept_joins(self, host: str, port: int) -> int:
        """Listen for joining workers on ``host:port``; returns the port (``port`` 0 picks a free one)."""
        self._join_server = await asyncio.start_server(self._join, host, port, limit=1 << 20)
        return self._join_server.sockets[0].getsockname()[1]

    async def _join(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One joining worker: challenge it on the internal token, answer its own challenge, send it the
        configuration and its name, wait for its ready report, then watch it like a child."""
        peer = writer.get_extra_info("peername")
        where = f"{peer[0]}:{peer[1]}" if peer else "?"
        try:
            nonce, ask = challenge.ask()
            writer.write(pack(ask))
            hello, _ = await asyncio.wait_for(read_frame(reader), 10.0)
            role = hello.get("role")
            if not challenge.proven(self.token, nonce, hello, "hello"):
                self._refuse(writer, where, "wrong internal token")
                return
            if role not in ("prefill", "decode") or self.cfg.mode != "disaggregated":
                self._refuse(writer, where, f"role {role!r} (this router takes prefill or decode workers)")
                return
            host = str(hello.get("host") or peer[0])
            index = self._join_index(role, host)
            spec = WorkerSpec(role=role, index=index, config=self.cfg, internal_token=self.token, host=host)
            writer.write(pack({"op": "welcome", "mac": challenge.mac_hex(self.token, hello.get("nonce")),
                               "name": spec.name, "index": index, "config": dataclasses.asdict(self.cfg),
                               "store": self.join_store}))
            ready, _ = await asyncio.wait_for(read_frame(reader), 300.0)    # it builds its engine first
            if not ready.get("ok"):
                print(f"reference_server: worker {spec.name} joining from {where} failed to start: "
                      f"{ready.get('error')}", flush=True)
                writer.close()
                return
            h = await self._open_control(WorkerHandle(spec, None, tie=writer), ready)
            for hook in self.on_ready:
                await hook(h)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError, OSError, ValueError,
                RuntimeError) as exc:    # RuntimeError: an on_ready hook failed (it could not open the KV store)
            print(f"reference_server: a worker joining from {where} did not complete its join: "
                  f"{type(exc).__name__}: {exc}", flush=True)
            writer.close()
            return
        if self._stopping or h.dead:
            writer.close()
            return
        (self.prefill if role == "prefill" else self.decode).append(h)
        for d in [d for d in self.dropped if d["name"] == h.name]:
            self.dropped.remove(d)       # back: no longer dropped
        print(f"reference_server: worker {h.name} joined from {h.host} (control port {h.port}); "
              "watched by heartbeat, not restarted by this router", flush=True)
        try:                             # the join connection carries nothing more: its close means gone
            await reader.read()
        except (ConnectionError, OSError):
            pass
        self.down(h, "closed its join connection")

    def _join_index(self, role: str, host: str) -> int:
        """The index (the name: ``decode-1``) of a worker joining from ``host``: the one a worker of this role
        dropped from that host left, when no live worker holds it, else the next one of the role."""
        held = {h.spec.index for h in (self.prefill if role == "prefill" else self.decode)}
        free = [i for i in self._free_names.get((role, host), []) if i not in held]
        if free:
            index = min(free)
            self._free_names[(role, host)].remove(index)
            return index
        index = self._joined[role]
        self._joined[role] += 1
        return index

    def _refuse(self, writer: asyncio.StreamWriter, where: str, why: str) -> None:
        self.refused += 1
        print(f"reference_server: refused a worker joining from {where}: {why}", flush=True)
        writer.write(pack({"op": "error", "error": "unauthorized" if why == "wrong internal token" else why}))
        writer.close()

    # ---- heartbeat, down, restart ---------------------------------------------------------------

    async def _heartbeat(self) -> None:
        pinging: dict[int, asyncio.Task] = {}
        while not self._stopping:
            await asyncio.sleep(self.cfg.heartbeat_interval_s)
            for h in self.workers:
                if h.dead:
                    continue
                if not h.alive():
                    self.down(h, h.exit_reason())
                elif id(h) not in pinging or pinging[id(h)].done():
                    pinging[id(h)] = asyncio.create_task(self._ping(h))
            for key in [k for k, t in pinging.items() if t.done()]:
                del pinging[key]

    async def _ping(self, h: WorkerHandle) -> None:
        timeout = self.cfg.heartbeat_timeout_s
        try:
            r = await h.call({"op": "ping"}, timeout=timeout)
        except asyncio.TimeoutError:
            # If this loop itself was held up, the answer may be read only now: let the pump catch up
            # and count any frame from the worker as a sign of life before declaring it down.
            await asyncio.sleep(0.05)
            if time.monotonic() - h.last_seen > timeout:
                self.down(h, f"missed its heartbeat (no answer in {timeout:g} s; {h.silence()})")
        except (ConnectionError, OSError):
            pass          # already down, or its pump is about to say so
        else:
            h.note_store(r.get("store"))         # kept by the router when it goes down (store_link)

    def down(self, h: WorkerHandle, reason: str) -> None:
        """Declare ``h`` down: fail its requests now, kill its process, and restart it (a joined worker:
        close its connections, which tells it to leave, and drop it from its pool)."""
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
        for hook in self.on_down:
            hook(h)
        if h.joined:
            self._drop(h, reason)
            return
        killed = h.process.is_alive()
        if killed:
            h.process.kill()              # SIGKILL reaches a stopped process too
        if not self._stopping:
            print(f"reference_server: {error} (pid {h.process.pid}"
                  + ("; killed it with SIGKILL" if killed else "") + "); restarting it", flush=True)
            self._spawn_task(self._restart(h))

    def _drop(self, h: WorkerHandle, reason: str) -> None:
        if h.tie is not None:
            h.tie.close()
        pool = self.prefill if h.spec.role == "prefill" else self.decode
        if h in pool:
            pool.remove(h)
        if not self._stopping:
            self._free_names.setdefault((h.spec.role, h.host), []).append(h.spec.index)
            self.dropped.append({"name": h.name, "host": h.host, "reason": reason})
            self.dropped_total += 1
            print(f"reference_server: worker {h.name} (joined from {h.host}) {reason}; dropped: the router does "
                  "not restart a joined worker (start it again with --join)", flush=True)

    async def _restart(self, old: WorkerHandle) -> None:
        lived = time.monotonic() - old.started_at
        delay = 0.0 if lived > STABLE_S else min(BACKOFF_MAX_S, max(0.5, 2 * self._backoff.get(old.name, 0.25)))
        self._backoff[old.name] = delay
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, old.process.join, 5.0)
        while not self._stopping:
            await asyncio.sleep(delay)
            h = None
            try:
                h, pipe = self._launch(old.spec)
                await self._connect(h, pipe, timeout_s=300.0)
                for hook in self.on_ready:
                    await hook(h)
            except Exception as exc:  # noqa: BLE001 - a failed restart is retried, later
                # the attempt's process goes before the next one starts: a restart never piles them up
                if h is not None:
                    if h.writer is not None:
                        h.writer.close()
                    if h.task is not None:
                        h.task.cancel()
                    if h.process.is_alive():
                        h.process.kill()
                    await loop.run_in_executor(None, h.process.join, 5.0)
                delay = self._backoff[old.name] = min(BACKOFF_MAX_S, max(0.5, 2 * delay))
                print(f"reference_server: restarting worker {old.name} failed: {exc}; next try in {delay:g} s",
                      flush=True)
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
        if self._join_server is not None:
            self._join_server.close()
        children = [h for h in self.workers if not h.joined]
        for h in self.workers:
            if h.joined and h.tie is not None:
                h.tie.close()             # a joined worker leaves when its join connection closes
        for h in children:
            if h.process.is_alive():
                h.process.terminate()
        for h in children:
            h.process.join(timeout=5)
            if h.process.is_alive():
                h.process.kill()

    def health(self) -> dict[str, Any]:
        """``unavailable`` with no decode worker up (restarting, or none has joined yet); ``degraded`` with one
        down, or a pool this mode has that has none up (the only prefill worker dropped: every prefill runs
        on a decode worker); else ``ok``. ``empty``: those pools."""
        down = sorted(h.name for h in self.workers if h.dead)
        empty = [pool for pool, hs in (("prefill", self.prefill), ("decode", self.decode))
                 if (pool == "decode" or self.cfg.mode == "disaggregated") and not any(not h.dead for h in hs)]
        if "decode" in empty:
            status = "unavailable"
        else:
            status = "degraded" if down or empty else "ok"
        return {"status": status, "down": down, "empty_pools": empty, "restarts": self.restarts,
                "dropped": list(self.dropped), "dropped_total": self.dropped_total, "join_refused": self.refused}

    def joined_hosts(self) -> dict[str, dict[str, int]]:
        """Host -> role -> workers that joined from it and are up (what :mod:`reference_server.hardware` counts)."""
        out: dict[str, dict[str, int]] = {}
        for h in self.workers:
            if h.joined and not h.dead:
                roles = out.setdefault(h.host, {})
                roles[h.spec.role] = roles.get(h.spec.role, 0) + 1
        return out

    def procs(self) -> dict[str, dict[str, Any]]:
        """This host's worker processes: name -> pid and the ports it listens on (its control port first,
        then a decode worker's TCP KV port). Joined workers are processes of other hosts: not listed."""
        out = {h.name: {"pid": h.process.pid, "ports": [p for p in (h.port, h.info.get("kv_port")) if p]}
               for h in self.workers if not h.joined}
        for h in self.workers:           # --engine vllm: the instance's process group (launched or attached)
            if h.info.get("engine_url") and h.name in out:
                out[h.name]["engine_url"] = h.info["engine_url"]
                out[h.name]["engine_pgid"] = h.info.get("engine_pid")
                out[h.name]["engine_log"] = h.info.get("engine_log")
        return out


def _exitcode(process: Any) -> int | None:
    process.join(5.0)
    return process.exitcode
