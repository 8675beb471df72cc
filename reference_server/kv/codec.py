"""KV transfer wire format (``docs/kv.md``): one self-describing message per request's KV.

    message = header (64-byte aligned, ends with its own xxh3_64) + payload
    payload = [FP8 only: scales float32 [layers, 2, n_blocks]] + kv [layers, 2, n_blocks, block_size, kv_heads, head_dim]

:func:`encode` returns frames (header bytes, then memoryviews of the arrays) so a transport can write
them without joining; :func:`decode` returns numpy views into the buffer it was given (no copy)
except for FP8, which is dequantized into a new array of the receiver's pool dtype. A
:class:`~reference_server.engine.base.VirtualKV` travels as the header alone: the payload length is
declared (FP8-sized when the wire dtype is FP8), no payload bytes follow, the transport models its
wire time instead, and the receiver gets a VirtualKV sized for its own pool.

Every check a receiver needs before installing KV into its pool happens in :func:`decode`, which
raises :class:`KVIntegrityError` with a ``reason`` from :data:`REASONS`; the caller recomputes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import xxhash

from reference_server.engine.base import HOST_DTYPES, ModelShape, VirtualKV
from reference_server.kv import fp8

MAGIC = b"PKVX"
FORMAT_VERSION = 1
ALIGN = 64
CHECKSUM_XXH3_64 = 1

FLAG_VIRTUAL = 1

# dtype code on the wire <-> name (ModelShape.kv_dtype spelling) and item size.
DTYPES: dict[int, tuple[str, int]] = {1: ("float32", 4), 2: ("float16", 2), 3: ("fp8_e4m3", 1), 4: ("bfloat16", 2)}
_CODE_OF = {name: code for code, (name, _) in DTYPES.items()}
# numpy has no bfloat16: on the host a bfloat16 block is its raw 16-bit patterns.
HOST_DTYPE = {name: np.dtype(HOST_DTYPES.get(name, name)) for name in ("float32", "float16", "bfloat16")}
# Pool dtypes an FP8 message may be dequantized into (float32 for the pools numpy cannot hold; the
# engine's write_blocks casts or re-encodes).
FP8_TARGETS = ("float32", "float16", "bfloat16", "fp8_e4m3")

# magic, version, flags, header_len, dtype, checksum algo, layers, kv_heads, head_dim, block_size,
# n_blocks, num_tokens, start_block, payload_len, payload checksum
_FIXED = struct.Struct("<4sHHIBB2xIIIIIIIQQ")

REASONS = ("truncated", "format", "checksum", "model", "shape", "dtype")


class KVIntegrityError(ValueError):
    """Received KV must not be used. ``reason`` is one of :data:`REASONS` (a metrics label)."""

    def __init__(self, reason: str, message: str) -> None:
        assert reason in REASONS, reason
        self.reason = reason
        super().__init__(f"{reason}: {message}")


@dataclass(frozen=True, slots=True)
class TransferMeta:
    """What the receiver must know and verify about one KV message.

    ``dtype`` is the *wire* dtype: the pool's own, or ``fp8_e4m3`` to quantize on the way.
    ``start_block`` is the index, within the sequence, of the first block carried (blocks before it
    were prefix-cache hits the receiver already holds); ``num_tokens`` counts the tokens whose KV is
    valid in the carried blocks (the last block may be partial).
    """

    request_id: str
    model_name: str
    model_version: str
    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    n_blocks: int
    num_tokens: int
    dtype: str
    start_block: int = 0

    @classmethod
    def for_shape(cls, request_id: str, shape: ModelShape, *, block_size: int, n_blocks: int,
                  num_tokens: int, dtype: str | None = None, start_block: int = 0) -> "TransferMeta":
        return cls(request_id, shape.name, shape.version, shape.layers, shape.kv_heads, shape.head_dim,
                   block_size, n_blocks, num_tokens, dtype or shape.kv_dtype, start_block)

    def kv_shape(self) -> tuple[int, ...]:
        return (self.layers, 2, self.n_blocks, self.block_size, self.kv_heads, self.head_dim)

    def payload_len(self) -> int:
        """Bytes of the payload a real (non-virtual) message carries."""
        itemsize = DTYPES[_code(self.dtype)][1]
        scales = 4 * self.layers * 2 * self.n_blocks if self.dtype == "fp8_e4m3" else 0
        return scales + int(np.prod(self.kv_shape())) * itemsize


def _code(dtype: str) -> int:
    try:
        return _CODE_OF[dtype]
    except KeyError:
        raise KVIntegrityError("dtype", f"unsupported wire dtype {dtype!r} (have {sorted(_CODE_OF)})") from None


def _pstr(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<H", len(b)) + b


def _checksum(parts: Sequence[Any]) -> int:
    h = xxhash.xxh3_64()
    for p in parts:
        h.update(p)
    return h.intdigest()


def _header(meta: TransferMeta, flags: int, payload_len: int, checksum: int) -> bytes:
    body = _FIXED.pack(MAGIC, FORMAT_VERSION, flags, 0, _code(meta.dtype), CHECKSUM_XXH3_64, meta.layers,
                       meta.kv_heads, meta.head_dim, meta.block_size, meta.n_blocks, meta.num_tokens,
                       meta.start_block, payload_len, checksum)
    body += _pstr(meta.request_id) + _pstr(meta.model_name) + _pstr(meta.model_version)
    total = -(-(len(body) + 8) // ALIGN) * ALIGN
    body = body[:8] + struct.pack("<I", total) + body[12:]
    body += bytes(total - 8 - len(body))
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def encode(meta: TransferMeta, kv: np.ndarray | VirtualKV) -> list[memoryview | bytes]:
    """Frames of one message; their concatenation is what :func:`decode` reads."""
    if isinstance(kv, VirtualKV):
        if kv.n_blocks != meta.n_blocks:
            raise ValueError(f"VirtualKV has {kv.n_blocks} blocks, meta says {meta.n_blocks}")
        # FP8 on the wire shrinks the modeled bytes just as it would shrink real ones.
        wire = meta.payload_len() if meta.dtype == "fp8_e4m3" else kv.nbytes
        return [_header(meta, FLAG_VIRTUAL, wire, 0)]
    if kv.shape != meta.kv_shape():
        raise ValueError(f"kv shape {kv.shape} != meta shape {meta.kv_shape()}")
    if meta.dtype == "fp8_e4m3":
        codes, scales = fp8.quantize(kv)
        parts = [memoryview(scales).cast("B"), memoryview(codes).cast("B")]
    else:
        if kv.dtype != HOST_DTYPE[meta.dtype]:
            raise ValueError(f"kv dtype {kv.dtype} != wire dtype {meta.dtype} (only fp8_e4m3 converts)")
        parts = [memoryview(np.ascontiguousarray(kv)).cast("B")]
    payload_len = sum(p.nbytes for p in parts)
    return [_header(meta, 0, payload_len, _checksum(parts)), *parts]


def frames_nbytes(frames: Sequence[memoryview | bytes]) -> int:
    return sum(memoryview(f).nbytes for f in frames)


def _fixed_fields(buffer: Any) -> tuple:
    head = memoryview(buffer).cast("B")[:_FIXED.size]
    if len(head) < _FIXED.size:
        raise KVIntegrityError("truncated", f"{len(head)} bytes, header needs {_FIXED.size}")
    return _FIXED.unpack(head)


def message_len(buffer: Any) -> int:
    """Total length of the message at the start of ``buffer``, from its header (for framing)."""
    f = _fixed_fields(buffer)
    return f[3] + (0 if f[2] & FLAG_VIRTUAL else f[13])


def payload_len(buffer: Any) -> int:
    """Payload bytes the message carries, or for VirtualKV the bytes it stands for on the wire
    (what a link model charges). Read from the unverified header: use after :func:`decode`."""
    return _fixed_fields(buffer)[13]


def decode(buffer: Any, *, expect: ModelShape, block_size: int | None = None) -> tuple[TransferMeta, np.ndarray | VirtualKV]:
    """Verify and unpack one message. ``expect`` is the receiver's model; ``block_size`` its pool's.

    Returns a view into ``buffer`` for raw dtypes (copy it into the pool before the buffer goes
    away), a new array of ``expect.kv_dtype`` for FP8, or a :class:`VirtualKV`.
    """
    mv = memoryview(buffer).cast("B")
    if len(mv) < _FIXED.size:
        raise KVIntegrityError("truncated", f"{len(mv)} bytes, header needs {_FIXED.size}")
    (magic, version, flags, header_len, dcode, algo, layers, kv_heads, head_dim, bsize, n_blocks,
     num_tokens, start_block, payload_len, checksum) = _FIXED.unpack(mv[:_FIXED.size])
    if magic != MAGIC or version != FORMAT_VERSION or algo != CHECKSUM_XXH3_64:
        raise KVIntegrityError("format", f"magic {magic!r} version {version} checksum algo {algo}: not a v{FORMAT_VERSION} KV message")
    if header_len % ALIGN or header_len < _FIXED.size + 14:
        raise KVIntegrityError("format", f"bad header length {header_len}")
    if len(mv) < header_len:
        raise KVIntegrityError("truncated", f"{len(mv)} bytes, header says {header_len}")
    (hsum,) = struct.unpack_from("<Q", mv, header_len - 8)
    if xxhash.xxh3_64_intdigest(mv[:header_len - 8]) != hsum:
        raise KVIntegrityError("checksum", "header checksum mismatch")
    off = _FIXED.size
    strings = []
    for _ in range(3):
        (n,) = struct.unpack_from("<H", mv, off)
        strings.append(bytes(mv[off + 2:off + 2 + n]).decode())
        off += 2 + n
    if dcode not in DTYPES:
        raise KVIntegrityError("dtype", f"unknown dtype code {dcode}")
    meta = TransferMeta(strings[0], strings[1], strings[2], layers, kv_heads, head_dim, bsize, n_blocks,
                        num_tokens, DTYPES[dcode][0], start_block)

    if (meta.model_name, meta.model_version) != (expect.name, expect.version):
        raise KVIntegrityError("model", f"KV from {meta.model_name}@{meta.model_version}, "
                                        f"receiver runs {expect.name}@{expect.version}")
    if (layers, kv_heads, head_dim) != (expect.layers, expect.kv_heads, expect.head_dim) or (
            block_size is not None and bsize != block_size) or num_tokens > n_blocks * bsize:
        raise KVIntegrityError("shape", f"layers/kv_heads/head_dim/block_size/tokens {layers}/{kv_heads}/{head_dim}/"
                                        f"{bsize}/{num_tokens} in {n_blocks} blocks; receiver has {expect.layers}/"
                                        f"{expect.kv_heads}/{expect.head_dim}/{block_size}")
    if not (meta.dtype == expect.kv_dtype or (meta.dtype == "fp8_e4m3" and expect.kv_dtype in FP8_TARGETS)):
        raise KVIntegrityError("dtype", f"wire dtype {meta.dtype} cannot fill a {expect.kv_dtype} pool")

    if flags & FLAG_VIRTUAL:
        # What the receiver's pool holds for these blocks (its dtype), not the wire bytes.
        return meta, VirtualKV(n_blocks, n_blocks * bsize * expect.kv_bytes_per_token())
    if payload_len != meta.payload_len():
        raise KVIntegrityError("shape", f"payload {payload_len} bytes, shape {meta.kv_shape()} x {meta.dtype} needs {meta.payload_len()}")
    end = header_len + payload_len
    if len(mv) < end:
        raise KVIntegrityError("truncated", f"{len(mv)} bytes, message needs {end}")
    payload = mv[header_len:end]
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        raise KVIntegrityError("checksum", f"payload checksum mismatch ({payload_len} bytes)")
    if meta.dtype == "fp8_e4m3":
        n_scales = layers * 2 * n_blocks
        scales = np.frombuffer(payload, np.float32, n_scales).reshape(layers, 2, n_blocks)
        codes = np.frombuffer(payload, np.uint8, offset=4 * n_scales).reshape(meta.kv_shape())
        return meta, fp8.dequantize(codes, scales, expect.kv_dtype if expect.kv_dtype in HOST_DTYPE and
                                    expect.kv_dtype != "bfloat16" else "float32")
    return meta, np.frombuffer(payload, HOST_DTYPE[meta.dtype]).reshape(meta.kv_shape())


def corrupt(frames: Sequence[memoryview | bytes], offset: int = 0) -> list[memoryview | bytes]:
    """Fault injection: the same frames with one bit flipped ``offset`` bytes into the payload (into the
    header when there is no payload). Copies only the frame it touches."""
    out = list(frames)
    i = 1 if len(out) > 1 else 0
    if i == 1:
        while offset >= memoryview(out[i]).nbytes and i + 1 < len(out):
            offset -= memoryview(out[i]).nbytes
            i += 1
    else:
        offset = 16 + offset % 8          # a header field: caught by the header checksum
    frame = bytearray(out[i])
    frame[min(offset, len(frame) - 1)] ^= 0x01
    out[i] = frame
    return out
