"""One model implementation: numpy (the reference, per-sequence attention) and torch (batched SDPA
attention, argmax on the device) must agree; bf16 and FP8 KV pools and the host staging of KV are
checked on a CPU with torch (FP8 e4m3 is a real torch dtype there). Skipped without torch."""

from __future__ import annotations

import json

import numpy as np
import pytest

from reference_server.engine import SeqStep, create_engine
from reference_server.kv import codec
from tests.test_engine_cpu import decode

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.torch


def test_numpy_and_torch_cpu_agree():
    prompt = np.random.default_rng(3).integers(0, 100_000, 300).tolist()
    engines = [create_engine("cpu", block_size=32, num_blocks=16, backend=b) for b in ("numpy", "torch")]
    assert engines[0].shape == engines[1].shape
    outs = []
    for eng in engines:
        logits = eng.forward([SeqStep("a", prompt[:200], 0, list(range(10))), SeqStep("b", prompt[200:], 0, [12, 13, 14, 15])])
        toks = [int(t) for t in logits.argmax(-1)]
        tok = toks[0]
        for i in range(5):
            tok = eng.step([SeqStep("a", [tok], 200 + i, list(range(10)))])[0]
            toks.append(tok)
        outs.append((logits, toks, eng.read_blocks([0, 12])))
    (ln, tn, kn), (lt, tt, kt) = outs
    finite = np.isfinite(ln)
    np.testing.assert_allclose(ln[finite], lt[finite], rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(kn, kt, rtol=1e-4, atol=1e-4)
    assert tn == tt


def _mixed_run(eng, prompts):
    """Prefill three sequences, then steps mixing a prefix-continued chunk with batched decodes of
    different context lengths (a decode item in the middle of the batch)."""
    tables = {"a": [0, 1, 2, 3], "b": [8, 9, 10, 11, 12, 13], "c": [20, 21, 22]}
    lens = {"a": 30, "b": 70, "c": 5}
    first = eng.forward([SeqStep(s, prompts[s][:lens[s]], 0, tables[s]) for s in "abc"])
    last = {s: int(t) for s, t in zip("abc", first.argmax(-1))}
    logits = [first]
    for _ in range(3):
        batch = [SeqStep("a", [last["a"]], lens["a"], tables["a"]),
                 SeqStep("c", prompts["c"][lens["c"]:lens["c"] + 9], lens["c"], tables["c"]),  # chunk after a prefix
                 SeqStep("b", [last["b"]], lens["b"], tables["b"])]
        out = eng.forward(batch)
        logits.append(out)
        lens["a"] += 1
        lens["b"] += 1
        lens["c"] += 9
        last["a"], last["b"] = int(out[0].argmax()), int(out[2].argmax())
    return np.concatenate(logits)


def test_batched_attention_matches_numpy_engine():
    rng = np.random.default_rng(7)
    prompts = {s: rng.integers(0, 100_000, 120).tolist() for s in "abc"}
    ref = _mixed_run(create_engine("cpu", block_size=16, num_blocks=32), prompts)
    eng = create_engine("cpu", block_size=16, num_blocks=32, backend="torch")
    assert eng.model.batched
    got = _mixed_run(eng, prompts)
    finite = np.isfinite(ref)
    np.testing.assert_allclose(got[finite], ref[finite], rtol=1e-3, atol=1e-3)
    assert (got.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("kv_dtype,tol", [("bfloat16", 0.03), ("fp8_e4m3", 0.15)])
def test_low_precision_kv_pool_and_transfer(kv_dtype, tol):
    """A bf16 / FP8 pool stays close to float32, and its blocks cross the wire (codec, checksums) into a
    second engine that then decodes exactly like the sender."""
    prompt = np.random.default_rng(5).integers(0, 100_000, 90).tolist()
    ref = create_engine("cpu", block_size=16, num_blocks=16, backend="torch")
    want = ref.forward([SeqStep("s", prompt, 0, list(range(6)))])[0]
    src = create_engine("cpu", block_size=16, num_blocks=16, backend="torch", kv_dtype=kv_dtype)
    assert src.shape.kv_dtype == kv_dtype
    got = src.forward([SeqStep("s", prompt, 0, list(range(6)))])[0]
    finite = np.isfinite(want)
    err = np.abs(got[finite] - want[finite]).max() / np.abs(want[finite]).max()
    assert 0 < err < tol, err      # not float32 (so the pool really is low precision), yet close
    first = int(got.argmax())
    kv = src.read_blocks(list(range(6)))
    meta = codec.TransferMeta.for_shape("s", src.shape, block_size=16, n_blocks=6, num_tokens=90)
    frames = codec.encode(meta, kv)
    _, received = codec.decode(b"".join(bytes(f) for f in frames), expect=src.shape, block_size=16)
    dst = create_engine("cpu", block_size=16, num_blocks=16, backend="torch", kv_dtype=kv_dtype)
    dst_table = [9, 3, 12, 4, 15, 7, 1]
    dst.write_blocks(dst_table[:6], received)
    if kv_dtype == "bfloat16":      # raw 16-bit patterns on the wire: bit-exact
        assert kv.dtype == np.uint16 and (dst.read_blocks(dst_table[:6]) == kv).all()
    else:                           # the codec's per-block FP8 re-encodes the pool's own codes
        np.testing.assert_allclose(dst.read_blocks(dst_table[:6]), kv, rtol=0.07, atol=1e-6)
    want_tokens = decode(src, list(range(7)), 90, first, 6)
    assert decode(dst, dst_table, 90, first, 6) == want_tokens


def test_fp8_pool_scales_follow_block_contents():
    """Decode writes one token at a time into a block: its scale grows with the contents, and a block
    reused from a previous owner starts clean (a stale large value must not set its scale)."""
    eng = create_engine("cpu", block_size=8, num_blocks=4, backend="torch", kv_dtype="fp8_e4m3")
    pool = eng.pool
    pool.data.fill_(0)
    pool.install([1], np.full((2, 2, 1, 8, 2, 32), 1000.0, np.float32))     # a previous owner's big values
    eng.step([SeqStep("s", [11, 12, 13], 0, [1])])
    after_prefill = pool.scales[:, :, 1].clone()
    assert (after_prefill < 1000.0 / 448).all()             # cleared: the stale 1000s did not set it
    k0 = eng.read_blocks([1])[:, :, 0, :3].copy()
    eng.step([SeqStep("s", [14], 3, [1])])
    np.testing.assert_allclose(eng.read_blocks([1])[:, :, 0, :3], k0, rtol=0.07, atol=1e-3)  # prefix kept
    assert (pool.scales[:, :, 1] >= after_prefill).all()


def test_bf16_compute_on_cpu():
    """--dtype bfloat16 (the GPU default) runs the same model in bf16: logits track float32's."""
    prompt = np.random.default_rng(9).integers(0, 100_000, 64).tolist()
    f32 = create_engine("cpu", block_size=16, num_blocks=8, backend="torch").forward([SeqStep("s", prompt, 0, list(range(4)))])
    eng = create_engine("cpu", block_size=16, num_blocks=8, backend="torch", dtype="bfloat16")
    assert eng.shape.kv_dtype == "bfloat16" and eng.model.w["embed"].dtype == torch.bfloat16
    bf = eng.forward([SeqStep("s", prompt, 0, list(range(4)))])
    finite = np.isfinite(f32)
    assert np.corrcoef(bf[finite], f32[finite])[0, 1] > 0.99


def test_checkpoint_on_torch_matches_reference(tmp_path):
    from tests.checkpoint_fixture import make_checkpoint, reference_logits

    t = make_checkpoint(tmp_path, "qwen3", shards=2)
    cfg = json.loads((tmp_path / "config.json").read_text())
    prompt = [5, 17, 123, 4, 250, 9, 77, 31, 200, 11]
    eng = create_engine("cpu", block_size=4, num_blocks=8, model=str(tmp_path), backend="torch")
    got = eng.forward([SeqStep("a", prompt, 0, [7, 6, 5])])[0]
    np.testing.assert_allclose(got, reference_logits(t, cfg, prompt)[-1], rtol=2e-4, atol=2e-4)


def test_host_staging_round_trips():
    from reference_server.kv.staging import to_device, to_host

    x = torch.randn(2, 2, 3, 4, 2, 8)
    for t in (x, x.to(torch.bfloat16)):
        host = to_host(t)
        assert host.dtype == (np.uint16 if t.dtype == torch.bfloat16 else np.float32)
        back = to_device(host, "cpu")
        assert back.dtype == t.dtype and torch.equal(back, t)
        assert host.ctypes.data != t.data_ptr()      # a copy, not a view into the pool


def test_unknown_device_is_a_clear_error():
    with pytest.raises(ValueError, match="device"):
        create_engine("cpu", block_size=8, num_blocks=2, backend="torch", device="tpu")
    with pytest.raises(ValueError, match="numpy"):
        create_engine("cpu", block_size=8, num_blocks=2, backend="numpy", device="cuda")
    with pytest.raises(ValueError, match="needs --backend torch"):
        create_engine("cpu", block_size=8, num_blocks=2, kv_dtype="fp8_e4m3")
