"""The paged KV pool and one step's index plan (where each new token's K/V goes, what each sequence reads).

Pool layout (also the transfer layout): ``[layers, 2 (K, V), num_blocks, block_size, kv_heads,
head_dim]``. Storage dtype: float32 (numpy, or torch on a CPU), bfloat16, or FP8 e4m3 with one
float32 scale per ``(layer, K|V, block)`` — the same per-block scaling the transfer codec uses
(:mod:`reference_server.kv.fp8`), so an FP8 pool's blocks go on the wire without a second rounding
scheme.

FP8 writes keep each block's scale equal to its contents' amax / 448: a step's new tokens are written
into the touched blocks in float, each touched block is re-scaled and re-encoded as a whole. A block a
sequence starts at offset 0 is cleared first (whatever a previous owner left there must not set its
scale); a block continued mid-way keeps its valid prefix. Decode touches one block per sequence, so
the re-encoding costs at most one block per sequence per layer next to the context that attention
reads anyway.

Everything here is computed once per step on the host (numpy) and moved to the device in one go;
the per-layer code only indexes with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from reference_server.engine.backend import Backend

KV_DTYPES = ("auto", "float32", "bfloat16", "fp8_e4m3")
E4M3_MAX = 448.0


@dataclass
class SeqPlan:
    """Where one sequence's tokens sit in the step (rows ``[row, row + n)``) and in the pool."""

    row: int
    n: int
    start: int
    ctx_blocks: Any     # the blocks holding positions [0, start + n), in order (None: a batched decode
                        # item, which reads its row of StepPlan.dec_tables instead)


@dataclass
class StepPlan:
    positions: np.ndarray
    tokens: Any                    # [N] token ids (device)
    slots: Any                     # [N] every new token's slot, in row order (one scatter per layer)
    seqs: list[SeqPlan]
    last_rows: Any                 # [S] each sequence's last row (the LM head runs there only)
    # batched decode (items with one new token): their rows, padded block tables, key-validity mask
    dec_rows: Any = None           # [B]
    dec_tables: Any = None         # [B, max_blocks]
    dec_valid: Any = None          # [B, max_blocks * block_size] bool
    prefills: list[SeqPlan] = field(default_factory=list)   # items with more than one new token
    # FP8 pools: the blocks the step writes, whether each starts empty, each new token's place in them
    w_blocks: Any = None           # [U]
    w_fresh: Any = None            # [U] bool
    w_local: Any = None            # [N] index into the [U * block_size] touched-block buffer


