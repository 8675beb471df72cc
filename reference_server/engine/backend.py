"""Where the model's arrays live: numpy on the host, or a torch device (cpu, cuda, musa).

The model is written once against the Python array API (``xp.matmul``, ``xp.exp``, ...) through
array-api-compat, so numpy and torch run literally the same lines. This module is the only place
that knows which library is behind ``xp``; weights are always generated in numpy (so every backend
starts from bit-identical parameters) and moved with :meth:`Backend.asarray`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Backend:
    name: str      # "numpy" | "torch"
    device: str    # "cpu" | "cuda" | "musa"
    xp: Any        # array-API namespace
    float_dtype: Any
    index_dtype: Any

    def asarray(self, a: Any, *, index: bool = False) -> Any:
        """Host array (or anything array-like) -> array of this backend, on its device."""
        dtype = self.index_dtype if index else self.float_dtype
        if self.name == "numpy":
            return np.ascontiguousarray(a, dtype=dtype)
        return self.xp.asarray(np.ascontiguousarray(a, dtype=np.int64 if index else np.float32),
                               dtype=dtype, device=self.device)

    def to_numpy(self, a: Any) -> np.ndarray:
        if self.name == "numpy":
            return np.asarray(a)
        return a.detach().to("cpu").numpy()


def get_backend(name: str = "numpy", device: str = "cpu") -> Backend:
    """Resolve ``--backend``/``--device``; errors say what to install or pick instead."""
    if name == "numpy":
        if device != "cpu":
            raise ValueError(f"backend 'numpy' runs on device 'cpu' only, not {device!r}; use --backend torch")
        import array_api_compat.numpy as xp

        return Backend("numpy", "cpu", xp, np.float32, np.int64)
    if name == "torch":
        try:
            import torch
        except ImportError as exc:
            raise ValueError("backend 'torch' needs torch: pip install 'paasbench[torch]'") from exc
        if device == "musa":
            try:
                import torch_musa  # noqa: F401  (registers the 'musa' device with torch)
            except ImportError as exc:
                raise ValueError("device 'musa' needs torch_musa (Moore Threads' torch plugin)") from exc
        elif device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but torch.cuda.is_available() is False")
        elif device not in ("cpu", "cuda"):
            raise ValueError(f"unknown device {device!r}; valid: cpu, cuda, musa")
        import array_api_compat.torch as xp

        return Backend("torch", device, xp, torch.float32, torch.int64)
    raise ValueError(f"unknown backend {name!r}; valid: numpy, torch")
