"""Checks every engine applies to a step's batch, so cpu and sim reject the same mistakes."""

from __future__ import annotations

from typing import Sequence

from reference_server.engine.base import SeqStep


def validate_batch(batch: Sequence[SeqStep], *, block_size: int, num_blocks: int, vocab: int) -> None:
    """Raise ``ValueError`` naming the sequence when its block table cannot hold its tokens."""
    for s in batch:
        n = len(s.token_ids)
        if n == 0:
            raise ValueError(f"seq {s.seq_id}: empty token_ids")
        if s.start_pos < 0:
            raise ValueError(f"seq {s.seq_id}: negative start_pos {s.start_pos}")
        need = -(-(s.start_pos + n) // block_size)
        if len(s.block_table) < need:
            raise ValueError(f"seq {s.seq_id}: block_table has {len(s.block_table)} blocks, "
                             f"positions [0, {s.start_pos + n}) need {need} of {block_size} tokens")
        for b in s.block_table[:need]:
            if not 0 <= b < num_blocks:
                raise ValueError(f"seq {s.seq_id}: block id {b} outside the pool [0, {num_blocks})")
        if min(s.token_ids) < 0 or max(s.token_ids) >= vocab:
            raise ValueError(f"seq {s.seq_id}: token id outside the vocabulary [0, {vocab})")


def check_block_ids(block_ids: Sequence[int], num_blocks: int) -> None:
    bad = [b for b in block_ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"block ids {bad[:5]} outside the pool [0, {num_blocks})")
