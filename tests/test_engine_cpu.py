"""The cpu engine does real math over the paged KV pool: chunking, prefix reuse, transfer and batching
must not change a single next token (and logits/KV only at float rounding)."""

from __future__ import annotations

import numpy as np
import pytest

from reference_server.engine import SeqStep, create_engine
from reference_server.engine.vocab import emittable_ids

BS = 16


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return np.random.default_rng(1).integers(0, 100_000, 100).tolist()


def fresh(**kw):
    return create_engine("cpu", block_size=BS, num_blocks=64, **kw)


@pytest.fixture(scope="module")
def one_shot(prompt):
    eng = fresh()
    logits = eng.forward([SeqStep("a", prompt, 0, list(range(7)))])
    return eng, logits


def test_chunked_prefill_equals_one_shot(prompt, one_shot):
    ref_eng, ref_logits = one_shot
    eng = fresh()
    table = [10, 3, 20, 7, 41, 5, 6]  # scattered blocks: the table, not adjacency, defines the sequence
    for start, end in [(0, 37), (37, 70), (70, 100)]:
        logits = eng.forward([SeqStep("a", prompt[start:end], start, table)])
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert logits.argmax() == ref_logits.argmax()
    np.testing.assert_allclose(eng.read_blocks(table), ref_eng.read_blocks(list(range(7))), rtol=1e-5, atol=1e-5)


def test_kv_pool_holds_the_state(prompt, one_shot):
    """Zeroing the cached prefix changes the answer: attention really reads the pool."""
    _, ref_logits = one_shot
    eng = fresh()
    eng.step([SeqStep("a", prompt[:64], 0, list(range(7)))])
    eng.write_blocks([0], np.zeros_like(eng.read_blocks([0])))
    logits = eng.forward([SeqStep("a", prompt[64:], 64, list(range(7)))])
    assert not np.allclose(logits, ref_logits, atol=1e-3)


def test_prefix_reuse_matches_recompute(prompt):
    other = prompt[:64] + np.random.default_rng(2).integers(0, 100_000, 30).tolist()
    shared = fresh()
    shared.step([SeqStep("a", prompt, 0, [0, 1, 2, 3, 4, 5, 6])])
    # the second prompt shares 4 full blocks: only its tail runs, over KV the first one left in the pool
    reused = shared.forward([SeqStep("b", other[64:], 64, [0, 1, 2, 3, 30, 31])])
    recomputed = fresh().forward([SeqStep("b", other, 0, list(range(6)))])
    np.testing.assert_allclose(reused, recomputed, rtol=1e-4, atol=1e-4)
    assert reused.argmax() == recomputed.argmax()


def decode(eng, table, start, first, n):
    out, tok = [], first
    for i in range(n):
        tok = eng.step([SeqStep("s", [tok], start + i, table)])[0]
        out.append(tok)
    return out


def test_decode_after_transfer_continues_identically(prompt, one_shot):
    src = fresh()
    first = src.step([SeqStep("s", prompt, 0, list(range(7)))])[0]
    dst = fresh()
    dst_table = [50, 51, 52, 53, 54, 55, 56, 57]
    dst.write_blocks(dst_table[:7], src.read_blocks(list(range(7))))
    want = decode(src, list(range(8)), len(prompt), first, 12)
    got = decode(dst, dst_table, len(prompt), first, 12)
    assert got == want
    assert len(set(want)) > 1  # the model is not stuck on one token


def test_mixed_batch_equals_separate_steps(prompt):
    a, b = fresh(), fresh()
    a.step([SeqStep("x", prompt[:40], 0, [0, 1, 2])])
    b.step([SeqStep("x", prompt[:40], 0, [0, 1, 2])])
    batch = [SeqStep("x", [prompt[40]], 40, [0, 1, 2]), SeqStep("y", prompt[50:90], 0, [10, 11, 12]),
             SeqStep("z", prompt[:5], 0, [20])]
    together = a.forward(batch)
    apart = np.concatenate([b.forward([s]) for s in batch])
    np.testing.assert_allclose(together, apart, rtol=1e-4, atol=1e-4)
    assert a.step([]) == []


def test_emits_only_decodable_tokens(one_shot):
    eng, logits = one_shot
    allowed = np.zeros(logits.shape[-1], bool)
    allowed[emittable_ids()] = True
    assert np.isneginf(logits[0, ~allowed]).all() and np.isfinite(logits[0, allowed]).all()
    assert eng.shape.vocab_size == 100277


def test_version_tracks_weights():
    assert fresh().shape.version == fresh().shape.version
    assert fresh(seed=1).shape.version != fresh().shape.version
    assert fresh(model="small").shape.version != fresh().shape.version


def test_bad_batches_are_refused(prompt):
    eng = fresh()
    with pytest.raises(ValueError, match="block_table"):
        eng.step([SeqStep("a", prompt, 0, [0, 1])])
    with pytest.raises(ValueError, match="outside the pool"):
        eng.step([SeqStep("a", prompt[:4], 0, [64])])
    with pytest.raises(ValueError, match="does not match"):
        eng.write_blocks([0], np.zeros((1, 2, 1, BS, 2, 32), np.float32))
    with pytest.raises(ValueError, match="unknown"):
        create_engine("gpu", block_size=BS, num_blocks=4)


def test_pool_sized_from_free_device_memory(monkeypatch):
    """On an accelerator the pool takes --gpu-memory-utilization of the device minus what is in use after
    the weights (vLLM's rule); the device's memory report is injected here."""
    from reference_server.engine.backend import Backend

    MiB = 2**20
    monkeypatch.setattr(Backend, "memory", lambda self: (64 * MiB, 100 * MiB))   # free, total
    eng = create_engine("cpu", block_size=BS, num_blocks=None, gpu_memory_utilization=0.9)
    per_block = 2 * 2 * BS * 2 * 32 * 4                                          # tiny, float32
    assert eng.num_blocks == (64 * MiB - int(0.1 * 100 * MiB)) // per_block
    assert create_engine("cpu", block_size=BS, num_blocks=None, kv_budget_bytes=per_block * 5).num_blocks == 5
    with pytest.raises(ValueError, match="no memory left for the KV pool"):
        create_engine("cpu", block_size=BS, num_blocks=None, gpu_memory_utilization=0.3)
