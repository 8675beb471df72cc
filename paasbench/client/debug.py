"""Test hooks: real extra client work, so the A/B's client probe can be shown to catch a slower client.

Read once, from the environment of ``paasbench run`` (``paasbench ab --b-client-env NAME=VALUE`` sets them for one
side); unset, they cost one global lookup per read. Never set them for a measurement you mean.

* ``PAASBENCH_DEBUG_CHUNK_WORK=N`` — N Python loop iterations per SSE event read (per streamed token from a
  server that sends one token an event): the per-chunk cost of a slower hot loop;
* ``PAASBENCH_DEBUG_LAUNCH_S=S`` — S seconds of CPU spent once before the first request: a launch cost such as a
  prompt tape rebuilt at every run.
"""

from __future__ import annotations

import os
import time

CHUNK_WORK = int(os.environ.get("PAASBENCH_DEBUG_CHUNK_WORK") or 0)
LAUNCH_S = float(os.environ.get("PAASBENCH_DEBUG_LAUNCH_S") or 0.0)


def chunk_work(data: bytes) -> int:
    """``CHUNK_WORK`` iterations for every event in ``data``."""
    x = 0
    for i in range(CHUNK_WORK * data.count(b"data:")):
        x ^= i
    return x


def launch_cost() -> None:
    """Spend ``LAUNCH_S`` seconds of this process's CPU."""
    end = time.process_time() + LAUNCH_S
    while time.process_time() < end:
        pass
