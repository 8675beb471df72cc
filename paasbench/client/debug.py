"""Test hooks: real extra client work, so the A/B's client probe can be shown to catch a slower client.

Read once, from the environment of ``paasbench run`` (``paasbench ab --b-client-env NAME=VALUE`` sets them for one
side); unset, they cost one global lookup per request. Never set them for a measurement you mean.

* ``PAASBENCH_DEBUG_CLIENT_SLOWDOWN=F`` — a client slower by the fraction F (0.2: 20%) of its own CPU, whatever
  the machine: at each SSE read the thread spins for F × the CPU it spent since the previous read
  (``time.thread_time_ns``: parsing, the event loop, the kernel's socket work on that thread, the records). A
  fixed amount of work per event, as this hook was before (N loop iterations), is a different fraction of the
  client's cost on every machine and under every load: N=30 measured +18.5% to +38.6% per round (median +30%)
  on the 2-core dev box, where 20% was meant. Calibrated this way the slowdown is F by construction, so the
  gate's acceptance ("a 20% slower client fails 9 of 10") tests the gate, not the hook;
* ``PAASBENCH_DEBUG_LAUNCH_S=S`` — S seconds of CPU spent once before the first request: a launch cost such as a
  prompt tape rebuilt at every run.
"""

from __future__ import annotations

import os
import time

SLOWDOWN = float(os.environ.get("PAASBENCH_DEBUG_CLIENT_SLOWDOWN") or 0.0)
LAUNCH_S = float(os.environ.get("PAASBENCH_DEBUG_LAUNCH_S") or 0.0)


class Slowdown:
    """Spins for ``fraction`` × the calling thread's CPU between calls. The first call only sets the mark (what
    came before the first read — imports, the prompt tape, sending the first requests — is not taxed); an
    overshoot of one spin is carried into the next, so over many calls the spin is ``fraction`` of the rest to
    within one clock read. One thread (the run's event loop) calls it."""

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction
        self.mark: int | None = None     # thread CPU (ns) when the last call returned
        self.owed = 0                    # ns still to spin (negative: spun ahead)
        self.spun = 0                    # ns spun so far (tests compare it with the CPU taxed)

    def __call__(self) -> None:
        now = time.thread_time_ns()
        if self.mark is not None:
            self.owed += int((now - self.mark) * self.fraction)
            start, end = now, now + self.owed
            while now < end:
                now = time.thread_time_ns()
            self.owed = end - now
            self.spun += now - start
        self.mark = now


slowdown: Slowdown | None = Slowdown(SLOWDOWN) if SLOWDOWN > 0 else None


def launch_cost() -> None:
    """Spend ``LAUNCH_S`` seconds of this process's CPU."""
    end = time.process_time() + LAUNCH_S
    while time.process_time() < end:
        pass
