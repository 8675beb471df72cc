"""Hash-chained block prefix cache over the engine's paged KV pool (nano-vllm's idea, with tenants and LRU).

A sequence's KV lives in ``block_size``-token blocks named by a block table. A *full* block whose KV
has been written is registered under a chained hash::

    h_0 = H(root(namespace, tenant), tokens[0:B]),   h_i = H(h_{i-1}, tokens[i*B:(i+1)*B])

so a block hash names the whole prefix up to and including that block. A later prompt walks its own
chain and reuses every leading block whose hash is registered. Because the root mixes in the
namespace (model name + version + config) and the tenant, another tenant or another model version
produces different hashes and never hits.

``H`` is SHA-256 (truncated to 128 bits) by default: an attacker who can send prompts cannot craft two
blocks with one hash, as they can for a fast non-cryptographic hash (vLLM moved to SHA-256 for this,
GHSA-rm76-4mrf-v9r8). ``xxh3`` (128-bit) is the opt-in speed mode (``--block-hash xxh3``) for trusted
traffic. Either way a hit is accepted only if the registered block's tokens equal the prompt's, so a
collision can cost a cache miss, never another prompt's KV.

Block states: *in use* (ref_count > 0), *cached* (ref_count == 0, hash registered, evictable, kept in
LRU order), *free* (no hash). Allocation takes free blocks first, then evicts the least recently
released cached block. In-use blocks are never evicted.

Hashes are registered by :meth:`BlockManager.commit`, after the KV is written — not at allocation as
in nano-vllm — because in a disaggregated server the KV arrives later (prefill, transfer) and a
concurrent request must not hit a block whose KV is not there yet.

Hit rule: a prompt of ``n`` tokens reuses at most ``(n - 1) // block_size`` full blocks, so at least
one prompt token is always computed (its logits give the first output token). An 8192-token prompt
with 512-token blocks therefore reports 7680 cached tokens on a repeat (15 of its 16 blocks), the
same rule as vLLM's ``max_cache_hit_length = num_tokens - 1``.

A lock guards the public methods, so a worker's engine thread and its event loop may share one
instance.
"""

from __future__ import annotations

import array
import hashlib
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import xxhash

from reference_server.engine.base import ModelShape


class NoFreeBlocks(RuntimeError):
    """Even after evicting every unreferenced cached block, the request does not fit: queue or reject it."""


@dataclass(frozen=True, slots=True)
class Allocation:
    block_table: list[int]
    cached_tokens: int        # KV already present for positions [0, cached_tokens): start computing there


