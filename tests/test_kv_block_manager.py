"""Prefix cache acceptance: hits are full blocks, tenant- and model-scoped, LRU-evicted, never while in use."""

import array
import random

import pytest

from reference_server.engine.base import ModelShape
from reference_server.kv.block_manager import BlockManager, NoFreeBlocks, blocks_for_budget

B = 512


def prompt(n, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(100_000) for _ in range(n)]


def run_prefill(bm, seq_id, tenant, toks):
    """What a worker does: allocate, (compute), commit the prompt's KV, finish."""
    a = bm.allocate(seq_id, tenant, toks)
    bm.commit(seq_id, toks)
    bm.free(seq_id)
    return a


def test_repeated_8k_prompt_reuses_all_but_the_last_block():
    bm = BlockManager(64, B, "tiny@v1")
    p = prompt(8192)
    first = run_prefill(bm, "a", "t", p)
    assert first.cached_tokens == 0 and len(first.block_table) == 16
    assert bm.match_prefix("t", p) == 7680          # (8192 - 1) // 512 = 15 full blocks
    second = bm.allocate("b", "t", p)
    assert second.cached_tokens == 7680
    assert second.block_table[:15] == first.block_table[:15]
    # One token past a block boundary: every full block is reusable.
    assert bm.match_prefix("t", p + [7]) == 8192
    assert bm.stats.queries == 2 and bm.stats.hits == 1 and bm.stats.misses == 1
    assert bm.stats.hit_tokens == 7680 and bm.stats.query_tokens == 16384


