"""Where the model's arrays live: numpy on the host, or a torch device (cpu, cuda:N, musa:N).

The model is written once against the Python array API (``xp.matmul``, ``xp.exp``, ...) through
array-api-compat, so numpy and torch run literally the same lines. This module is the only place
that knows which library is behind ``xp``, which float dtype the weights and activations use
(float32 on a CPU; bfloat16 on an accelerator unless told otherwise) and how to wait for a device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

DTYPES = ("auto", "float32", "bfloat16")
DEVICE_KINDS = ("cpu", "cuda", "musa")


@dataclass(frozen=True)
class Backend:
    name: str      # "numpy" | "torch"
    device: str    # "cpu" | "cuda:N" | "musa:N"
    xp: Any        # array-API namespace
    float_dtype: Any
    index_dtype: Any

    @property
    def kind(self) -> str:
        return self.device.split(":")[0]

    @property
    def dtype_name(self) -> str:
        return "float32" if self.name == "numpy" else str(self.float_dtype).removeprefix("torch.")

    def asarray(self, a: Any, *, index: bool = False) -> Any:
        """Host array (or a torch tensor anywhere) -> array of this backend, on its device."""
        dtype = self.index_dtype if index else self.float_dtype
        if self.name == "numpy":
            return np.ascontiguousarray(a, dtype=dtype)
        import torch

        if isinstance(a, torch.Tensor):
            return a.to(self.device, dtype)
        host = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64 if index else np.float32))
        return host.to(self.device, dtype, non_blocking=False)

    def to_numpy(self, a: Any) -> np.ndarray:
        """A host copy; bfloat16 (which numpy lacks) widens to float32."""
        if self.name == "numpy":
            return np.asarray(a)
        import torch

        a = a.detach()
        if a.dtype == torch.bfloat16:
            a = a.float()
        return a.to("cpu").numpy()

    def synchronize(self) -> None:
        """Wait for the device's queued work: a clock read after this measures finished work."""
        if self.kind in ("cuda", "musa"):
            _module(self.kind).synchronize(self.device)

    def memory(self) -> tuple[int, int] | None:
        """(free, total) bytes of the device, or None on a CPU."""
        if self.kind not in ("cuda", "musa"):
            return None
        free, total = _module(self.kind).mem_get_info(self.device)
        return int(free), int(total)


def _module(kind: str) -> Any:
    import torch

    return getattr(torch, kind)


def device_count(kind: str) -> int:
    """Devices of ``kind`` this process can see (``cpu``: 1). Imports torch (and torch_musa) lazily."""
    if kind == "cpu":
        return 1
    import torch

    if kind == "musa":
        try:
            import torch_musa  # noqa: F401  (registers the 'musa' device with torch)
        except ImportError as exc:
            raise ValueError("device 'musa' needs torch_musa (Moore Threads' torch plugin)") from exc
        if not torch.musa.is_available():
            raise ValueError("device 'musa' requested but torch.musa.is_available() is False")
        return int(torch.musa.device_count())
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but torch.cuda.is_available() is False")
        return int(torch.cuda.device_count())
    raise ValueError(f"unknown device {kind!r}; valid: {', '.join(DEVICE_KINDS)}")


def parse_device(device: str) -> tuple[str, int | None]:
    """``"cuda:2"`` -> ("cuda", 2); ``"cuda"`` -> ("cuda", None)."""
    kind, _, idx = device.partition(":")
    if kind not in DEVICE_KINDS:
        raise ValueError(f"unknown device {device!r}; valid: cpu, cuda[:N], musa[:N]")
    if idx and not idx.isdigit():
        raise ValueError(f"device {device!r}: the index after ':' must be a number")
    return kind, (int(idx) if idx else None)


def get_backend(name: str = "numpy", device: str = "cpu", dtype: str = "auto") -> Backend:
    """Resolve ``--backend``/``--device``/``--dtype``; errors say what to install or pick instead."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPES)}")
    if name == "numpy":
        if device != "cpu":
            raise ValueError(f"backend 'numpy' runs on device 'cpu' only, not {device!r}; use --backend torch")
        if dtype == "bfloat16":
            raise ValueError("backend 'numpy' computes in float32 only; bfloat16 needs --backend torch")
        import array_api_compat.numpy as xp

        return Backend("numpy", "cpu", xp, np.float32, np.int64)
    if name == "torch":
        try:
            import torch
        except ImportError as exc:
            raise ValueError("backend 'torch' needs torch: pip install 'paasbench[torch]'") from exc
        kind, idx = parse_device(device)
        if kind != "cpu":
            n = device_count(kind)
            idx = 0 if idx is None else idx
            if idx >= n:
                raise ValueError(f"device {kind}:{idx} requested but only {n} {kind} device(s) exist")
            device = f"{kind}:{idx}"
            _module(kind).set_device(idx)   # this process's default device: kernels and caches go there
        import array_api_compat.torch as xp

        float_dtype = torch.bfloat16 if dtype == "bfloat16" or (dtype == "auto" and kind != "cpu") else torch.float32
        return Backend("torch", device, xp, float_dtype, torch.int64)
    raise ValueError(f"unknown backend {name!r}; valid: numpy, torch")
