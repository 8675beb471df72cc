"""An engine step's wall time and CPU time. The CPU is the worker process's over the step, less what its other
Python threads spent meanwhile; the wall clock brackets the CPU clock (read before it at the start, after it at
the end). tests/test_server_clock.py once checked that a step's CPU never exceeds its wall time times the cores;
with the reads the other way round (CPU first), the CPU window held the wall window, and a clean-clone CI run
broke that bound: 67.7 ms of CPU over 4 decode steps of 8.19 ms mean wall on 2 cores. Reordering did not close
it: it broke again (32.9 ms over 4 steps of 3.69 ms on 2 cores), because Linux accounts another running thread's
CPU lazily (at a tick or a switch), so a step's window can take up CPU that a BLAS thread, spinning on after the
step before, spent before the window began. A single window is therefore blurred by up to a tick per other
running thread; the sum over windows never exceeds the process's CPU over them (the windows are disjoint and the
accounted clock only grows), which is the bound the test now checks.

Why not ``time.process_time()`` alone, as the scheduler used: a worker's helper threads (the control channel's
reader, the KV store's thread, peer connections' drains) run while a step runs — most of all while the sim
engine sleeps its modeled time — and process CPU over the step counted their work as the engine's, in
proportion to how much of the wall clock the steps cover. The twin at ``--sim-time-scale 1.1`` (steps 10%
longer in wall time, no engine change) read +38% to +61% "engine CPU per prefill token" in
``benchmarks/gate_acceptance.py``, and the gate called it a regression. Why not ``time.thread_time()`` alone:
the cpu and torch engines do part of their math on BLAS/OpenMP threads, which are not Python threads; process
CPU less the Python helpers keeps that work in.

The helpers' CPU is read from ``/proc/self/task/TID/schedstat`` (nanoseconds on a CPU, the same source the
client probe reads): a thread that ended meanwhile has no file and is skipped, where a CPU clock of a dead
``pthread_t`` would be undefined behaviour. Where there is no /proc (not Linux), the step's figure is the
process CPU as before.
"""

from __future__ import annotations

import os
import threading
import time

_TASKS = "/proc/self/task"


class StepClock:
    """``start()`` before a step (returns its wall start) and ``stop()`` after it: the step's wall seconds and
    CPU seconds, helpers' CPU left out.

    Each helper's schedstat file stays open and is re-read in place (one ``pread`` a helper and a read: about
    5 µs, where opening it each time cost ~60 µs on this box), and is closed when its thread is gone."""

    __slots__ = ("_t0", "_c0", "_helpers0", "_fds")

    def __init__(self) -> None:
        self._t0 = self._c0 = 0.0
        self._helpers0: dict[int, float] = {}
        self._fds: dict[int, int] = {}

    def _helpers_cpu_s(self) -> dict[int, float]:
        """CPU seconds so far of every live Python thread of this process but the calling one, by native id."""
        me = threading.get_native_id()
        live = {t.native_id for t in threading.enumerate()} - {None, me}
        for tid in [tid for tid in self._fds if tid not in live]:
            os.close(self._fds.pop(tid))
        out: dict[int, float] = {}
        for tid in live:
            try:
                fd = self._fds.get(tid)
                if fd is None:
                    fd = self._fds[tid] = os.open(f"{_TASKS}/{tid}/schedstat", os.O_RDONLY)
                out[tid] = int(os.pread(fd, 64, 0).split()[0]) / 1e9
            except (OSError, ValueError, IndexError):
                # ended meanwhile, or no /proc: not subtracted; a file held open for an ended thread whose id
                # a new thread took is let go, so the next read opens the new thread's
                if tid in self._fds:
                    os.close(self._fds.pop(tid))
        return out

    def start(self) -> float:
        self._helpers0 = self._helpers_cpu_s()
        self._t0 = time.perf_counter()
        self._c0 = time.process_time()
        return self._t0

    def stop(self) -> tuple[float, float]:
        cpu = time.process_time() - self._c0
        wall = time.perf_counter() - self._t0
        after = self._helpers_cpu_s()
        helpers = sum(after[tid] - c for tid, c in self._helpers0.items() if tid in after)
        return wall, max(0.0, cpu - helpers)