def test_ninety_percent_shared_prompt_reuses_block_rounded_share():
    bm = BlockManager(64, B, "tiny@v1")
    base = prompt(8192, seed=1)
    run_prefill(bm, "a", "t", base)
    shared = int(8192 * 0.9)                           # 7372 tokens shared -> 14 full blocks (7168)
    other = base[:shared] + prompt(8192 - shared, seed=2)
    assert bm.allocate("b", "t", other).cached_tokens == (shared // B) * B == 7168


def test_other_tenant_and_other_model_version_get_nothing():
    bm = BlockManager(64, B, "tiny@v1")
    p = prompt(4096, seed=3)
    run_prefill(bm, "a", "alice", p)
    assert bm.match_prefix("alice", p) == 3584
    assert bm.match_prefix("bob", p) == 0
    assert bm.allocate("b", "bob", p).cached_tokens == 0
    bm.free("b")
    bm.reset("tiny@v2")
    assert bm.match_prefix("alice", p) == 0
    assert bm.allocate("c", "alice", p).cached_tokens == 0


def test_reset_does_not_register_stale_running_sequence():
    bm = BlockManager(16, B, "m@v1")
    p = prompt(2048, seed=4)
    bm.allocate("a", "t", p)
    bm.reset("m@v2")
    bm.commit("a", p)                                   # KV computed by the old model
    bm.free("a")
    assert bm.match_prefix("t", p + [1]) == 0
    assert bm.num_free_blocks() == 16


def test_lru_evicts_least_recently_released_first():
    bm = BlockManager(5, B, "m")
    pa, pb, pc = prompt(2 * B, 10), prompt(2 * B, 11), prompt(3 * B, 12)
    run_prefill(bm, "a", "t", pa)                     # released first -> oldest
    run_prefill(bm, "b", "t", pb)
    run_prefill(bm, "a2", "t", pa + [1])              # touch A (uses the last free block): B is now LRU
    assert bm.stats.evictions == 0
    assert bm.match_prefix("t", pa + [1]) == 2 * B and bm.match_prefix("t", pb + [1]) == 2 * B
    run_prefill(bm, "c", "t", pc)                     # 3 blocks: the free one + B's two evicted
    assert bm.stats.evictions == 2
    assert bm.match_prefix("t", pa + [1]) == 2 * B
    assert bm.match_prefix("t", pb + [1]) == 0
    assert bm.match_prefix("t", pc + [1]) == 3 * B


def test_eviction_takes_the_tail_of_a_prefix_first():
    bm = BlockManager(3, B, "m")
    pa = prompt(2 * B, 13)
    run_prefill(bm, "a", "t", pa)
    run_prefill(bm, "x", "t", prompt(2 * B, 14))      # 1 free + 1 evicted: A's second block, not its first
    assert bm.match_prefix("t", pa + [1]) == B


def test_in_use_blocks_are_never_evicted_and_full_pool_raises_without_side_effects():
    bm = BlockManager(4, B, "m")
    p = prompt(3 * B, 20)
    a = bm.allocate("a", "t", p)
    bm.commit("a", p)                                 # registered but still referenced
    with pytest.raises(NoFreeBlocks):
        bm.allocate("b", "t", prompt(2 * B, 21))
    assert (bm.usage(), bm.num_free_blocks()) == (0.75, 1)
    assert bm.stats.queries == 1
    # A sharer of the in-use prefix still fits: it needs only one fresh block.
    b = bm.allocate("b", "t", p[:2 * B] + [5])
    assert b.cached_tokens == 2 * B and b.block_table[:2] == a.block_table[:2]
    bm.free("a")
    bm.free("b")
    assert bm.usage() == 0.0


def test_ensure_capacity_grows_for_decode_and_commit_registers_decoded_blocks():
    bm = BlockManager(8, 4, "m")
    toks = [1, 2, 3, 4, 5, 6]
    a = bm.allocate("s", "t", toks)
    assert len(a.block_table) == 2
    table = bm.ensure_capacity("s", 9)
    assert len(table) == 3 and table[:2] == a.block_table
    assert bm.ensure_capacity("s", 9) == table         # idempotent
    decoded = toks + [7, 8, 9]
    assert bm.commit("s", decoded[:8]) == 2           # KV exists for 8 tokens: 2 full blocks
    bm.free("s")
    assert bm.match_prefix("t", decoded) == 8
    with pytest.raises(NoFreeBlocks):
        bm.allocate("x", "t", list(range(100)))


def test_identical_concurrent_prompts_keep_one_canonical_copy():
    bm = BlockManager(8, 4, "m")
    p = list(range(9))
    a = bm.allocate("a", "t", p)
    b = bm.allocate("b", "t", p)                      # both miss: nothing committed yet
    assert a.cached_tokens == b.cached_tokens == 0
    bm.commit("a", p)
    bm.commit("b", p)
    bm.free("b")
    bm.free("a")
    c = bm.allocate("c", "t", p)
    assert c.cached_tokens == 8 and c.block_table[:2] == a.block_table[:2]


def test_blocks_for_budget():
    shape = ModelShape("tiny", "1", layers=2, kv_heads=2, head_dim=16, vocab_size=100, kv_dtype="float32")
    assert shape.kv_bytes_per_token() == 512
    assert blocks_for_budget(64 * 2**20, shape, 512) == 256


def test_list_and_numpy_token_ids_hash_alike():
    import numpy as np

    bm = BlockManager(16, 4, "m")
    toks = list(range(40))
    run_prefill(bm, "a", "t", toks)
    assert bm.match_prefix("t", np.arange(41)) == 40
    assert bm.match_prefix("t", np.arange(41, dtype=np.int32)) == 40


def test_block_hash_is_sha256_by_default_and_xxh3_on_request():
    import hashlib

    import xxhash

    toks = list(range(8))
    root = hashlib.sha256(b"m\x00t").digest()[:16]
    block = hashlib.sha256(root + array.array("q", toks[:4]).tobytes()).digest()[:16]
    assert BlockManager(4, 4, "m").hashes("t", toks) == [block]          # (8 - 1) // 4 = 1 reusable block
    fast = BlockManager(4, 4, "m", hash_algo="xxh3").hashes("t", toks)
    assert fast == [xxhash.xxh3_128(xxhash.xxh3_128(b"m\x00t").digest() + array.array("q", toks[:4]).tobytes()).digest()]
    with pytest.raises(ValueError, match="unknown block hash"):
        BlockManager(4, 4, "m", hash_algo="md5")


def test_a_hash_collision_is_a_miss_not_another_prompts_kv(monkeypatch):
    import hashlib

    from reference_server.kv import block_manager

    # A hash that ignores the tokens: every prompt of the same length collides block for block.
    monkeypatch.setattr(block_manager, "_digest", lambda algo, *parts: hashlib.sha256(parts[0] if parts else b"").digest()[:16])
    bm = BlockManager(16, 4, "m")
    run_prefill(bm, "a", "t", list(range(100, 117)))
    other = list(range(500, 517))
    assert bm.match_prefix("t", other) == 0                    # before: 16 (four blocks of another prompt)
    assert bm.allocate("b", "t", other).cached_tokens == 0
    assert bm.match_prefix("t", list(range(100, 117))) == 16   # the real prefix still hits


def test_lookup_is_the_local_match_plus_the_store_keys_in_one_pass():
    bm = BlockManager(64, B, "tiny@v1")
    head = prompt(3 * B, seed=4)
    run_prefill(bm, "a", "t", head)
    p = head + prompt(4 * B, seed=5)
    hit, hashes = bm.lookup("t", p)
    assert hit == bm.match_prefix("t", p) == 3 * B
    assert hashes == bm.hashes("t", p) and len(hashes) == (len(p) - 1) // B      # the store's keys for all of it
    assert bm.lookup("u", p)[0] == 0 and bm.lookup("u", p)[1] != hashes          # another tenant: other keys
    assert bm.stats.queries == 1                                                  # no side effects


def test_reuse_shortfall_recomputes_the_last_matched_blocks():
    """The perf gate's real-path regression (--debug-reuse-shortfall): 4 blocks of 4 tokens + 1 cached, a repeat
    matches 4 blocks (16 tokens) but reuses 3 (12): the engine must compute 17 - 12 = 5 tokens, not 1."""
    prompt = list(range(17))
    for shortfall, cached in ((0, 16), (1, 12), (5, 0)):
        bm = BlockManager(16, 4, "tiny@v1", reuse_shortfall=shortfall)
        bm.allocate("a", "t", prompt)
        bm.commit("a", prompt)
        bm.free("a")
        assert bm.match_prefix("t", prompt) == 16            # the cache holds all four blocks either way
        assert bm.allocate("b", "t", prompt).cached_tokens == cached
        assert bm.stats.hit_tokens == cached                 # the hit the server reports is what it reused
