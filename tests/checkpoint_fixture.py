"""Tiny random Hugging Face checkpoints (Llama / Qwen2 / Qwen3 layout), written by the tests themselves,
and a plain numpy forward pass written from the HF modeling formulas (not the engine's code)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

FAMILY = {
    "llama": dict(architectures=["LlamaForCausalLM"], tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-5),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6,
                  head_dim=24),   # Qwen3 sets head_dim apart from hidden / heads
}
VOCAB = 300


def make_checkpoint(root: Path, family: str, *, shards: int = 1, bf16: bool = False, seed: int = 0,
                    vocab: int = VOCAB, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                    ffn: int = 96) -> dict[str, np.ndarray]:
    """Write ``root/{config.json, *.safetensors[, index]}``; return the float32 tensors (after any bf16 rounding).
    ``vocab`` matches a tokenizer's; ``hidden // heads`` is the head size (vLLM's CPU attention wants 32+)."""
    rng = np.random.default_rng(seed)
    kvh, layers = kv_heads, 2
    extra = FAMILY[family]
    hd = extra.get("head_dim", hidden // heads)
    cfg = dict(model_type=family, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
               num_attention_heads=heads, num_key_value_heads=kvh, vocab_size=vocab, max_position_embeddings=4096,
               hidden_act="silu", bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16" if bf16 else "float32",
               attention_bias=False, use_sliding_window=False, **extra)
    t: dict[str, np.ndarray] = {}

    def w(name: str, *shape: int, scale: float | None = None) -> None:
        s = scale if scale is not None else 1 / np.sqrt(shape[-1])
        t[name] = (rng.standard_normal(shape) * s).astype(np.float32)

    # a tied head echoes the input token unless the embedding is small (GPT-2's 0.02)
    w("model.embed_tokens.weight", vocab, hidden, scale=0.02 if extra["tie_word_embeddings"] else 0.5)
    if not extra["tie_word_embeddings"]:
        w("lm_head.weight", vocab, hidden)
    t["model.norm.weight"] = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
        t[p + "post_attention_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
        w(p + "self_attn.q_proj.weight", heads * hd, hidden)
        w(p + "self_attn.k_proj.weight", kvh * hd, hidden)
        w(p + "self_attn.v_proj.weight", kvh * hd, hidden)
        w(p + "self_attn.o_proj.weight", hidden, heads * hd)
        if family == "qwen2":
            for n, rows in (("q", heads * hd), ("k", kvh * hd), ("v", kvh * hd)):
                w(p + f"self_attn.{n}_proj.bias", rows, scale=0.5)
        if family == "qwen3":
            t[p + "self_attn.q_norm.weight"] = (1 + 0.1 * rng.standard_normal(hd)).astype(np.float32)
            t[p + "self_attn.k_norm.weight"] = (1 + 0.1 * rng.standard_normal(hd)).astype(np.float32)
        w(p + "mlp.gate_proj.weight", ffn, hidden)
        w(p + "mlp.up_proj.weight", ffn, hidden)
        w(p + "mlp.down_proj.weight", hidden, ffn)
    if bf16:  # round to bfloat16 (nearest-even on the bits), stored as BF16 (needs torch to write)
        for k, v in t.items():
            bits = v.view(np.uint32)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            t[k] = (bits.astype(np.uint32) << 16).view(np.float32)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg))

    def save(tensors: dict[str, np.ndarray], path: Path) -> None:
        if bf16:   # numpy has no bfloat16: torch writes it (the values are already bf16-exact)
            import torch
            from safetensors.torch import save_file as save_torch

            save_torch({n: torch.from_numpy(v).to(torch.bfloat16) for n, v in tensors.items()}, str(path))
        else:
            save_file(tensors, str(path))

    names = sorted(t)
    if shards == 1:
        save({n: t[n] for n in names}, root / "model.safetensors")
    else:
        weight_map = {}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = names[s::shards]
            save({n: t[n] for n in part}, root / fname)
            weight_map.update({n: fname for n in part})
        (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return t


def reference_logits(t: dict[str, np.ndarray], cfg: dict, ids: list[int]) -> np.ndarray:
    """Logits ``[len(ids), vocab]`` of the whole sequence, float64, straight from the HF formulas:
    RMSNorm, q/k/v projections (+bias), q/k norm, rotate-half RoPE, repeat_kv, causal softmax, o_proj,
    SiLU-gated MLP, final norm, LM head (tied: the embedding)."""
    H, kvh, hidden = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    hd = cfg.get("head_dim", hidden // H)
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    g = {k: v.astype(np.float64) for k, v in t.items()}

    def rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return w * (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps))

    def rotate_half(x: np.ndarray) -> np.ndarray:
        return np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1)

    T = len(ids)
    inv = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    freqs = np.arange(T)[:, None] * inv[None]
    emb = np.concatenate([freqs, freqs], -1)
    cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]
    x = g["model.embed_tokens.weight"][ids]
    causal = np.tril(np.ones((T, T), bool))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, g[p + "input_layernorm.weight"])
        proj = {}
        for n in "qkv":
            y = h @ g[p + f"self_attn.{n}_proj.weight"].T
            if p + f"self_attn.{n}_proj.bias" in g:
                y = y + g[p + f"self_attn.{n}_proj.bias"]
            proj[n] = y.reshape(T, -1, hd)
        q, k, v = proj["q"], proj["k"], proj["v"]
        if p + "self_attn.q_norm.weight" in g:
            q, k = rms(q, g[p + "self_attn.q_norm.weight"]), rms(k, g[p + "self_attn.k_norm.weight"])
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = np.repeat(k, H // kvh, axis=1), np.repeat(v, H // kvh, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)
        s = np.where(causal[None], s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", a, v).reshape(T, H * hd)
        x = x + o @ g[p + "self_attn.o_proj.weight"].T
        h = rms(x, g[p + "post_attention_layernorm.weight"])
        gate, up = h @ g[p + "mlp.gate_proj.weight"].T, h @ g[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ g[p + "mlp.down_proj.weight"].T
    head = g.get("lm_head.weight", g["model.embed_tokens.weight"])
    return rms(x, g["model.norm.weight"]) @ head.T
