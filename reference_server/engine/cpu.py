"""The ``cpu`` engine: a real transformer (numpy, or torch on cpu/cuda/musa) over a paged KV pool.

Despite the name (kept: it is the CLI's ``--engine cpu``), the torch backend runs it on a GPU: bf16
weights and activations there (float32 on a CPU), a bfloat16 or FP8 KV pool sized from the memory
left after the weights, batched attention, and a greedy argmax on the device, so only the step's
token ids reach the host. Weights are the built-in random ``tiny``/``small`` or a Hugging Face
checkpoint directory (:mod:`.checkpoint`).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from reference_server.engine.backend import get_backend
from reference_server.engine.base import Engine, ModelShape, SeqStep
from reference_server.engine.batch import check_block_ids, validate_batch
from reference_server.engine.config import get_config
from reference_server.engine.model import Transformer, init_weights, weights_version
from reference_server.engine.paged import KVPool, make_plan, resolve_kv_dtype
from reference_server.engine.vocab import checkpoint_emittable, emittable_ids, vocab_size

DEFAULT_CPU_KV_BYTES = 256 << 20


class CpuEngine(Engine):
    """KV pool: ``[layers, 2 (K, V), num_blocks, block_size, kv_heads, head_dim]`` (:mod:`.paged`)."""

    def __init__(self, *, block_size: int, num_blocks: int | None, model: str = "tiny", backend: str = "numpy",
                 device: str = "cpu", seed: int = 0, dtype: str = "auto", kv_dtype: str = "auto",
                 kv_budget_bytes: int | None = None, gpu_memory_utilization: float = 0.9,
                 step_slowdown: float = 0.0) -> None:
        """``num_blocks=None``: as many blocks as ``kv_budget_bytes`` hold, else (on an accelerator)
        ``gpu_memory_utilization`` of the device's memory minus what is in use after the weights,
        else 256 MiB."""
        if block_size <= 0 or (num_blocks is not None and num_blocks <= 0):
            raise ValueError("block_size and num_blocks must be positive")
        self.step_slowdown = step_slowdown   # test hook: burn this fraction more CPU per step (perf gate check)
        self.be = be = get_backend(backend, device, dtype)
        from reference_server.engine.checkpoint import is_checkpoint, load_checkpoint, load_weights, rope_inv_freq

        if is_checkpoint(model):
            ckpt = load_checkpoint(model)
            self.cfg = cfg = ckpt.config
            vocab, version = int(cfg.vocab or 0), ckpt.version
            weights, emit = load_weights(ckpt, be), checkpoint_emittable(model, vocab)
            inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, ckpt.rope_scaling)
        else:
            self.cfg = cfg = get_config(model)
            vocab = vocab_size()
            version = weights_version(cfg, seed, vocab)
            weights, emit = init_weights(cfg, vocab, seed), emittable_ids()
            inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, None)
        self.model = Transformer(cfg, weights, be, emit, inv_freq)
        del weights
        self.kv_dtype = kv = resolve_kv_dtype(kv_dtype, be)
        per_block = KVPool.bytes_per_block((cfg.layers, block_size, cfg.kv_heads, cfg.head_dim), kv)
        if num_blocks is None:
            num_blocks = max(2, self._kv_budget(kv_budget_bytes, gpu_memory_utilization) // per_block)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.shape = ModelShape(name=cfg.name, version=version, layers=cfg.layers, kv_heads=cfg.kv_heads,
                                head_dim=cfg.head_dim, vocab_size=vocab, kv_dtype=kv)
        self.pool = KVPool(be, (cfg.layers, num_blocks, block_size, cfg.kv_heads, cfg.head_dim), kv)

    def _kv_budget(self, budget: int | None, utilization: float) -> int:
        if budget is not None:
            return budget
        mem = self.be.memory()
        if mem is None:
            return DEFAULT_CPU_KV_BYTES
        free, total = mem
        # vLLM's rule: the pool takes what is left of utilization x total once the weights are in
        left = int(free - (1.0 - utilization) * total)
        if left <= 0:
            raise ValueError(f"{self.be.device}: no memory left for the KV pool after the weights "
                             f"({free / 2**30:.1f} GiB free of {total / 2**30:.1f}; --gpu-memory-utilization {utilization})")
        return left

    def _logits(self, batch: Sequence[SeqStep]) -> Any:
        validate_batch(batch, block_size=self.block_size, num_blocks=self.num_blocks, vocab=self.shape.vocab_size)
        plan = make_plan(self.be, batch, self.block_size, fp8=self.pool.fp8, batched_decode=self.model.batched)
        return self.model.forward(plan, self.pool)

    def forward(self, batch: Sequence[SeqStep]) -> np.ndarray:
        """Logits ``[len(batch), vocab]`` (host numpy, float32) at each item's last new token; writes KV."""
        return self.be.to_numpy(self._logits(batch)).astype(np.float32, copy=False)

    def step(self, batch: Sequence[SeqStep]) -> list[int]:
        """Greedy next tokens; the argmax runs on the device and only the ids come back (which also
        waits for the step: the caller's clock after this call measures finished work)."""
        if not batch:
            return []
        c0 = time.process_time()
        ids = self.be.xp.argmax(self._logits(batch), axis=-1)
        tokens = [int(t) for t in self.be.to_numpy(ids)]
        if self.step_slowdown > 0:    # spin: as if the math took that much more CPU
            end = time.process_time() + self.step_slowdown * (time.process_time() - c0)
            while time.process_time() < end:
                pass
        return tokens

    def read_blocks(self, block_ids: Sequence[int]) -> np.ndarray:
        """A host copy ``[layers, 2, n, block_size, kv_heads, head_dim]``: the bytes a transfer moves
        (float32; bfloat16 as uint16 bits; an FP8 pool dequantized to float32)."""
        check_block_ids(block_ids, self.num_blocks)
        return self.pool.read(block_ids)

    def read_blocks_into(self, block_ids: Sequence[int], out: Any) -> None:
        check_block_ids(block_ids, self.num_blocks)
        self.pool.read_into(block_ids, out)

    def write_blocks(self, block_ids: Sequence[int], kv: Any) -> None:
        check_block_ids(block_ids, self.num_blocks)
        c = self.cfg
        want = (c.layers, 2, len(block_ids), self.block_size, c.kv_heads, c.head_dim)
        if tuple(kv.shape) != want:
            raise ValueError(f"KV shape {tuple(kv.shape)} does not match this engine's {want}")
        self.pool.install(block_ids, np.asarray(kv))
