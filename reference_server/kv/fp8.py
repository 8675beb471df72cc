"""FP8 e4m3 (OCP ``float8_e4m3fn``) with one scale per KV block, in plain numpy.

Why per block: KV magnitudes differ a lot between layers and between K and V, and a block is the unit
the transfer moves, so ``scale[layer, k|v, block] = amax / 448`` maps each block onto the full e4m3
range. e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities; 0x7F/0xFF are NaN;
largest finite 448; subnormals step 2**-9. Rounding is round-half-to-even, as in hardware casts.

Encoding uses float32 bit arithmetic (no per-element Python, no lookup search); decoding is a
256-entry table lookup. Inputs must be finite.
"""

from __future__ import annotations

import threading

import numpy as np

E4M3_MAX = 448.0
_MIN_NORMAL = 2.0 ** -6


def _table() -> np.ndarray:
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = codes & 0x7
    mag = np.where(exp == 0, man / 8.0 * _MIN_NORMAL, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    out = (sign * mag).astype(np.float32)
    out[(codes & 0x7F) == 0x7F] = np.nan
    return out


DECODE_TABLE = _table()


def block_scales(kv: np.ndarray) -> np.ndarray:
    """``[layers, 2, n_blocks]`` float32 scales for ``kv [layers, 2, n_blocks, block, heads, dim]``."""
    if not kv.size:
        return np.ones(kv.shape[:3], np.float32)
    rows = kv.reshape(*kv.shape[:3], -1)           # max and -min: no |kv| temporary the size of the KV
    amax = np.maximum(rows.max(axis=-1), -rows.min(axis=-1)).astype(np.float32)
    return np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1.0)).astype(np.float32)


_CHUNK = 1 << 18   # elements per pass: temporaries stay in L2, yet numpy call overhead is amortized (best of 2**12..2**22 here)


def _encode_chunk(y: np.ndarray, out: np.ndarray, t: np.ndarray, sub: np.ndarray) -> None:
    """e4m3 codes of ``y`` (scaled float32, clobbered) into ``out``; ``t``/``sub`` are scratch."""
    sign = np.signbit(y)
    np.abs(y, out=y)
    np.minimum(y, np.float32(E4M3_MAX), out=y)
    bits = y.view(np.uint32)
    # Normal range: keep 3 of float32's 23 mantissa bits with round-half-even, then re-bias the
    # exponent from 127 to 7: code = ((exp - 120) << 3) | mantissa.
    np.right_shift(bits, 20, out=t)
    t &= np.uint32(1)
    t += np.uint32(0x7FFFF)
    t += bits
    t >>= np.uint32(20)
    t -= np.uint32(120 << 3)
    # Subnormal range (|y| < 2**-6): multiples of 2**-9; rint is half-even; 8 lands on the first normal.
    np.multiply(y, np.float32(512.0), out=sub)
    np.rint(sub, out=sub)
    np.copyto(t, sub, where=y < np.float32(_MIN_NORMAL), casting="unsafe")
    np.copyto(out, t, casting="unsafe")
    out |= sign.view(np.uint8) << np.uint8(7)


_tls = threading.local()


def _scratch(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-thread scratch, kept between calls: fresh megabyte arrays would page-fault on every call."""
    have = getattr(_tls, "bufs", None)
    if have is None or have[0].size < n:
        have = _tls.bufs = (np.empty(n, np.float32), np.empty(n, np.uint32), np.empty(n, np.float32))
    return have


def _encode_rows(rows: np.ndarray, scales: np.ndarray | None) -> np.ndarray:
    """Codes for ``rows [R, E]`` divided by ``scales [R]`` (or 1), a cache-sized window at a time."""
    R, E = rows.shape
    codes = np.empty((R, E), np.uint8)
    per, width = min(R, max(1, _CHUNK // max(E, 1))), min(E, _CHUNK)
    y, t, sub = _scratch(max(1, per * width))
    for r in range(0, R, per):
        for c in range(0, E, width):
            src = rows[r:r + per, c:c + width]
            n = src.size
            ys = y[:n].reshape(src.shape)
            if scales is None:
                np.copyto(ys, src, casting="same_kind")
            else:
                np.divide(src, scales[r:r + per, None], out=ys, casting="same_kind")
            _encode_chunk(ys, codes[r:r + per, c:c + width], t[:n].reshape(src.shape), sub[:n].reshape(src.shape))
    return codes


def to_e4m3(x: np.ndarray) -> np.ndarray:
    """Round finite values (clamped to ±448) to e4m3 codes (uint8), half to even."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    return _encode_rows(x.reshape(1, -1), None).reshape(x.shape)


def quantize(kv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``kv`` -> (codes uint8 of the same shape, scales ``[layers, 2, n_blocks]`` float32)."""
    scales = block_scales(kv)
    rows = np.ascontiguousarray(kv).reshape(scales.size, -1)
    return _encode_rows(rows, scales.reshape(-1)).reshape(kv.shape), scales


def dequantize(codes: np.ndarray, scales: np.ndarray, dtype: str | np.dtype = np.float32) -> np.ndarray:
    out = DECODE_TABLE[codes]
    out *= scales[:, :, :, None, None, None]
    return out.astype(dtype, copy=False)
