"""A worker process's malloc arenas are capped (reference_server/worker.py, ``cap_malloc_arenas``).

glibc gives a thread that first allocates while the other arenas are busy an arena of its own (up to 8 per
core) and keeps each arena's freed memory. Worker threads come and go with every store re-attach, and a
decode worker's private RSS grew in 2-5 MiB steps after store faults: +4.8% over a 30-minute Mooncake soak,
+0.4% with two arenas (reports/soak/). Here a real worker process (the supervisor's ``worker_process`` shape,
multiprocessing spawn) starts 8 threads that allocate at once and counts its heaps with ``malloc_info``."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import platform
import tempfile
import threading
from pathlib import Path

import pytest

from paas_common.lifetime import tether
from reference_server.worker import WORKER_ARENAS, worker_process

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc arenas are glibc's")


def heaps_after_threads(out: str) -> None:
    """8 threads allocate together (a barrier), then ``malloc_info``'s heap count goes to ``out``."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.fopen.restype = ctypes.c_void_p
    held: list = []
    together = threading.Barrier(8)

    def work() -> None:
        together.wait()
        held.append([libc.malloc(4096) for _ in range(64)])

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    info = tempfile.mktemp()
    f = libc.fopen(info.encode(), b"w")
    libc.malloc_info(0, ctypes.c_void_p(f))
    libc.fclose(ctypes.c_void_p(f))
    Path(out).write_text(str(Path(info).read_text().count("<heap nr=")))


def _worker(ready, router, out: str, capped: bool) -> None:
    if capped:
        worker_process(ready, router, lambda: (out, {}), heaps_after_threads)
    else:       # the same threads in a process that skipped the cap: what the count shows without it
        heaps_after_threads(out)


@pytest.mark.parametrize("capped", [True, False])
def test_a_worker_process_keeps_its_malloc_arenas_capped(tmp_path, capped):
    out = tmp_path / "heaps"
    ctx = mp.get_context("spawn")
    ready, child = ctx.Pipe()
    p = ctx.Process(target=_worker, args=(child, tether(), str(out), capped))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    heaps = int(out.read_text())
    if capped:
        assert ready.poll(5) and ready.recv() == {"ok": True}
        assert heaps <= WORKER_ARENAS, heaps
    else:
        assert heaps > WORKER_ARENAS, heaps        # the test can tell: without the cap the threads take more
