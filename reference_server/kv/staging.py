"""Moving KV blocks between a device pool and the host bytes the transfer codec frames.

The wire format (:mod:`reference_server.kv.codec`) is host bytes with an xxh3 checksum, whatever the
pool's device. Off a GPU, KV goes through *pinned* (page-locked) host memory: the DMA engine copies
straight from it, where a pageable buffer costs a second, CPU-driven copy, and the copy is waited on
here, so a caller's clock around :func:`to_host`/:func:`to_device` measures the finished transfer
(an asynchronous copy left running would make ``kv_write_ms`` stop early).

numpy has no bfloat16: a bfloat16 block travels as its raw 16-bit patterns (``uint16``), bit-exact.

Between two devices of one host, :func:`peer_copy` copies device to device (NVLink / PCIe peer
access where the pair supports it, else through the driver's own staging); ``scripts/gpu_check.sh``
measures it against the pinned host path.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np


def _accelerator(device: Any) -> bool:
    return str(device).split(":")[0] in ("cuda", "musa")


def to_host(x: Any) -> np.ndarray:
    """A torch tensor anywhere -> a host numpy array (float32, float16; bfloat16 as uint16 bits, FP8 as
    uint8 codes)."""
    import torch

    x = x.detach()
    accel = _accelerator(x.device)
    staged = torch.empty(x.shape, dtype=x.dtype, pin_memory=accel)   # torch caches pinned blocks
    staged.copy_(x, non_blocking=accel)
    if accel:
        getattr(torch, x.device.type).synchronize(x.device)
    if staged.dtype == torch.bfloat16:
        return staged.view(torch.int16).numpy().view(np.uint16)
    if staged.element_size() == 1 and staged.is_floating_point():   # FP8 codes: their raw bytes
        return staged.view(torch.uint8).numpy()
    return staged.numpy()


def to_device(a: np.ndarray, device: Any) -> Any:
    """Host KV (as :func:`to_host` returns it, or any float array) -> a torch tensor on ``device``."""
    import torch

    a = np.ascontiguousarray(a)
    if not a.flags.writeable:   # e.g. a view into a received message: only read here, never written
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if a.dtype == np.uint16 else torch.from_numpy(a)
    else:
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if a.dtype == np.uint16 else torch.from_numpy(a)
    if not _accelerator(device):
        return t
    out = t.pin_memory().to(device, non_blocking=True)
    getattr(torch, str(device).split(":")[0]).synchronize(device)
    return out


def can_peer(src: Any, dst: Any) -> bool:
    """Whether ``src`` can copy straight into ``dst`` memory (both CUDA, peer access possible)."""
    import torch

    s, d = torch.device(src), torch.device(dst)
    if s.type != "cuda" or d.type != "cuda":
        return False
    return s.index == d.index or bool(torch.cuda.can_device_access_peer(s.index or 0, d.index or 0))


def peer_copy(x: Any, device: Any) -> Any:
    """Device-to-device copy of ``x`` onto ``device``, waited on (both sides synchronized)."""
    import torch

    out = x.to(device, non_blocking=True)
    for dev in {x.device, out.device}:
        if _accelerator(dev):
            getattr(torch, dev.type).synchronize(dev)
    return out
