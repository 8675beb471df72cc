"""The one 64-bit hash mix of the repository: the harness's prompt tape and block offsets
(:mod:`paasbench.load.prompts`) and the sim engine's deterministic tokens (:mod:`reference_server.engine.sim`) both
use it, so it lives below both."""

from __future__ import annotations

import numpy as np

_M64 = (1 << 64) - 1


def mix64(x: int) -> int:
    """splitmix64 finalizer: a fixed, well-spread hash of a 64-bit integer (public: one copy for the repo)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def mix64_array(x: np.ndarray) -> np.ndarray:
    """:func:`mix64` of each element (uint64 arithmetic wraps as the masks above do)."""
    x = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))