def make_plan(be: Backend, batch: Sequence[Any], block_size: int, *, fp8: bool, batched_decode: bool) -> StepPlan:
    bs = block_size
    tokens = np.concatenate([np.asarray(s.token_ids, dtype=np.int64) for s in batch])
    positions = np.concatenate([np.arange(s.start_pos, s.start_pos + len(s.token_ids)) for s in batch])
    seqs, slots, row, decode = [], [], 0, []
    for i, s in enumerate(batch):
        n, end = len(s.token_ids), s.start_pos + len(s.token_ids)
        table = np.asarray(s.block_table[:-(-end // bs)], dtype=np.int64)
        pos = np.arange(s.start_pos, end, dtype=np.int64)
        slots.append(table[pos // bs] * bs + pos % bs)
        # one host->device copy per sequence only where attention reads it per sequence
        ctx = None if batched_decode and n == 1 else be.asarray(table, index=True)
        seqs.append(SeqPlan(row, n, s.start_pos, ctx))
        if n == 1:
            decode.append((i, table, end))
        row += n
    all_slots = np.concatenate(slots)
    plan = StepPlan(positions, be.asarray(tokens, index=True), be.asarray(all_slots, index=True), seqs,
                    be.asarray(np.array([p.row + p.n - 1 for p in seqs]), index=True))
    if batched_decode:
        plan.prefills = [seqs[i] for i in range(len(batch)) if seqs[i].n > 1]
        if decode:
            width = max(len(t) for _, t, _ in decode)
            tables = np.zeros((len(decode), width), np.int64)
            valid = np.zeros((len(decode), width * bs), bool)
            for j, (_, t, ctx) in enumerate(decode):
                tables[j, :len(t)] = t
                valid[j, :ctx] = True
            plan.dec_rows = be.asarray(np.array([seqs[i].row for i, _, _ in decode]), index=True)
            plan.dec_tables = be.asarray(tables, index=True)
            plan.dec_valid = be.xp.asarray(valid, device=be.device)
    if fp8:
        blocks, inverse = np.unique(all_slots // bs, return_inverse=True)
        first = np.full(len(blocks), bs, np.int64)
        np.minimum.at(first, inverse, all_slots % bs)
        plan.w_blocks = be.asarray(blocks, index=True)
        plan.w_fresh = be.xp.asarray(first == 0, device=be.device)
        plan.w_local = be.asarray(inverse * bs + all_slots % bs, index=True)
    return plan


def resolve_kv_dtype(kv_dtype: str, be: Backend) -> str:
    """``auto``: the compute dtype. FP8 and bfloat16 pools need torch (numpy has neither type)."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"unknown KV dtype {kv_dtype!r}; valid: {', '.join(KV_DTYPES)}")
    if kv_dtype == "auto":
        return be.dtype_name
    if be.name == "numpy" and kv_dtype != "float32":
        raise ValueError(f"a {kv_dtype} KV pool needs --backend torch (numpy has no such dtype)")
    return kv_dtype


class KVPool:
    def __init__(self, be: Backend, shape: tuple[int, int, int, int, int], kv_dtype: str) -> None:
        layers, num_blocks, block_size, kv_heads, head_dim = shape
        self.be, self.kv_dtype, self.block_size = be, kv_dtype, block_size
        self.shape = (layers, 2, num_blocks, block_size, kv_heads, head_dim)
        self.fp8 = kv_dtype == "fp8_e4m3"
        xp = be.xp
        if be.name == "numpy":
            self.data = xp.zeros(self.shape, dtype=np.float32)
        else:
            import torch

            dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}[kv_dtype]
            self.data = torch.zeros(self.shape, dtype=dtype, device=be.device)
            self.scales = torch.ones(self.shape[:3], dtype=torch.float32, device=be.device) if self.fp8 else None
            self._scratch: list[Any] = [None, None]     # gather buffers for K and V (see gather)

    @staticmethod
    def bytes_per_block(shape: tuple[int, int, int, int], kv_dtype: str) -> int:
        """``shape`` = (layers, block_size, kv_heads, head_dim); FP8 adds its two float32 scales per layer."""
        layers, bs, kvh, hd = shape
        item = {"float32": 4, "bfloat16": 2, "fp8_e4m3": 1}[kv_dtype]
        return 2 * layers * bs * kvh * hd * item + (8 * layers if kv_dtype == "fp8_e4m3" else 0)

    # ---- per layer, inside a step -------------------------------------------------------------
    def write(self, layer: int, plan: StepPlan, k: Any, v: Any) -> None:
        """Store the step's new K/V ``[N, kv_heads, head_dim]`` at their slots."""
        L, _, nb, bs, kvh, hd = self.shape
        for j, x in ((0, k), (1, v)):
            if not self.fp8:
                flat = self.be.xp.reshape(self.data[layer, j], (nb * bs, kvh, hd))  # a view: writes land in the pool
                flat[plan.slots] = x if self.be.name == "numpy" else x.to(self.data.dtype)
                continue
            codes, scales = self.data[layer, j], self.scales[layer, j]
            blocks = plan.w_blocks
            f = codes[blocks].float() * scales[blocks][:, None, None, None]        # [U, bs, kvh, hd]
            f = f * (~plan.w_fresh).to(f.dtype)[:, None, None, None]
            f.view(-1, kvh, hd)[plan.w_local] = x.float()
            amax = f.abs().amax(dim=(1, 2, 3))
            s = self.be.xp.where(amax > 0, amax / E4M3_MAX, self.be.xp.ones_like(amax))
            codes[blocks] = (f / s[:, None, None, None]).clamp(-E4M3_MAX, E4M3_MAX).to(codes.dtype)
            scales[blocks] = s

    def gather(self, layer: int, j: int, blocks: Any, dtype: Any) -> Any:
        """K (j=0) or V (j=1) of ``blocks`` (any index shape) -> ``[*blocks.shape, block_size, kvh, hd]``.

        torch gathers into a scratch buffer kept across layers and steps: a fresh multi-MB tensor per
        layer costs page faults on a CPU (4-7x the copy itself at batch 32 x 4K context here)."""
        if self.be.name == "numpy":
            return self.data[layer, j][blocks]
        import torch

        flat = blocks.reshape(-1)
        n = flat.shape[0]
        buf = self._scratch[j]
        if buf is None or buf.shape[0] < n:
            buf = self._scratch[j] = torch.empty((n, *self.shape[3:]), dtype=self.data.dtype, device=self.data.device)
        x = torch.index_select(self.data[layer, j], 0, flat, out=buf[:n]).reshape(*blocks.shape, *self.shape[3:])
        if self.fp8:
            x = x.float() * self.scales[layer, j][blocks][..., None, None, None]
        return x.to(dtype)

    # ---- whole blocks, for transfer ------------------------------------------------------------
    def read(self, block_ids: Sequence[int]) -> np.ndarray:
        """Host copy ``[layers, 2, n, block_size, kvh, hd]``: float32 (float32 and FP8 pools: an FP8
        pool dequantized, which the codec re-encodes to the same codes), or bfloat16 bits as uint16."""
        idx = self.be.asarray(np.asarray(block_ids, dtype=np.int64), index=True)
        if self.be.name == "numpy":
            return np.ascontiguousarray(self.data[:, :, idx])
        from reference_server.kv.staging import to_host

        x = self.data[:, :, idx]
        if self.fp8:
            x = x.float() * self.scales[:, :, idx][..., None, None, None]
        return to_host(x)

    def read_into(self, block_ids: Sequence[int], out: np.ndarray) -> None:
        """:meth:`read` into ``out`` (any strides): a numpy pool gathers each block straight into it (one
        copy); a torch pool stages through :meth:`read` (its gather, host staging and dequantization)."""
        if self.be.name != "numpy":
            out[...] = self.read(block_ids)
            return
        for j, b in enumerate(block_ids):
            out[:, :, j] = self.data[:, :, b]

    def install(self, block_ids: Sequence[int], kv: np.ndarray) -> None:
        """Write host KV (as :meth:`read` returns it, or float32 for any pool) into these blocks."""
        idx = self.be.asarray(np.asarray(block_ids, dtype=np.int64), index=True)
        if self.be.name == "numpy":
            self.data[:, :, idx] = np.asarray(kv, dtype=np.float32)
            return
        from reference_server.kv.staging import to_device

        x = to_device(kv, self.be.device)
        if not self.fp8:
            self.data[:, :, idx] = x.to(self.data.dtype)
            return
        x = x.float()
        amax = x.abs().amax(dim=(3, 4, 5))
        s = self.be.xp.where(amax > 0, amax / E4M3_MAX, self.be.xp.ones_like(amax))
        self.data[:, :, idx] = (x / s[..., None, None, None]).clamp(-E4M3_MAX, E4M3_MAX).to(self.data.dtype)
        self.scales[:, :, idx] = s
