"""A decoder-only transformer over a paged KV pool: GQA, RoPE, RMSNorm, SwiGLU (the Llama / Qwen2 /
Qwen3 block: optional q/k/v biases, per-head q/k RMSNorm, tied or separate LM head).

Written once against the array API (``xp``), so numpy and torch run the same lines. A step's tokens
(prefill chunks and decode tokens of many sequences) are concatenated for every matmul; attention
reads each sequence's KV gathered from the pool, i.e. what earlier steps (or a KV transfer) really
wrote there, never a private copy. Attention itself comes in two forms over the same pool:

* numpy (the reference): per sequence, tiled by 256 query rows, softmax written out;
* torch: every decode item of the step in one ``scaled_dot_product_attention`` call over its
  gathered blocks (padded tables, a key-validity mask; a group's query heads are its query rows, so
  K/V are never expanded for GQA), and each prefill chunk in one call with a lower-right causal mask
  (flash / memory-efficient kernels where the device has them).
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import numpy as np

from reference_server.engine.backend import Backend
from reference_server.engine.config import ModelConfig
from reference_server.engine.paged import KVPool, SeqPlan, StepPlan

# Query rows per attention tile (numpy): bounds the [rows, context] score matrix (4K context -> a few MB).
ATTN_TILE = 256


def weights_version(cfg: ModelConfig, seed: int, vocab: int) -> str:
    """Cache key of the built-in random weights: prefix caches must never serve KV made by other weights."""
    d = cfg.as_dict()
    for k in ("vocab", "tied_head", "qkv_bias", "o_bias", "qk_norm"):   # defaults of the built-ins: key unchanged
        d.pop(k)
    blob = json.dumps({"config": d, "seed": seed, "vocab": vocab, "init": 1}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def init_weights(cfg: ModelConfig, vocab: int, seed: int) -> dict[str, np.ndarray]:
    """Deterministic random weights (numpy, float32), scaled 1/sqrt(fan_in) so activations stay O(1)."""
    rng = np.random.default_rng(seed)

    def dense(fan_in: int, fan_out: int) -> np.ndarray:
        return rng.standard_normal((fan_in, fan_out), dtype=np.float32) * np.float32(1 / math.sqrt(fan_in))

    d, hd = cfg.hidden, cfg.head_dim
    # small embedding (GPT-2 style 0.02): with a tied LM head, O(1) embeddings make the residual echo
    # the input token, and greedy decoding would repeat one token forever
    w = {"embed": rng.standard_normal((vocab, d), dtype=np.float32) * np.float32(0.02),
         "final_norm": np.ones(d, np.float32)}
    for i in range(cfg.layers):
        w[f"{i}.attn_norm"] = np.ones(d, np.float32)
        w[f"{i}.wqkv"] = dense(d, (cfg.heads + 2 * cfg.kv_heads) * hd)
        w[f"{i}.wo"] = dense(cfg.heads * hd, d)
        w[f"{i}.mlp_norm"] = np.ones(d, np.float32)
        w[f"{i}.w_gate_up"] = dense(d, 2 * cfg.ffn)
        w[f"{i}.w_down"] = dense(cfg.ffn, d)
    return w


class Transformer:
    def __init__(self, cfg: ModelConfig, weights: dict[str, Any], backend: Backend, emittable: np.ndarray,
                 inv_freq: np.ndarray) -> None:
        """``weights``: host numpy (moved here) or arrays already on the backend (a checkpoint's)."""
        self.cfg, self.be, self.xp = cfg, backend, backend.xp
        self.w = {k: backend.asarray(v) for k, v in weights.items()}
        self.vocab = int(self.w["embed"].shape[0])
        bias = np.full(self.vocab, -np.inf, np.float32)
        bias[emittable] = 0.0
        self.logit_bias = backend.asarray(bias)
        # causal bias of one query tile against its own keys; every earlier key is visible to all rows
        self.tile_bias = backend.asarray(np.triu(np.full((ATTN_TILE, ATTN_TILE), -np.inf, np.float32), k=1))
        self.inv_freq = inv_freq
        self.batched = backend.name == "torch"

    # -- pieces -------------------------------------------------------------------------------
    def _rms(self, x: Any, w: Any) -> Any:
        """RMSNorm in float32 (as HF does), back to the activation dtype, then the weight."""
        xp = self.xp
        f32 = self.be.name == "numpy" or x.dtype == self.be.xp.float32
        xf = x if f32 else xp.astype(x, xp.float32)
        y = xf * (1.0 / xp.sqrt(xp.mean(xf * xf, axis=-1, keepdims=True) + self.cfg.norm_eps))
        return (y if f32 else xp.astype(y, x.dtype)) * w

    def _rope_tables(self, positions: np.ndarray) -> tuple[Any, Any]:
        # float64 angles on the host, then the compute dtype: identical tables on every backend
        ang = positions[:, None].astype(np.float64) * self.inv_freq[None, :]
        return (self.be.asarray(np.cos(ang)[:, None, :]), self.be.asarray(np.sin(ang)[:, None, :]))

    def _rope(self, x: Any, cos: Any, sin: Any) -> Any:
        half = self.cfg.head_dim // 2
        x1, x2 = x[..., :half], x[..., half:]
        return self.xp.concat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)

    def _attend(self, q: Any, k_all: Any, v_all: Any, plan: SeqPlan) -> Any:
        """numpy: causal GQA attention of ``n`` new queries over ``start + n`` keys -> ``[n, heads*head_dim]``."""
        xp, cfg = self.xp, self.cfg
        n, kvh, g, hd = plan.n, cfg.kv_heads, cfg.heads // cfg.kv_heads, cfg.head_dim
        # group query heads under their kv head: [kvh, n*g, hd]; rows stay in query order
        qg = xp.reshape(xp.permute_dims(xp.reshape(q, (n, kvh, g, hd)), (1, 0, 2, 3)), (kvh, n * g, hd))
        kt = xp.permute_dims(k_all, (1, 2, 0))   # [kvh, hd, T]
        vt = xp.permute_dims(v_all, (1, 0, 2))   # [kvh, T, hd]
        qg = qg * (1.0 / math.sqrt(hd))
        outs = []
        for i0 in range(0, n, ATTN_TILE):
            i1 = min(n, i0 + ATTN_TILE)
            t, end = i1 - i0, plan.start + i1       # keys [0, end) are visible to the tile's last query
            s = xp.matmul(qg[:, i0 * g:i1 * g, :], kt[:, :, :end])                # [kvh, t*g, end]
            if t > 1:  # only the tile's own keys [end - t, end) need the causal mask
                s = xp.reshape(s, (kvh, t, g, end))
                s[..., end - t:] += self.tile_bias[:t, None, :t]
                s = xp.reshape(s, (kvh, t * g, end))
            s = xp.exp(s - xp.max(s, axis=-1, keepdims=True))
            # normalise after the PV product: divides t*g*hd numbers instead of t*g*end
            outs.append(xp.matmul(s, vt[:, :end, :]) / xp.sum(s, axis=-1, keepdims=True))
        o = outs[0] if len(outs) == 1 else xp.concat(outs, axis=1)
        return xp.reshape(xp.permute_dims(xp.reshape(o, (kvh, n, g, hd)), (1, 0, 2, 3)), (n, cfg.heads * hd))

    def _attention_loop(self, layer: int, q: Any, pool: KVPool, plan: StepPlan) -> Any:
        """numpy reference: one sequence at a time over its gathered blocks, trimmed to its context."""
        xp, kvh, hd = self.xp, self.cfg.kv_heads, self.cfg.head_dim
        outs = []
        for p in plan.seqs:
            ctx = p.start + p.n
            k_all = xp.reshape(pool.gather(layer, 0, p.ctx_blocks, None), (-1, kvh, hd))[:ctx]
            v_all = xp.reshape(pool.gather(layer, 1, p.ctx_blocks, None), (-1, kvh, hd))[:ctx]
            outs.append(self._attend(q[p.row:p.row + p.n], k_all, v_all, p))
        return outs[0] if len(outs) == 1 else xp.concat(outs, axis=0)

    def _attention_batched(self, layer: int, q: Any, pool: KVPool, plan: StepPlan) -> Any:
        """torch: all decode items in one SDPA call; each prefill chunk in one call (lower-right causal)."""
        import torch
        import torch.nn.functional as F
        from torch.nn.attention.bias import causal_lower_right

        H, kvh, hd = self.cfg.heads, self.cfg.kv_heads, self.cfg.head_dim
        out = torch.empty((q.shape[0], H, hd), dtype=q.dtype, device=q.device)
        if plan.dec_rows is not None:
            B = plan.dec_rows.shape[0]
            # [B, max_blocks, bs, kvh, hd] -> [B, kvh, S, hd]
            k = pool.gather(layer, 0, plan.dec_tables, q.dtype).reshape(B, -1, kvh, hd).transpose(1, 2)
            v = pool.gather(layer, 1, plan.dec_tables, q.dtype).reshape(B, -1, kvh, hd).transpose(1, 2)
            # one new token per sequence: the H // kvh query heads of a group are the "query rows" against
            # their kv head, so GQA needs no K/V expansion (which enable_gqa's fallback kernels would copy)
            qg = q[plan.dec_rows].reshape(B, kvh, H // kvh, hd)
            o = F.scaled_dot_product_attention(qg, k, v, attn_mask=plan.dec_valid[:, None, None, :])
            out[plan.dec_rows] = o.reshape(B, H, hd)
        for p in plan.prefills:
            ctx = p.start + p.n
            k = pool.gather(layer, 0, p.ctx_blocks, q.dtype).reshape(-1, kvh, hd)[:ctx].transpose(0, 1)[None]
            v = pool.gather(layer, 1, p.ctx_blocks, q.dtype).reshape(-1, kvh, hd)[:ctx].transpose(0, 1)[None]
            qp = q[p.row:p.row + p.n].transpose(0, 1)[None]                       # [1, H, n, hd]
            if p.start == 0:
                o = F.scaled_dot_product_attention(qp, k, v, is_causal=True, enable_gqa=True)
            else:
                o = F.scaled_dot_product_attention(qp, k, v, attn_mask=causal_lower_right(p.n, ctx), enable_gqa=True)
            out[p.row:p.row + p.n] = o[0].transpose(0, 1)
        return out.reshape(q.shape[0], H * hd)

    # -- the forward pass ----------------------------------------------------------------------
    def forward(self, plan: StepPlan, pool: KVPool) -> Any:
        """Run the step; write each new token's K/V into ``pool``; return logits ``[len(seqs), vocab]``
        (on the backend's device) at each sequence's last new position."""
        xp, cfg, w = self.xp, self.cfg, self.w
        H, kvh, hd = cfg.heads, cfg.kv_heads, cfg.head_dim
        N = plan.positions.shape[0]
        x = xp.take(w["embed"], plan.tokens, axis=0)
        cos, sin = self._rope_tables(plan.positions)
        for i in range(cfg.layers):
            qkv = xp.matmul(self._rms(x, w[f"{i}.attn_norm"]), w[f"{i}.wqkv"])
            if cfg.qkv_bias:
                qkv = qkv + w[f"{i}.bqkv"]
            q = xp.reshape(qkv[:, :H * hd], (N, H, hd))
            k = xp.reshape(qkv[:, H * hd:(H + kvh) * hd], (N, kvh, hd))
            v = xp.reshape(qkv[:, (H + kvh) * hd:], (N, kvh, hd))
            if cfg.qk_norm:
                q, k = self._rms(q, w[f"{i}.q_norm"]), self._rms(k, w[f"{i}.k_norm"])
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            pool.write(i, plan, k, v)
            attn = (self._attention_batched if self.batched else self._attention_loop)(i, q, pool, plan)
            o = xp.matmul(attn, w[f"{i}.wo"])
            x = x + (o + w[f"{i}.bo"] if cfg.o_bias else o)
            gu = xp.matmul(self._rms(x, w[f"{i}.mlp_norm"]), w[f"{i}.w_gate_up"])
            gate, up = gu[:, :cfg.ffn], gu[:, cfg.ffn:]
            x = x + xp.matmul(gate / (1.0 + xp.exp(-gate)) * up, w[f"{i}.w_down"])
        h = self._rms(xp.take(x, plan.last_rows, axis=0), w["final_norm"])
        # the LM head only at each sequence's last position: the 100K-wide matmul is the costly one.
        # (E @ h^T)^T, not h @ E^T: BLAS handles the tall-skinny form of a few-row batch ~1.5x faster
        head = w["embed"] if cfg.tied_head else w["lm_head"]
        return xp.permute_dims(xp.matmul(head, xp.permute_dims(h, (1, 0))), (1, 0)) + self.logit_bias
