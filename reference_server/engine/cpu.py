"""The ``cpu`` engine: a real transformer (numpy, or torch on cpu/cuda/musa) over a paged KV pool."""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from reference_server.engine.backend import get_backend
from reference_server.engine.base import Engine, ModelShape, SeqStep
from reference_server.engine.batch import check_block_ids, validate_batch
from reference_server.engine.config import get_config
from reference_server.engine.model import SeqPlan, Transformer, weights_version
from reference_server.engine.vocab import emittable_ids, vocab_size


class CpuEngine(Engine):
    """KV pool: one array ``[layers, 2 (K, V), num_blocks, block_size, kv_heads, head_dim]``, i.e. per
    layer a K and a V array ``[num_blocks, block_size, kv_heads, head_dim]``."""

    def __init__(self, *, block_size: int, num_blocks: int, model: str = "tiny", backend: str = "numpy",
                 device: str = "cpu", seed: int = 0, step_slowdown: float = 0.0) -> None:
        if block_size <= 0 or num_blocks <= 0:
            raise ValueError("block_size and num_blocks must be positive")
        self.step_slowdown = step_slowdown   # test hook: burn this fraction more CPU per step (perf gate check)
        self.cfg = cfg = get_config(model)
        self.be = get_backend(backend, device)
        vocab = vocab_size()
        self.model = Transformer(cfg, vocab, seed, self.be, emittable_ids())
        self.block_size, self.num_blocks = block_size, num_blocks
        self.shape = ModelShape(name=cfg.name, version=weights_version(cfg, seed, vocab), layers=cfg.layers,
                                kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, vocab_size=vocab, kv_dtype="float32")
        self.pool = self.be.xp.zeros((cfg.layers, 2, num_blocks, block_size, cfg.kv_heads, cfg.head_dim),
                                     dtype=self.be.float_dtype, **self._device_kw())

    def _device_kw(self) -> dict:
        return {} if self.be.name == "numpy" else {"device": self.be.device}

    def _plan(self, s: SeqStep, row: int) -> SeqPlan:
        bs, n, end = self.block_size, len(s.token_ids), s.start_pos + len(s.token_ids)
        table = np.asarray(s.block_table[:-(-end // bs)], dtype=np.int64)
        pos = np.arange(s.start_pos, end, dtype=np.int64)
        new_slots = table[pos // bs] * bs + pos % bs
        return SeqPlan(row, n, s.start_pos, self.be.asarray(new_slots, index=True), self.be.asarray(table, index=True))

    def forward(self, batch: Sequence[SeqStep]) -> np.ndarray:
        """Logits ``[len(batch), vocab]`` (host numpy) at each item's last new token; writes KV."""
        validate_batch(batch, block_size=self.block_size, num_blocks=self.num_blocks, vocab=self.shape.vocab_size)
        tokens = np.concatenate([np.asarray(s.token_ids, dtype=np.int64) for s in batch])
        positions = np.concatenate([np.arange(s.start_pos, s.start_pos + len(s.token_ids)) for s in batch])
        plans, row = [], 0
        for s in batch:
            plans.append(self._plan(s, row))
            row += len(s.token_ids)
        return self.be.to_numpy(self.model.forward(tokens, positions, plans, self.pool))

    def step(self, batch: Sequence[SeqStep]) -> list[int]:
        if not batch:
            return []
        c0 = time.process_time()
        tokens = [int(t) for t in np.argmax(self.forward(batch), axis=-1)]
        if self.step_slowdown > 0:    # spin: as if the math took that much more CPU
            end = time.process_time() + self.step_slowdown * (time.process_time() - c0)
            while time.process_time() < end:
                pass
        return tokens

    def read_blocks(self, block_ids: Sequence[int]) -> np.ndarray:
        """A host (numpy) copy ``[layers, 2, n, block_size, kv_heads, head_dim]``: the bytes a transfer moves."""
        check_block_ids(block_ids, self.num_blocks)
        idx = self.be.asarray(np.asarray(block_ids, dtype=np.int64), index=True)
        return np.ascontiguousarray(self.be.to_numpy(self.pool[:, :, idx]))

    def write_blocks(self, block_ids: Sequence[int], kv: Any) -> None:
        check_block_ids(block_ids, self.num_blocks)
        c = self.cfg
        want = (c.layers, 2, len(block_ids), self.block_size, c.kv_heads, c.head_dim)
        if tuple(kv.shape) != want:
            raise ValueError(f"KV shape {tuple(kv.shape)} does not match this engine's {want}")
        idx = self.be.asarray(np.asarray(block_ids, dtype=np.int64), index=True)
        self.pool[:, :, idx] = self.be.asarray(np.asarray(kv) if self.be.name == "numpy" else kv)
