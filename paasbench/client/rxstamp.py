"""Kernel receive timestamps for the client's reads: a token's arrival is when the packet reached this host.

Why: a client stamps a chunk when its event loop takes the bytes off the socket at best. When the loop is busy at
that moment (writing another request's 0.5 MB body, building the next 128K-token prompt, a garbage collection),
the bytes wait in the socket and the wait is charged to the server as TTFT or ITL: at 128K tokens and
concurrency 8 on the 2-core box, client TTFT minus the server's first write was a mean of 1.07 and 6.88 ms in two
rounds (medians -0.07 and 1.04 ms), set by the requests whose first token came while the client was elsewhere.
The kernel stamps every packet as it is received (``SO_TIMESTAMPNS``), whatever the reader is doing, and
``recvmsg`` hands the stamp over with the bytes.

How: asyncio's selector transport reads with ``recv`` in its read callback and offers no hook, so on a plain
TCP connection the callback is replaced by the same code reading with ``recvmsg``. For TCP the stamp a read
carries is that of the last packet it took, so several events read together still share one time, as before,
but no longer the time of a late read. Where this cannot be done (not Linux, TLS, a transport whose internals
differ), :func:`install` changes nothing and reads are stamped by the event loop: ``arrival_clock`` says which
a run should use, and each record counts its reads that were stamped by the loop all the same
(``RequestRecord.loop_stamped_reads``), so a run says which it did use.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import sys
import time
from typing import Any, Callable

from paasbench.metrics.records import KERNEL_CLOCK, LOOP_CLOCK

SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux; SCM_TIMESTAMPNS is the same number
_ANCILLARY = socket.CMSG_SPACE(16) if hasattr(socket, "CMSG_SPACE") else 0  # one struct timespec
_timespec = struct.Struct("@qq").unpack_from
KERNEL, LOOP = KERNEL_CLOCK, LOOP_CLOCK


def _transport_has_hook() -> bool:
    from asyncio import selector_events

    cls = getattr(selector_events, "_SelectorSocketTransport", None)
    return cls is not None and all(hasattr(cls, a) for a in ("_read_ready", "_read_ready__on_eof",
                                                               "_fatal_error", "max_size"))


SUPPORTED = sys.platform.startswith("linux") and _ANCILLARY > 0 and _transport_has_hook()


def arrival_clock(target: str) -> str:
    """Which clock stamps chunk arrivals for a run against ``target`` (recorded in the run's meta)."""
    return KERNEL if SUPPORTED and not target.lower().startswith("https:") else LOOP


def install(transport: asyncio.BaseTransport, protocol: Any, clock: Callable[[], float]) -> bool:
    """Make ``transport`` read with ``recvmsg`` and set ``protocol.rx_stamp`` (on ``clock``'s scale) to each
    read's kernel receive time before handing its bytes to ``protocol.data_received``, which takes the stamp
    (and stamps a read that came without one itself). False, with nothing changed, where it cannot."""
    tr: Any = transport
    sock = getattr(tr, "_sock", None)
    if (not SUPPORTED or type(tr).__name__ != "_SelectorSocketTransport" or not isinstance(sock, socket.socket)
            or sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM
            or not all(hasattr(tr, a) for a in ("_read_ready_cb", "_conn_lost"))):
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    except OSError:
        return False
    recvmsg, size, wall = sock.recvmsg, tr.max_size, time.time

    def read_ready() -> None:  # asyncio's _read_ready__data_received, reading with recvmsg
        if tr._conn_lost:
            return
        try:
            data, anc, _flags, _addr = recvmsg(size, _ANCILLARY)
        except (BlockingIOError, InterruptedError):
            return
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            tr._fatal_error(exc, "Fatal read error on socket transport")
            return
        if not data:
            tr._read_ready__on_eof()
            return
        if anc and anc[0][1] == SO_TIMESTAMPNS:
            now = clock()
            sec, ns = _timespec(anc[0][2])
            # the kernel's stamp is wall-clock time: moved onto the run's clock by the offset read just now.
            # It cannot be later than the read itself; a wall-clock step between the two clocks' reads could
            # make it look so, and then the read's own time is the honest bound
            protocol.rx_stamp = min(now, sec + ns * 1e-9 - (wall() - now))
        # else no stamp came with the read: the protocol stamps it itself, and counts it as the loop's
        try:
            protocol.data_received(data)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            tr._fatal_error(exc, "Fatal error: protocol.data_received() call failed.")

    tr._read_ready_cb = read_ready
    return True
