"""The one engine interface every server component talks to.

Router, prefill worker, KV cache manager and decode worker never touch model math directly; they
hand an engine a batch of :class:`SeqStep` (prefill chunks and decode steps mixed) and get next
tokens back. The engine owns a paged KV pool (nano-vllm style): ``num_blocks`` blocks of
``block_size`` token slots, per layer, K and V. Which blocks a sequence uses is decided outside the
engine (by the KV cache manager) and passed in as a block table, so prefix sharing, eviction and
transfer are engine-independent.

Implementations: ``cpu`` (a real small transformer; numpy, or torch on cpu/cuda/musa) and ``sim``
(the hardware twin: same interface, step time from a roofline model, KV accounted but not stored).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Sequence


# pool dtype -> numpy dtype of its blocks on the host (see ModelShape.host_dtype)
HOST_DTYPES = {"bfloat16": "uint16", "fp8_e4m3": "float32"}


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What a KV block looks like on the wire and in memory; also the cache-invalidation key."""

    name: str
    version: str          # changes whenever weights or config change: prefix caches keyed by it
    layers: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    kv_dtype: str         # "float32", "float16", "bfloat16", "fp8_e4m3", ... (as stored in the pool)

    def kv_bytes_per_token(self) -> int:
        from numpy import dtype

        itemsize = 1 if self.kv_dtype.startswith("fp8") else (2 if self.kv_dtype == "bfloat16" else dtype(self.kv_dtype).itemsize)
        return 2 * self.layers * self.kv_heads * self.head_dim * itemsize

    def host_dtype(self) -> Any:
        """numpy dtype of the host arrays ``read_blocks`` returns (numpy lacks bfloat16 and FP8: a
        bfloat16 pool's blocks come as raw uint16 patterns, an FP8 pool's dequantized to float32)."""
        from numpy import dtype

        return dtype(HOST_DTYPES.get(self.kv_dtype, self.kv_dtype))

    def host_bytes_per_token(self) -> int:
        """Bytes of one token's KV in ``read_blocks``' host arrays (what a host store slot holds)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.host_dtype().itemsize


@dataclass(slots=True)
class SeqStep:
    """One sequence's share of an engine step.

    ``token_ids`` are the new tokens to run: a prefill chunk, or the single last token when
    decoding. Positions ``[0, start_pos)`` already have KV in ``block_table``; the engine writes KV
    for positions ``[start_pos, start_pos + len(token_ids))`` into the same table, which the caller
    has made long enough.
    """

    seq_id: str
    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]


@dataclass(frozen=True, slots=True)
class VirtualKV:
    """KV that the ``sim`` engine accounts for but never allocates: transfer code moves the header and
    models the wire time of ``nbytes`` instead of copying them, so 400K-token contexts fit on a laptop."""

    n_blocks: int
    nbytes: int


class Engine(ABC):
    shape: ModelShape
    block_size: int
    num_blocks: int

    @abstractmethod
    def step(self, batch: Sequence[SeqStep]) -> list[int]:
        """Run one batched forward pass; return the greedy next token for each item, in order.

        Blocks until the step is done (real compute, or the modeled time for ``sim``), so a worker's
        step loop measures true step time with a clock around this call.
        """

    @abstractmethod
    def read_blocks(self, block_ids: Sequence[int]) -> Any:
        """KV of these blocks for transfer: an array ``[layers, 2, n_blocks, block_size, kv_heads,
        head_dim]`` (real engines) or a :class:`VirtualKV` (``sim``)."""

    def read_blocks_into(self, block_ids: Sequence[int], out: Any) -> None:
        """:meth:`read_blocks` into ``out`` (a writable array of that shape and dtype, e.g. a view over a KV
        store's registered memory): engines that can gather from their pool straight into it override this,
        saving the copy in between."""
        out[...] = self.read_blocks(block_ids)

    @abstractmethod
    def write_blocks(self, block_ids: Sequence[int], kv: Any) -> None:
        """Install transferred KV (as returned by :meth:`read_blocks` on a peer) into these blocks."""
