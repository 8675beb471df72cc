"""``run --workers N``: load worker processes on this machine, started, watched and stopped.

Why processes: one event loop streams tens of thousands of tokens/s on one core (docs/performance.md);
past that the client, not the target, sets the pace. Each worker is a spawned process with its own event
loop and aiohttp session, sending its shard of the run's one schedule (``paasbench.load.schedule.Shard``) on
the run's ``t0``: ``time.monotonic()`` is one clock for every process of a Linux machine, so no offset is
needed here (``paasbench.load.ray_workers`` measures them across machines).

A worker talks to the driver over a pipe with the messages of ``paasbench.load.fleet``; a thread per worker
reads them into the driver's event loop, so a record is written as soon as the worker sends it. Workers
ignore SIGINT (Ctrl-C reaches the whole process group): the driver tells them to stop, and they record
their in-flight requests as cancelled before they exit. A worker is started with SIGINT blocked, so a
Ctrl-C during its start-up (seconds of imports on a loaded machine) cannot kill it before it ignores
SIGINT. The block lasts only as long as the spawn itself: the worker's spec (its shard of the trace, which may
be megabytes) goes over the worker's own pipe afterwards, from that worker's reader thread. Passed as the
process's argument, it was written into the spawn pipe with SIGINT blocked in the driver until the child,
still importing, read it: a Ctrl-C then waited out every worker's start-up. A Ctrl-C before the workers were
told to go kills them (they have sent nothing) instead of waiting for them to be ready to hear a stop.
Every worker is tethered (``paas_common.lifetime``):
if the driver dies, even by SIGKILL, its workers die with it.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import signal
import threading
import traceback
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import Any, Iterator

from paas_common.lifetime import Tether, die_with_parent, tether
from paasbench.load.fleet import Fleet
from paasbench.load.shard import ShardWorker, WorkerSpec, decode, encode

JOIN_S = 5.0


class ProcessPool:
    """``len(specs)`` worker processes; records and progress go to ``fleet``."""

    lead_s = 0.05   # t0 this far ahead of "go": every worker has it before the first intended send

    def __init__(self, specs: list[WorkerSpec], fleet: Fleet) -> None:
        self.specs, self.fleet = specs, fleet
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        self.went = False

    async def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # never fork an event loop (and its threads)
        loop = asyncio.get_running_loop()
        for w, spec in enumerate(self.specs):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(theirs, tether()), name=f"paasbench-load-{w}",
                               daemon=True)
            with _sigint_blocked():   # the child inherits the mask: Ctrl-C waits until it ignores SIGINT
                proc.start()          # a few kB through the spawn pipe: milliseconds, not the child's start-up
            theirs.close()
            self.procs.append(proc)
            self.conns.append(ours)
            threading.Thread(target=self._read, args=(w, ours, proc, loop, spec), name=f"load-{w}-reader",
                             daemon=True).start()
        await self.fleet.all_ready()

    def describe(self) -> str:
        return f"{len(self.procs)} load worker processes, pids: " + " ".join(str(p.pid) for p in self.procs)

    def _read(self, w: int, conn: Connection, proc: Any, loop: asyncio.AbstractEventLoop, spec: WorkerSpec) -> None:
        """Worker ``w``'s spec out (blocking until it has started and reads it), then its messages into the
        event loop, until it is done or its pipe breaks. The driver writes to the pipe only after the worker's
        "ready", which follows its reading the spec, so the two writers never interleave."""
        try:
            conn.send(spec)
        except OSError:
            pass                  # the worker is gone (killed by a stop before "go"): the read below says so
        while True:
            try:
                kind, payload = decode(conn.recv_bytes())
            except (EOFError, OSError):
                proc.join(1.0)
                why = f"worker process {proc.pid} ended before finishing (exit status {proc.exitcode})"
                _call(loop, self.fleet.lose, w, why)
                return
            _call(loop, self.fleet.deliver, w, kind, payload)
            if kind in ("D", "E"):
                return

    async def go(self, t0: float, t0_epoch_ns: int) -> None:
        self.went = True
        self._send_all(encode("G", {"t0": t0, "t0_epoch_ns": t0_epoch_ns}))

    async def stop(self, why: str) -> None:
        if self.went:
            self._send_all(encode("X", {"why": why}))
            return
        for w, proc in enumerate(self.procs):   # before "go": nothing was sent, so nothing is lost
            if proc.is_alive():
                proc.kill()
        for w in range(len(self.specs)):
            self.fleet.deliver(w, "D", {"sent": 0})

    def _send_all(self, msg: bytes) -> None:
        for w, conn in enumerate(self.conns):
            if not self.fleet.finished[w]:
                try:
                    conn.send_bytes(msg)
                except OSError:      # the worker is gone: its reader reports it
                    pass

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        for proc in self.procs:
            await loop.run_in_executor(None, proc.join, JOIN_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()

    def meta(self) -> dict[str, Any]:
        return {"count": len(self.specs), "backend": "processes", "pids": [p.pid for p in self.procs]}


@contextmanager
def _sigint_blocked() -> Iterator[None]:
    """SIGINT held pending in this thread (a child forked here starts with it blocked); the driver still
    hears a Ctrl-C at once: any other thread takes it, or this one when the block is lifted."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _call(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the driver's loop has closed: nobody is listening any more
        pass


# ---------------------------------------------------------------------------- the worker process

def _worker_main(conn: Connection, parent: Tether) -> None:
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the driver decides when to stop (and records in-flight)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})   # a Ctrl-C pending since start-up is dropped
    try:
        spec: WorkerSpec = conn.recv()
    except (EOFError, OSError):
        return   # the driver is gone

    def emit(kind: str, payload: Any) -> None:
        conn.send_bytes(encode(kind, payload))

    worker = ShardWorker(spec, emit)
    try:
        emit("Y", {"planned": worker.prepare()})
        kind, payload = decode(conn.recv_bytes())
        if kind == "X":
            worker.stop(payload["why"])
            asyncio.run(worker.serve(0.0, 0))
        else:
            asyncio.run(_serve(worker, conn, payload["t0"], payload["t0_epoch_ns"]))
    except (EOFError, BrokenPipeError):
        return   # the driver is gone
    except Exception:  # noqa: BLE001 - reported to the driver, which counts this worker's requests as lost
        emit("E", {"error": traceback.format_exc()})
    finally:
        conn.close()


async def _serve(worker: ShardWorker, conn: Connection, t0: float, t0_epoch_ns: int) -> None:
    loop = asyncio.get_running_loop()

    def control() -> None:
        try:
            kind, payload = decode(conn.recv_bytes())
        except (EOFError, OSError):
            loop.remove_reader(conn.fileno())
            worker.stop("interrupted")
            return
        if kind == "X":
            worker.stop(payload["why"])

    loop.add_reader(conn.fileno(), control)
    try:
        await worker.serve(t0, t0_epoch_ns)
    finally:
        loop.remove_reader(conn.fileno())
