"""KV wire format: exact round trips, FP8 closeness, and every integrity failure detected by kind."""

import dataclasses

import numpy as np
import pytest

from reference_server.engine.base import ModelShape, VirtualKV
from reference_server.kv import fp8
from reference_server.kv.codec import (KVIntegrityError, TransferMeta, corrupt, decode, encode, frames_nbytes, message_len,
                                       payload_len)

SHAPE32 = ModelShape("tiny", "v1", layers=2, kv_heads=2, head_dim=16, vocab_size=1000, kv_dtype="float32")
BS = 8


def kv_for(shape, n_blocks=3, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((shape.layers, 2, n_blocks, BS, shape.kv_heads, shape.head_dim)) * 2).astype(shape.kv_dtype)


def meta_for(shape, n_blocks=3, dtype=None, **kw):
    return TransferMeta.for_shape("req-1", shape, block_size=BS, n_blocks=n_blocks, num_tokens=n_blocks * BS - 3,
                                  dtype=dtype, **kw)


def wire(frames):
    return bytearray(b"".join(bytes(f) for f in frames))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_raw_round_trip_is_exact_and_zero_copy(dtype):
    shape = dataclasses.replace(SHAPE32, kv_dtype=dtype)
    kv = kv_for(shape)
    meta = meta_for(shape, start_block=4)
    buf = wire(encode(meta, kv))
    assert message_len(buf) == len(buf)
    got_meta, got = decode(buf, expect=shape, block_size=BS)
    assert got_meta == meta
    assert got.dtype == kv.dtype and np.array_equal(got, kv)
    assert np.shares_memory(got, np.frombuffer(buf, np.uint8))   # a view, not a copy


def test_fp8_round_trip_is_close_and_a_quarter_of_fp32():
    kv = kv_for(SHAPE32, n_blocks=4)
    kv[1, 0] *= 50                     # a layer with much larger K: per-block scales keep the rest precise
    raw = frames_nbytes(encode(meta_for(SHAPE32, 4), kv))
    frames = encode(meta_for(SHAPE32, 4, dtype="fp8_e4m3"), kv)
    small = frames_nbytes(frames)
    meta, got = decode(wire(frames), expect=SHAPE32, block_size=BS)
    assert meta.dtype == "fp8_e4m3" and got.dtype == np.float32 and got.shape == kv.shape
    header = 128
    assert (small - header) < (raw - header) / 3.8           # 1 byte/elem + scales vs 4 bytes/elem
    # e4m3 has 3 mantissa bits: relative rounding error <= 2**-4 for normal values; the error of each
    # element is at most half a step at its block's scale.
    rel_rms = np.sqrt(np.mean((got - kv) ** 2) / np.mean(kv ** 2))
    assert rel_rms < 0.04
    scales = fp8.block_scales(kv)[:, :, :, None, None, None]
    assert np.all(np.abs(got - kv) <= np.maximum(np.abs(kv) * 2.0 ** -4, scales * 2.0 ** -10) + 1e-6)
    assert np.array_equal(np.sign(got[np.abs(kv) > scales * 2.0 ** -9]), np.sign(kv[np.abs(kv) > scales * 2.0 ** -9]))


def test_fp8_dequantizes_into_a_float16_pool():
    kv = kv_for(SHAPE32)
    shape16 = dataclasses.replace(SHAPE32, kv_dtype="float16")
    _, got = decode(wire(encode(meta_for(SHAPE32, dtype="fp8_e4m3"), kv)), expect=shape16)
    assert got.dtype == np.float16 and np.allclose(got, kv, rtol=0.07, atol=0.05)


def test_e4m3_codes_match_the_format():
    table = fp8.DECODE_TABLE
    assert table[0x7E] == 448 and table[0x08] == 2.0 ** -6 and table[0x01] == 2.0 ** -9 and table[0xB8] == -1.0
    finite = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    assert np.array_equal(fp8.to_e4m3(table[finite])[finite != 0x80], finite[finite != 0x80])
    mids = np.sort(table[:0x7F])
    mids = ((mids[:-1].astype(np.float64) + mids[1:]) / 2).astype(np.float32)
    assert np.all(fp8.to_e4m3(mids) & 1 == 0)                 # ties to even
    assert table[fp8.to_e4m3(np.float32([1000.0, -1e-9]))].tolist() == [448.0, 0.0]


def test_virtual_kv_moves_header_only():
    vkv = VirtualKV(n_blocks=100, nbytes=100 * BS * SHAPE32.kv_bytes_per_token())
    frames = encode(meta_for(SHAPE32, 100), vkv)
    assert len(frames) == 1 and frames_nbytes(frames) <= 128
    meta, got = decode(wire(frames), expect=SHAPE32, block_size=BS)
    assert got == vkv and meta.n_blocks == 100 and message_len(wire(frames)) == frames_nbytes(frames)
    assert payload_len(wire(frames)) == vkv.nbytes