@dataclass(slots=True)
class CacheStats:
    """Counters for /metrics. One *query* is one :meth:`BlockManager.allocate` (one request's prompt);
    a *hit* is a query that reused at least one block. Token counts are prompt tokens."""

    queries: int = 0
    hits: int = 0
    misses: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0        # cached blocks dropped to make room

    @property
    def hit_ratio(self) -> float:
        """Cached prompt tokens / prompt tokens (the token-weighted prefix hit rate)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclass(slots=True)
class _Seq:
    tenant: str
    block_table: list[int]
    hashes: list[bytes] = field(default_factory=list)   # chain hashes of the leading committed blocks
    shareable: bool = True                              # False once a reset() made its KV stale


def blocks_for_budget(budget_bytes: int, shape: ModelShape, block_size: int) -> int:
    """How many KV blocks a memory budget holds (the ``num_blocks`` the server passes in)."""
    return max(0, budget_bytes // (shape.kv_bytes_per_token() * block_size))


BLOCK_HASHES = ("sha256", "xxh3")


def _digest(algo: str, *parts: bytes) -> bytes:
    """128-bit digest of the concatenated parts."""
    if algo == "sha256":
        h = hashlib.sha256()
    elif algo == "xxh3":
        h = xxhash.xxh3_128()
    else:
        raise ValueError(f"unknown block hash {algo!r} (known: {', '.join(BLOCK_HASHES)})")
    for part in parts:
        h.update(part)
    return h.digest()[:16]


def _block_bytes(block_tokens: Sequence[int]) -> bytes:
    """A block's token ids as int64 bytes: what is hashed and what a hit is compared against
    (array.array converts a list 2.5x faster than numpy; a numpy slice is used as is)."""
    if isinstance(block_tokens, np.ndarray):
        return np.ascontiguousarray(block_tokens, dtype=np.int64).tobytes()
    return array.array("q", block_tokens).tobytes()


def chain_hashes(root: bytes, token_ids: Sequence[int], block_size: int, n_blocks: int,
                 algo: str = "sha256") -> list[bytes]:
    """The chain hashes of the first ``n_blocks`` full blocks of ``token_ids`` under ``root``."""
    out: list[bytes] = []
    parent = root
    for i in range(min(n_blocks, len(token_ids) // block_size)):
        parent = _digest(algo, parent, _block_bytes(token_ids[i * block_size:(i + 1) * block_size]))
        out.append(parent)
    return out


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, namespace: str, hash_algo: str = "sha256",
                 reuse_shortfall: int = 0) -> None:
        """``reuse_shortfall`` is a test hook (``--debug-reuse-shortfall``): every allocation reuses that many
        cached blocks fewer than it matched — an off-by-one in prefix reuse — so the engine really computes
        those tokens again. The perf gate's check that it catches a regression in a real code path."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        _digest(hash_algo)      # an unknown name fails here, not on the first request
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.namespace = namespace
        self.hash_algo = hash_algo
        self.reuse_shortfall = reuse_shortfall
        self.stats = CacheStats()
        self._ref = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._tokens_of: dict[int, bytes] = {}                   # registered block id -> its token bytes
        self._block_of: dict[bytes, int] = {}                    # registered hash -> block id
        self._free: deque[int] = deque(range(num_blocks))        # no hash: allocate these first
        self._cached: OrderedDict[int, None] = OrderedDict()     # ref 0 with hash, oldest release first
        self._seqs: dict[str, _Seq] = {}
        self._lock = threading.Lock()

    # ---- queries (no side effects) -------------------------------------------------------------

    def match_prefix(self, tenant: str, token_ids: Sequence[int]) -> int:
        """Tokens a prompt would get from the cache now (full blocks, at most ``len - 1``)."""
        with self._lock:
            return len(self._match(tenant, token_ids)[1]) * self.block_size

    def usage(self) -> float:
        """Fraction of blocks referenced by running sequences (cached-but-unreferenced count as free,
        as in vLLM's kv_cache_usage)."""
        with self._lock:
            return (self.num_blocks - len(self._free) - len(self._cached)) / self.num_blocks

    def num_free_blocks(self) -> int:
        """Blocks an allocation could obtain right now (free plus evictable)."""
        with self._lock:
            return len(self._free) + len(self._cached)

    def lookup(self, tenant: str, token_ids: Sequence[int]) -> tuple[int, list[bytes]]:
        """``(tokens the cache holds now, chain hashes of every block the prompt may reuse)`` in one
        hashing pass (outside the lock): a local match followed by a lookup in the host store."""
        bs, n = self.block_size, max(0, (len(token_ids) - 1) // self.block_size)
        datas = [_block_bytes(token_ids[i * bs:(i + 1) * bs]) for i in range(n)]
        hashes: list[bytes] = []
        parent = self._root(tenant)
        for data in datas:
            parent = _digest(self.hash_algo, parent, data)
            hashes.append(parent)
        with self._lock:
            hit = 0
            for h, data in zip(hashes, datas):
                b = self._block_of.get(h)
                if b is None or self._tokens_of[b] != data:     # a collision is a miss, never a wrong hit
                    break
                hit += 1
        return hit * bs, hashes

    def hashes(self, tenant: str, token_ids: Sequence[int]) -> list[bytes]:
        """Chain hashes of the blocks a prompt may reuse (at most ``(n - 1) // block_size``): the keys
        of the shared KV store."""
        return chain_hashes(self._root(tenant), token_ids, self.block_size,
                            max(0, (len(token_ids) - 1) // self.block_size), self.hash_algo)

    def committed(self, seq_id: str) -> tuple[list[bytes], list[int]]:
        """Chain hashes of a sequence's committed blocks and the block ids holding their KV."""
        with self._lock:
            seq = self._seqs[seq_id]
            return list(seq.hashes), list(seq.block_table[:len(seq.hashes)])

    def block_table(self, seq_id: str) -> list[int]:
        with self._lock:
            return list(self._seqs[seq_id].block_table)

    # ---- lifecycle of a sequence ---------------------------------------------------------------

    def allocate(self, seq_id: str, tenant: str, token_ids: Sequence[int]) -> Allocation:
        """Blocks for a whole prompt: leading cached blocks shared (ref_count + 1), the rest fresh.

        All or nothing: raises :class:`NoFreeBlocks` without changing any state if it cannot fit.
        """
        n = len(token_ids)
        with self._lock:
            if seq_id in self._seqs:
                raise ValueError(f"sequence {seq_id!r} already has blocks")
            hashes, hit_ids = self._match(tenant, token_ids)
            if self.reuse_shortfall:          # test hook: recompute the last matched blocks (see __init__)
                keep = max(0, len(hit_ids) - self.reuse_shortfall)
                hashes, hit_ids = hashes[:keep], hit_ids[:keep]
            need = -(-n // self.block_size) - len(hit_ids)
            reclaimed = sum(1 for b in hit_ids if self._ref[b] == 0)   # leave the evictable set when reused
            if need > len(self._free) + len(self._cached) - reclaimed:
                raise NoFreeBlocks(f"{seq_id}: needs {need} new blocks, "
                                   f"{len(self._free) + len(self._cached) - reclaimed} obtainable")
            for b in hit_ids:
                if self._ref[b] == 0:
                    del self._cached[b]
                self._ref[b] += 1
            table = hit_ids + [self._take_block() for _ in range(need)]
            self._seqs[seq_id] = _Seq(tenant, table, hashes)
            cached = len(hit_ids) * self.block_size
            s = self.stats
            s.queries += 1
            s.query_tokens += n
            s.hit_tokens += cached
            if cached:
                s.hits += 1
            else:
                s.misses += 1
            return Allocation(list(table), cached)

    def ensure_capacity(self, seq_id: str, total_tokens: int) -> list[int]:
        """Grow the table to hold ``total_tokens`` (decode appends); returns the table. All or nothing."""
        with self._lock:
            seq = self._seqs[seq_id]
            need = -(-total_tokens // self.block_size) - len(seq.block_table)
            if need > len(self._free) + len(self._cached):
                raise NoFreeBlocks(f"{seq_id}: needs {need} more blocks, {len(self._free) + len(self._cached)} obtainable")
            seq.block_table.extend(self._take_block() for _ in range(need))
            return list(seq.block_table)

    def commit(self, seq_id: str, token_ids: Sequence[int]) -> int:
        """Register the full blocks of ``token_ids`` (tokens whose KV is now written) for reuse.

        Call after prefill (prompt) and optionally as decode fills blocks; pass only tokens whose KV
        exists — during decode the newest sampled token has none yet. Returns blocks now committed.
        If an identical block is already registered (two identical prompts computed concurrently), the
        first stays canonical and this one remains private, freed normally later.
        """
        with self._lock:
            seq = self._seqs[seq_id]
            full = min(len(token_ids) // self.block_size, len(seq.block_table))
            done = len(seq.hashes)
            if full <= done or not seq.shareable:
                return done
            parent = seq.hashes[-1] if seq.hashes else self._root(seq.tenant)
            bs = self.block_size
            for i in range(done, full):
                data = _block_bytes(token_ids[i * bs:(i + 1) * bs])
                h = _digest(self.hash_algo, parent, data)
                b = seq.block_table[i]
                if h not in self._block_of and self._hash_of[b] is None:
                    self._block_of[h] = b
                    self._hash_of[b] = h
                    self._tokens_of[b] = data
                seq.hashes.append(h)
                parent = h
            return full

    def free(self, seq_id: str) -> None:
        """Release a finished (or aborted) sequence. Its registered blocks stay cached until evicted."""
        with self._lock:
            seq = self._seqs.pop(seq_id, None)
            if seq is None:
                return
            # Tail first: with equal age the deepest blocks are evicted before the shared prefix.
            for b in reversed(seq.block_table):
                self._ref[b] -= 1
                if self._ref[b] == 0:
                    if self._hash_of[b] is not None:
                        self._cached[b] = None
                    else:
                        self._free.append(b)

    def reset(self, namespace: str | None = None) -> None:
        """Forget every cached block (model version or config changed). Running sequences keep their
        blocks, but those blocks are no longer shareable."""
        with self._lock:
            if namespace is not None:
                self.namespace = namespace
            self._block_of.clear()
            self._hash_of = [None] * self.num_blocks
            self._tokens_of.clear()
            self._free.extend(self._cached)
            self._cached.clear()
            for seq in self._seqs.values():
                seq.shareable = False   # its KV came from the old model: never register it

    # ---- internals -----------------------------------------------------------------------------

    def _root(self, tenant: str) -> bytes:
        return _digest(self.hash_algo, f"{self.namespace}\x00{tenant}".encode())

    def _match(self, tenant: str, token_ids: Sequence[int]) -> tuple[list[bytes], list[int]]:
        """Chain hashes and block ids of the leading registered blocks, hashing only until the first
        miss (a long prompt that misses early costs one block's hash, not the whole prompt's)."""
        bs = self.block_size
        hashes: list[bytes] = []
        ids: list[int] = []
        parent = self._root(tenant)
        for i in range(max(0, (len(token_ids) - 1) // bs)):
            data = _block_bytes(token_ids[i * bs:(i + 1) * bs])
            parent = _digest(self.hash_algo, parent, data)
            b = self._block_of.get(parent)
            if b is None or self._tokens_of[b] != data:     # a collision is a miss, never a wrong hit
                break
            hashes.append(parent)
            ids.append(b)
        return hashes, ids

    def _take_block(self) -> int:
        if self._free:
            b = self._free.popleft()
        else:
            b, _ = self._cached.popitem(last=False)
            del self._block_of[self._hash_of[b]]
            self._hash_of[b] = None
            del self._tokens_of[b]
            self.stats.evictions += 1
        self._ref[b] = 1
        return b
