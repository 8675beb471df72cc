"""The CPU an engine step costs: the worker process's CPU over the step, less what its other Python threads
spent meanwhile.

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


class StepCPU:
    """``start()`` before a step and ``stop()`` after it: the step's CPU seconds, helpers' CPU left out.

    Each helper's schedstat file stays open and is re-read in place (one ``pread`` a helper and a read: about
    5 µs, where opening it each time cost ~60 µs on this box), and is closed when its thread is gone."""

    __slots__ = ("_c0", "_helpers0", "_fds")

    def __init__(self) -> None:
        self._c0 = 0.0
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
                continue                    # ended meanwhile, or no /proc: not subtracted
        return out

    def start(self) -> None:
        self._helpers0 = self._helpers_cpu_s()
        self._c0 = time.process_time()

    def stop(self) -> float:
        cpu = time.process_time() - self._c0
        after = self._helpers_cpu_s()
        helpers = sum(after[tid] - c for tid, c in self._helpers0.items() if tid in after)
        return max(0.0, cpu - helpers)
