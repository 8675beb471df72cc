"""What both transports share: per-request transfer figures, the modeled link (and the sim's, sized from its device
profile), the received item."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from reference_server.engine.base import ModelShape, VirtualKV
from reference_server.kv.codec import KVIntegrityError, TransferMeta, decode, payload_len


@dataclass(slots=True)
class TransferStats:
    """One request's transfer, as seen by one side.

    ``payload_bytes`` is the KV payload the message stands for (declared, for VirtualKV);
    ``wire_bytes`` what actually crossed the transport (header included). ``elapsed_s`` is measured
    wall time on this side — sender: encode + write (shm) or until the receiver's ack (TCP); receiver:
    map/read + verify + copy out. ``modeled_s`` is the link model's share of it (0 without a link).
    """

    request_id: str
    transport: str
    payload_bytes: int
    wire_bytes: int
    elapsed_s: float
    modeled_s: float = 0.0
    virtual: bool = False
    error: str | None = None          # receiver rejected the KV: a KVIntegrityError reason

    @property
    def gbps(self) -> float:
        """Payload GB/s (1e9 bytes) over ``elapsed_s``."""
        return self.payload_bytes / self.elapsed_s / 1e9 if self.elapsed_s > 0 else 0.0


@dataclass(slots=True)
class Received:
    """A transfer as delivered to the receiving worker: KV to install, or why it must be recomputed."""

    request_id: str
    meta: TransferMeta | None
    kv: Any                           # np.ndarray (owned by this object) | VirtualKV | None on error
    stats: TransferStats
    error: KVIntegrityError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class Link:
    """A modeled network link for the sim: a transfer of ``n`` bytes completes ``n / bandwidth`` (+
    latency) after the link is free. Transfers through one Link queue FIFO, as on a real wire, so
    concurrent requests see each other's bytes. Applied on the receiving side."""

    def __init__(self, bandwidth_bytes_per_s: float, latency_s: float = 0.0) -> None:
        if bandwidth_bytes_per_s <= 0:
            raise ValueError("link bandwidth must be > 0")
        self.bandwidth = bandwidth_bytes_per_s
        self.latency_s = latency_s
        self._free_at = 0.0
        self._lock = threading.Lock()

    def reserve(self, nbytes: int, start: float) -> float:
        """``time.perf_counter()`` time at which ``nbytes`` that began arriving at ``start`` are through."""
        with self._lock:
            begin = max(start, self._free_at)
            self._free_at = begin + nbytes / self.bandwidth
            return self._free_at + self.latency_s

    def wait(self, nbytes: int, start: float) -> float:
        """Sleep until the modeled arrival; returns the modeled duration since ``start``."""
        done = self.reserve(nbytes, start)
        delay = done - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return done - start


def sim_link(cfg: Any, engine: Any) -> Link | None:
    """The sim's modeled wire between machines (KV transfer, store reads): the engine's device profile's
    network bandwidth, scaled like every other modeled time by ``sim_time_scale``; None for real engines."""
    if cfg.engine != "sim" or cfg.sim_time_scale <= 0:
        return None
    dev = engine.device
    gbps = dev.network_gbps or dev.interconnect_gbps
    return Link(gbps * 1e9 / cfg.sim_time_scale, dev.link_latency_s * cfg.sim_time_scale)


def verify(buf: Any, request_id: str, stats: TransferStats, start: float, *, expect: ModelShape,
           block_size: int | None, link: Link | None) -> tuple[TransferMeta, Any]:
    """The receiving side of every transport: decode and check ``buf`` (raises KVIntegrityError), make
    sure it is the message for ``request_id``, fill ``stats``, and hold it for the modeled wire time."""
    meta, kv = decode(buf, expect=expect, block_size=block_size)
    if meta.request_id != request_id:
        raise KVIntegrityError("format", f"message holds {meta.request_id!r}, expected {request_id!r}")
    stats.virtual = isinstance(kv, VirtualKV)
    stats.payload_bytes = payload_len(buf)
    if link is not None:
        stats.modeled_s = link.wait(stats.payload_bytes, start)
    return meta, kv
