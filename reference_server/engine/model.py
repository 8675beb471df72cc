"""A small decoder-only transformer over a paged KV pool: GQA, RoPE, RMSNorm, SwiGLU, tied LM head.

Written once against the array API (``xp``), so numpy and torch run the same lines. A step's tokens
(prefill chunks and decode tokens of many sequences) are concatenated for every matmul; attention
runs per sequence over that sequence's KV gathered from the pool, i.e. over what earlier steps (or
a KV transfer) really wrote there, never over a private copy.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from reference_server.engine.backend import Backend
from reference_server.engine.config import ModelConfig

# Query rows per attention tile: bounds the [rows, context] score matrix (4K context -> a few MB).
ATTN_TILE = 256


@dataclass
class SeqPlan:
    """Where one sequence's tokens sit in the step (rows ``[row, row + n)``) and in the pool."""

    row: int
    n: int
    start: int
    new_slots: Any      # slots (block * block_size + offset) for the new tokens' KV
    ctx_blocks: Any     # the blocks holding positions [0, start + n), in order


def weights_version(cfg: ModelConfig, seed: int, vocab: int) -> str:
    """Cache key of the weights: prefix caches must never serve KV made by other weights."""
    blob = json.dumps({"config": cfg.as_dict(), "seed": seed, "vocab": vocab, "init": 1}, sort_keys=True)
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
    def __init__(self, cfg: ModelConfig, vocab: int, seed: int, backend: Backend, emittable: np.ndarray) -> None:
        self.cfg, self.vocab, self.be, self.xp = cfg, vocab, backend, backend.xp
        self.w = {k: backend.asarray(v) for k, v in init_weights(cfg, vocab, seed).items()}
        bias = np.full(vocab, -np.inf, np.float32)
        bias[emittable] = 0.0
        self.logit_bias = backend.asarray(bias)
        # causal bias of one query tile against its own keys; every earlier key is visible to all rows
        self.tile_bias = backend.asarray(np.triu(np.full((ATTN_TILE, ATTN_TILE), -np.inf, np.float32), k=1))
        self.inv_freq = cfg.rope_theta ** (-np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim)

    # -- pieces -------------------------------------------------------------------------------
    def _rms(self, x: Any, w: Any) -> Any:
        xp = self.xp
        return x * (1.0 / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + self.cfg.norm_eps)) * w

    def _rope_tables(self, positions: np.ndarray) -> tuple[Any, Any]:
        # float64 angles on the host, then float32: identical tables on every backend
        ang = positions[:, None].astype(np.float64) * self.inv_freq[None, :]
        return (self.be.asarray(np.cos(ang)[:, None, :]), self.be.asarray(np.sin(ang)[:, None, :]))

    def _rope(self, x: Any, cos: Any, sin: Any) -> Any:
        half = self.cfg.head_dim // 2
        x1, x2 = x[..., :half], x[..., half:]
        return self.xp.concat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)

    def _attend(self, q: Any, k_all: Any, v_all: Any, plan: SeqPlan) -> Any:
        """Causal GQA attention of ``n`` new queries over ``start + n`` keys -> ``[n, heads*head_dim]``."""
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

    # -- the forward pass ----------------------------------------------------------------------
    def forward(self, tokens: np.ndarray, positions: np.ndarray, plans: list[SeqPlan], pool: Any) -> Any:
        """Run the step; write each new token's K/V into ``pool`` ([layers, 2, blocks, block_size, kvh,
        hd]); return logits ``[len(plans), vocab]`` at each sequence's last new position."""
        xp, cfg, w = self.xp, self.cfg, self.w
        H, kvh, hd = cfg.heads, cfg.kv_heads, cfg.head_dim
        N = tokens.shape[0]
        L, _, nb, bs = pool.shape[:4]
        slots = xp.reshape(pool, (L, 2, nb * bs, kvh, hd))  # a view: writes land in the pool
        x = xp.take(w["embed"], self.be.asarray(tokens, index=True), axis=0)
        cos, sin = self._rope_tables(positions)
        for i in range(cfg.layers):
            qkv = xp.matmul(self._rms(x, w[f"{i}.attn_norm"]), w[f"{i}.wqkv"])
            q = self._rope(xp.reshape(qkv[:, :H * hd], (N, H, hd)), cos, sin)
            k = self._rope(xp.reshape(qkv[:, H * hd:(H + kvh) * hd], (N, kvh, hd)), cos, sin)
            v = xp.reshape(qkv[:, (H + kvh) * hd:], (N, kvh, hd))
            outs = []
            for p in plans:
                rows = slice(p.row, p.row + p.n)
                slots[i, 0, p.new_slots] = k[rows]
                slots[i, 1, p.new_slots] = v[rows]
                # gather whole blocks (contiguous copies), then trim to the context
                ctx = p.start + p.n
                k_all = xp.reshape(pool[i, 0, p.ctx_blocks], (-1, kvh, hd))[:ctx]
                v_all = xp.reshape(pool[i, 1, p.ctx_blocks], (-1, kvh, hd))[:ctx]
                outs.append(self._attend(q[rows], k_all, v_all, p))
            attn = outs[0] if len(outs) == 1 else xp.concat(outs, axis=0)
            x = x + xp.matmul(attn, w[f"{i}.wo"])
            gu = xp.matmul(self._rms(x, w[f"{i}.mlp_norm"]), w[f"{i}.w_gate_up"])
            gate, up = gu[:, :cfg.ffn], gu[:, cfg.ffn:]
            x = x + xp.matmul(gate / (1.0 + xp.exp(-gate)) * up, w[f"{i}.w_down"])
        last = self.be.asarray(np.array([p.row + p.n - 1 for p in plans]), index=True)
        h = self._rms(xp.take(x, last, axis=0), w["final_norm"])
        # the LM head only at each sequence's last position: the 100K-wide matmul is the costly one.
        # (E @ h^T)^T, not h @ E^T: BLAS handles the tall-skinny form of a few-row batch ~1.5x faster
        return xp.permute_dims(xp.matmul(w["embed"], xp.permute_dims(h, (1, 0))), (1, 0)) + self.logit_bias