def test_virtual_kv_over_fp8_declares_fp8_bytes_but_fills_the_pool_size():
    vkv = VirtualKV(n_blocks=10, nbytes=10 * BS * SHAPE32.kv_bytes_per_token())
    meta = meta_for(SHAPE32, 10, dtype="fp8_e4m3")
    buf = wire(encode(meta, vkv))
    assert payload_len(buf) == vkv.nbytes // 4 + 4 * 2 * 2 * 10      # 1 byte/elem + per-block scales
    assert decode(buf, expect=SHAPE32)[1] == vkv


def test_corrupt_helper_hits_payload_or_header():
    frames = encode(meta_for(SHAPE32), kv_for(SHAPE32))
    for off in (0, 10**9):                                  # far past the end clamps to the last byte
        with pytest.raises(KVIntegrityError, match="payload checksum"):
            decode(wire(corrupt(frames, off)), expect=SHAPE32)
    vframes = encode(meta_for(SHAPE32, 2), VirtualKV(2, 2 * BS * SHAPE32.kv_bytes_per_token()))
    with pytest.raises(KVIntegrityError, match="header checksum"):
        decode(wire(corrupt(vframes, 3)), expect=SHAPE32)
    assert bytes(frames[1]) == bytes(encode(meta_for(SHAPE32), kv_for(SHAPE32))[1])   # original untouched


def test_flipped_payload_byte_is_a_checksum_failure():
    buf = wire(encode(meta_for(SHAPE32), kv_for(SHAPE32)))
    for pos in (200, len(buf) - 1):
        bad = bytearray(buf)
        bad[pos] ^= 0x01
        with pytest.raises(KVIntegrityError) as e:
            decode(bad, expect=SHAPE32)
        assert e.value.reason == "checksum"


def test_flipped_header_byte_is_detected():
    buf = wire(encode(meta_for(SHAPE32), kv_for(SHAPE32)))
    for pos in (30, 70):                       # n_blocks field; request id string
        bad = bytearray(buf)
        bad[pos] ^= 0x04
        with pytest.raises(KVIntegrityError) as e:
            decode(bad, expect=SHAPE32)
        assert e.value.reason == "checksum"
    bad = bytearray(buf)
    bad[0] = ord("X")
    with pytest.raises(KVIntegrityError) as e:
        decode(bad, expect=SHAPE32)
    assert e.value.reason == "format"


@pytest.mark.parametrize("cut", [10, 100, -1])
def test_truncated(cut):
    buf = wire(encode(meta_for(SHAPE32), kv_for(SHAPE32)))
    with pytest.raises(KVIntegrityError) as e:
        decode(buf[:cut], expect=SHAPE32)
    assert e.value.reason == "truncated"


@pytest.mark.parametrize("change, reason", [
    (dict(version="v2"), "model"),
    (dict(name="other"), "model"),
    (dict(layers=3), "shape"),
    (dict(kv_heads=4), "shape"),
    (dict(head_dim=8), "shape"),
    (dict(kv_dtype="float16"), "dtype"),
])
def test_receiver_mismatch(change, reason):
    buf = wire(encode(meta_for(SHAPE32), kv_for(SHAPE32)))
    with pytest.raises(KVIntegrityError) as e:
        decode(buf, expect=dataclasses.replace(SHAPE32, **change))
    assert e.value.reason == reason


def test_block_size_mismatch_is_a_shape_failure():
    buf = wire(encode(meta_for(SHAPE32), kv_for(SHAPE32)))
    with pytest.raises(KVIntegrityError) as e:
        decode(buf, expect=SHAPE32, block_size=16)
    assert e.value.reason == "shape"


def test_encode_rejects_inconsistent_input():
    with pytest.raises(ValueError):
        encode(meta_for(SHAPE32, n_blocks=2), kv_for(SHAPE32, n_blocks=3))
    with pytest.raises(ValueError):
        encode(meta_for(SHAPE32, dtype="float16"), kv_for(SHAPE32))
    with pytest.raises(ValueError, match="bfloat16"):
        encode(meta_for(SHAPE32, dtype="bfloat16"), kv_for(SHAPE32))


@pytest.mark.parametrize("dtype", [None, "fp8_e4m3"])
def test_any_single_bit_flip_anywhere_is_refused(dtype):
    """Never garbage: a flipped bit at any position of the message (header, scales, KV) is refused."""
    buf = wire(encode(meta_for(SHAPE32, dtype=dtype), kv_for(SHAPE32)))
    rng = np.random.default_rng(1)
    positions = list(range(0, 128)) + rng.integers(128, len(buf), 200).tolist()
    for pos in positions:
        bad = bytearray(buf)
        bad[pos] ^= 1 << int(rng.integers(8))
        with pytest.raises(KVIntegrityError):
            decode(bad, expect=SHAPE32, block_size=BS)
